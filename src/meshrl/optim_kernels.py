"""The bf16 "kahan" AdamW step of `meshrl.optim.FusedAdamW` as one Triton kernel (GPU): read the bf16 weight,
its bf16 compensation, the gradient, exp_avg and exp_avg_sq once, write the four bf16 tensors once (~18 bytes per
parameter with bf16 gradients), for all the parameters of a group in one launch.

Why our own kernel: torch's AdamW has no compensated-summation variant (its fused kernel stores a bf16 weight
rounded to nearest, which loses updates below half a bf16 step), so FusedAdamW's torch formulation widens
everything to float32 scratch, runs torch's fused kernel there and splits the result back (~100 bytes per
parameter). torchao's AdamW offers bf16 *stochastic* rounding, not a compensation buffer, and is not our step
(state layout, clip, `found_inf`, CUDA graph); AnyPrecisionAdamW (torchdistx) has a Kahan buffer but is an eager
loop of torch ops per tensor.

The math is torch's CUDA fused AdamW kernel's per element (aten/src/ATen/native/cuda/fused_adam_utils.cuh,
ADAMW mode: the same fmas, IEEE division and square root, powf for the bias corrections, all in float32) on the
widened weight float(weight) + float(comp); the new float32 weight w is stored as weight = bf16(w) rounded to
nearest even and comp = bf16(w - weight), exp_avg / exp_avg_sq rounded to nearest even. A step with found_inf
set leaves all four tensors as they were (the step counts are the caller's: FusedAdamW adds 1 before and
subtracts found_inf after, as torch does).

Launch layout: per launch a table with one int64 row per tensor (addresses of weight, comp, exp_avg,
exp_avg_sq, grad and step, numel, first block) and an int32 block table (one entry per BLOCK elements: the row of
its tensor), so one program updates BLOCK elements of one tensor. The learning rate, the gradient divisor and
found_inf are device scalars read by the kernel, so the launch can be captured in a CUDA graph and the lr
changed between replays. The tables are built once; the gradient addresses are rewritten (in place, so a
captured launch keeps reading the same table) only when a gradient moved, which cannot happen during a capture
(a host copy): that raises, and FusedAdamW's capture falls back to eager.

Triton is imported only when a kernel runs: importing this module needs no Triton."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

BLOCK = 2048  # elements per program: 8 per thread with 8 warps, one 16-byte access per bf16 tensor
NUM_WARPS = 8
# Row layout of the launch table (int64 each).
_WEIGHT, _COMP, _EXP_AVG, _EXP_AVG_SQ, _GRAD, _STEP, _NUMEL, _FIRST = range(8)
_ROW = 8
ALIGN_BYTES = 16  # vectorised accesses: every address a multiple of this and every numel of 8 elements


@functools.cache
def triton_missing() -> str | None:
    """None when Triton imports here, else why not."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: use the torch formulation
        return f"triton does not import: {type(e).__name__}: {e}"
    return None


@functools.cache
def _kernel():
    """(the jitted kernel, whether it runs in Triton's CPU interpreter)."""
    # Module globals: Triton's interpreter (the CPU test) runs a kernel's source again in its module's globals,
    # where closures are lost, so the names the kernel uses are bound there.
    global tl, libdevice, _widen, _narrow, _power
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def _widen(bits):  # bf16 bits (uint16) -> float32, exact
        return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _narrow(x):  # float32 -> bf16 bits, rounded to nearest even (NaN stays a NaN: 0x7FC0, as c10 rounds it)
        # Bit arithmetic rather than `.to(tl.bfloat16)`: the interpreter's cast truncates, and the CPU test must
        # run the rounding the GPU runs.
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        return tl.where(x != x, 0x7FC0, bits).to(tl.uint16)

    @triton.jit
    def _power(base, exponent, LIBDEVICE: tl.constexpr):
        if LIBDEVICE:  # powf, as torch's kernel computes its bias corrections
            return libdevice.pow(base, exponent)
        else:  # the interpreter has no libdevice: float64 exp2 / log2, rounded once to float32
            return tl.exp2(tl.cast(exponent, tl.float64) * tl.log2(tl.cast(base, tl.float64))).to(tl.float32)

    @triton.jit
    def kahan_adamw(
        BLOCKS, TABLE, LR, SCALE, FOUND_INF, beta1, beta2, weight_decay, eps,
        GRAD_F32: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, ALIGNED: tl.constexpr,
        LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        if HAS_INF:
            if tl.load(FOUND_INF) != 0:  # a skipped step changes nothing
                return
        pid = tl.program_id(0)
        row = TABLE + tl.load(BLOCKS + pid).to(tl.int64) * 8
        w_ptr = tl.load(row + 0).to(tl.pointer_type(tl.uint16))
        c_ptr = tl.load(row + 1).to(tl.pointer_type(tl.uint16))
        m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.uint16))
        v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.uint16))
        if GRAD_F32:
            g_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
        else:
            g_ptr = tl.load(row + 4).to(tl.pointer_type(tl.uint16))
        step = tl.load(tl.load(row + 5).to(tl.pointer_type(tl.float32)))
        n = tl.load(row + 6)
        if ALIGNED:  # addresses / sizes the table cannot tell the compiler: 16-byte vector loads and stores
            w_ptr = tl.multiple_of(w_ptr, 16)
            c_ptr = tl.multiple_of(c_ptr, 16)
            m_ptr = tl.multiple_of(m_ptr, 16)
            v_ptr = tl.multiple_of(v_ptr, 16)
            g_ptr = tl.multiple_of(g_ptr, 16)
            n = tl.multiple_of(n, 8)
        offs = (pid - tl.load(row + 7)) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n

        lr = tl.load(LR)
        bias_correction1 = 1 - _power(beta1, step, LIBDEVICE)
        bias_correction2_sqrt = tl.sqrt_rn(1 - _power(beta2, step, LIBDEVICE))
        param = _widen(tl.load(w_ptr + offs, mask=mask)) + _widen(tl.load(c_ptr + offs, mask=mask))
        grad = tl.load(g_ptr + offs, mask=mask)
        if not GRAD_F32:
            grad = _widen(grad)
        if HAS_SCALE:
            grad = tl.div_rn(grad, tl.load(SCALE))
        exp_avg = _widen(tl.load(m_ptr + offs, mask=mask))
        exp_avg_sq = _widen(tl.load(v_ptr + offs, mask=mask))
        # torch's adam_math, ADAMW mode, written out with the fmas nvcc makes of it.
        if weight_decay != 0:
            param = tl.fma(-(lr * weight_decay), param, param)
        exp_avg = tl.fma(beta1, exp_avg, tl.fma(-beta1, grad, grad))
        grad_sq = grad * grad
        exp_avg_sq = tl.fma(beta2, exp_avg_sq, tl.fma(-beta2, grad_sq, grad_sq))
        step_size = tl.div_rn(lr, bias_correction1)
        denom = tl.div_rn(tl.sqrt_rn(exp_avg_sq), bias_correction2_sqrt) + eps
        param = param - tl.div_rn(step_size * exp_avg, denom)

        weight = _narrow(param)
        tl.store(w_ptr + offs, weight, mask=mask)
        tl.store(c_ptr + offs, _narrow(param - _widen(weight)), mask=mask)  # exact in float32, then rounded
        tl.store(m_ptr + offs, _narrow(exp_avg), mask=mask)
        tl.store(v_ptr + offs, _narrow(exp_avg_sq), mask=mask)

    return kahan_adamw, not isinstance(kahan_adamw, triton.runtime.jit.JITFunction)


@dataclass
class _Launch:
    """One kernel launch: the tensors of one gradient dtype and one alignment class."""

    index: list[int]  # positions in KahanAdamW's parameter list
    grad_f32: bool
    aligned: bool  # weight, comp, state aligned and every numel a multiple of 8 (the grads are checked per table)
    blocks: torch.Tensor  # int32 per block: its tensor's row in `table`
    rows: list[list[int]]  # the host copy of `table`
    table: torch.Tensor  # int64 (tensors, 8), on the device
    grad_ptrs: tuple[int, ...] | None = None  # the gradient addresses `table` holds
    grads_aligned: bool = False


class KahanAdamW:
    """The fused kahan AdamW step of fixed bf16 tensors (weights, comps, exp_avgs, exp_avg_sqs: contiguous, on one
    device; steps: float32 scalars there), launch tables cached. The tensors are referenced here, so the
    addresses in the tables stay valid; gradients (bf16 or float32, contiguous) come with each `step`."""

    def __init__(
        self,
        weights: Sequence[torch.Tensor],
        comps: Sequence[torch.Tensor],
        exp_avgs: Sequence[torch.Tensor],
        exp_avg_sqs: Sequence[torch.Tensor],
        steps: Sequence[torch.Tensor],
        *,
        block: int = BLOCK,
        num_warps: int = NUM_WARPS,
    ) -> None:
        if not weights:
            raise ValueError("KahanAdamW of no tensors")
        self.device = weights[0].device
        if _capturing(self.device):
            raise RuntimeError("KahanAdamW cannot be built during a CUDA graph capture (its tables are host copies)")
        self.tensors = list(zip(weights, comps, exp_avgs, exp_avg_sqs, strict=True))
        self.steps = list(steps)
        if len(self.steps) != len(self.tensors):
            raise ValueError("KahanAdamW: one step tensor per weight")
        for group, step in zip(self.tensors, self.steps, strict=True):
            for t in group:
                if t.dtype != torch.bfloat16 or t.device != self.device or t.shape != group[0].shape:
                    raise ValueError(f"KahanAdamW needs bf16 tensors of one shape on {self.device}, got {t.dtype}")
                if not t.is_contiguous():
                    raise ValueError("KahanAdamW needs contiguous weights and state")
            if step.dtype != torch.float32 or step.device != self.device or step.numel() != 1:
                raise ValueError("KahanAdamW needs float32 scalar step tensors on the weights' device")
        self.block, self.num_warps = block, num_warps
        self._launches: dict[tuple[torch.dtype, ...], list[_Launch]] = {}
        self._lr = torch.zeros((), dtype=torch.float32, device=self.device)  # a Python float lr, on the device

    def step(
        self,
        grads: Sequence[torch.Tensor],
        *,
        lr: float | torch.Tensor,
        beta1: float,
        beta2: float,
        weight_decay: float,
        eps: float,
        grad_scale: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> None:
        """One AdamW update of every tensor (the step tensors already counting it), the gradients divided by
        `grad_scale`, skipped where `found_inf` is nonzero; queued on the device, no host sync."""
        launches = self.retable(grads)  # every table checked before any kernel runs: no half-done step
        kernel, interpreted = _kernel()
        lr_t = self._device_scalar(lr, self._lr)
        scale = None if grad_scale is None else self._device_scalar(grad_scale)
        inf = None if found_inf is None else self._device_scalar(found_inf)
        for launch in launches:
            kernel[(launch.blocks.numel(),)](
                launch.blocks, launch.table, lr_t, lr_t if scale is None else scale, lr_t if inf is None else inf,
                float(beta1), float(beta2), float(weight_decay), float(eps),
                GRAD_F32=launch.grad_f32, HAS_SCALE=scale is not None, HAS_INF=inf is not None,
                ALIGNED=launch.aligned and launch.grads_aligned, LIBDEVICE=not interpreted, BLOCK=self.block,
                num_warps=self.num_warps, enable_fp_fusion=True,  # nvcc's --fmad=true, as torch's kernel is built
            )  # fmt: skip

    def retable(self, grads: Sequence[torch.Tensor]) -> list[_Launch]:
        """The launches for these gradients, their tables pointing at them: a host-to-device copy where a gradient
        moved, refused (RuntimeError) during a CUDA graph capture."""
        if len(grads) != len(self.tensors):
            raise ValueError(f"KahanAdamW: {len(grads)} gradients for {len(self.tensors)} tensors")
        capturing = _capturing(self.device)
        key = tuple(g.dtype for g in grads)
        launches = self._launches.get(key)
        if launches is None:
            if capturing:
                raise RuntimeError("KahanAdamW: new gradient dtypes during a CUDA graph capture (tables to build)")
            launches = self._launches[key] = self._plan(key)
        for launch in launches:
            self._retable(launch, grads, capturing)
        return launches

    def _plan(self, grad_dtypes: tuple[torch.dtype, ...]) -> list[_Launch]:
        """The launches for these gradient dtypes: tensors grouped by (grad dtype, alignment), empty ones left
        out (the kernel's BLOCK and dtypes are per launch)."""
        groups: dict[tuple[bool, bool], list[int]] = {}
        for i, (group, dtype) in enumerate(zip(self.tensors, grad_dtypes, strict=True)):
            if dtype not in (torch.bfloat16, torch.float32):
                raise ValueError(f"KahanAdamW takes bf16 or float32 gradients, got {dtype}")
            if group[0].numel():
                aligned = group[0].numel() % 8 == 0 and all(t.data_ptr() % ALIGN_BYTES == 0 for t in group)
                groups.setdefault((dtype == torch.float32, aligned), []).append(i)
        launches = []
        for (grad_f32, aligned), index in groups.items():
            counts = [-(-self.tensors[i][0].numel() // self.block) for i in index]
            firsts = [0]
            for c in counts[:-1]:
                firsts.append(firsts[-1] + c)
            rows = []
            for i, first in zip(index, firsts, strict=True):
                w, comp, m, v = self.tensors[i]
                rows.append([w.data_ptr(), comp.data_ptr(), m.data_ptr(), v.data_ptr(), 0, self.steps[i].data_ptr(),
                             w.numel(), first])  # fmt: skip
            blocks = torch.repeat_interleave(torch.arange(len(index), dtype=torch.int32), torch.tensor(counts))
            table = torch.empty((len(index), _ROW), dtype=torch.int64, device=self.device)
            launches.append(_Launch(index, grad_f32, aligned, blocks.to(self.device), rows, table))
        return launches

    def _retable(self, launch: _Launch, grads: Sequence[torch.Tensor], capturing: bool) -> None:
        """Write the gradient addresses into the launch table when they changed (a host-to-device copy, in place:
        a captured launch goes on reading this table)."""
        ptrs = tuple(grads[i].data_ptr() for i in launch.index)
        if ptrs == launch.grad_ptrs:
            return
        if capturing:
            raise RuntimeError("KahanAdamW: gradients moved during CUDA graph capture (the table is a host copy)")
        for r, i in enumerate(launch.index):
            g, w = grads[i], self.tensors[i][0]
            if g.device != self.device or g.numel() != w.numel() or not g.is_contiguous():
                raise ValueError("KahanAdamW needs contiguous gradients shaped as their weights, on their device")
            launch.rows[r][_GRAD] = ptrs[r]
        host = torch.tensor(launch.rows, dtype=torch.int64)
        if self.device.type == "cuda":  # pinned: an asynchronous copy (torch keeps the buffer until it is done)
            launch.table.copy_(host.pin_memory(), non_blocking=True)
        else:
            launch.table.copy_(host)
        launch.grad_ptrs, launch.grads_aligned = ptrs, all(p % ALIGN_BYTES == 0 for p in ptrs)

    def _device_scalar(self, x: float | torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """A float32 scalar tensor on the device holding x (x itself when it is one)."""
        if isinstance(x, torch.Tensor):
            if x.dtype == torch.float32 and x.device == self.device and x.numel() == 1:
                return x
            return x.to(self.device, torch.float32).reshape(()) if into is None else into.copy_(x.reshape(()))
        assert into is not None
        return into.fill_(x)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def kernel_missing(device: torch.device) -> str | None:
    """None when the fused kahan kernel runs on `device` (CUDA, Triton importable), else why not."""
    if device.type != "cuda":
        return f"{device.type} device (the kernel is compiled for CUDA)"
    return triton_missing()
