"""The single-device optimiser step with almost no host work: the global grad norm, the clip, AdamW and the
zeroing of the gradients all queued on the device (torch's fused AdamW kernel; the clip is its `grad_scale`
divisor and a non-finite step is skipped by its `found_inf`, as GradScaler uses them), optionally replayed
as one CUDA graph.

Why: on one GPU the optimiser step runs while the GPU is idle, right after `forward_backward` has returned its
host values, so every millisecond of host work here is a millisecond of idle GPU per step. `AdamW.step` walks
every parameter in Python, and torch's multi-tensor kernels (`_foreach_norm`, fused AdamW, `_foreach_zero_`)
build their launch metadata on the host chunk by chunk (65 536 elements per chunk, ~9 000 chunks for 0.6 B
parameters): ~6 ms of idle GPU per step on an H100 host for Qwen3-0.6B, measured (bench/NOTES.md). A CUDA graph
of the whole step replays those launches with no host work.

Plain tensors only (FSDP's DTensors keep `clip_grad_norm_` + `torch.optim.AdamW`, see `Policy.optim_step`).

Pure-bf16 weights (`bf16_rounding`): the fused kernel computes the update in float32 but stores the weight in
bf16 rounded to nearest, so an update below half a bf16 step of the weight (2^-9 of it) is lost: at RL learning
rates (~1e-6, weights ~0.02) nearly every update is. "kahan" and "stochastic" keep those updates (see FusedAdamW).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.optim.adamw import adamw

from meshrl import optim_kernels


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of `grads` as a float32 device scalar: per-tensor norms accumulated and returned in
    float32 (not rounded to a bf16 gradient's dtype, as `clip_grad_norm_` does), without a host sync."""
    if not grads:
        raise ValueError("grad_norm of no gradients")
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)))


def clip_divisor(norm: torch.Tensor, max_norm: float | torch.Tensor) -> torch.Tensor:
    """What to divide the gradients by so their norm is at most `max_norm` (1 when it already is, and for
    max_norm=inf; not finite for a non-finite norm, a step that is skipped anyway). `clip_grad_norm_`'s rule: scale by
    max_norm / (norm + 1e-6) when that is below 1."""
    return torch.clamp((norm + 1e-6) / max_norm, min=1.0)


BF16_ROUNDINGS = ("nearest", "kahan", "stochastic")


@dataclass
class _Chunk:
    """Bf16 parameters (whole, or a contiguous slice of a larger one) that fit the float32 scratch together."""

    slices: list[tuple[int, int | None, int | None]]  # (parameter index, start, end); start None: the whole tensor
    state: list[list[torch.Tensor]]  # per entry: weight, exp_avg, exp_avg_sq, kahan_comp (kahan only)
    steps: list[torch.Tensor]  # the step tensor of each entry's parameter (a split parameter's slices share it)
    wide: list[list[torch.Tensor]]  # float32 scratch per entry: weight, comp (kahan) / noise, grad, exp_avgs
    narrow: list[torch.Tensor]  # bf16 scratch per entry (the rounded weight), over the comp's float32 rows
    flat: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # weight and comp rows (float32), the bf16 row


@dataclass
class _Plan:
    chunks: list[_Chunk]
    steps: list[torch.Tensor] = field(default_factory=list)  # one per parameter: counted once per step


class FusedAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW(fused=True)` (same kernel, state layout and `state_dict`: checkpoints move between the
    two; with bf16_rounding="nearest" its `step` is unchanged) plus `clip_and_step`, the whole optimiser step
    queued on the device.

    `cuda_graph=True` (CUDA only): `clip_and_step` runs eagerly once, then is captured as a CUDA graph and
    replayed; the learning rates and `max_norm` are device tensors filled before each replay. The gradients
    become static buffers: zeroed in place, never set to None, so backward accumulates into them (one extra
    add per parameter on the GPU, and one gradient's memory held between steps). The graph is captured again
    when a gradient tensor, a hyperparameter other than lr or the optimiser state (load_state_dict) changes; a
    step where some parameter has no gradient runs eagerly. If capture fails, it warns and stays eager.

    `bf16_rounding` (bf16 parameters only; others take the fused kernel as before, bitwise): how the new weight,
    computed in float32, is stored in bf16.
      "nearest": rounded to nearest, torch's kernel as is. An update below half a bf16 step of the weight is
        lost; at lr 1e-6 that is nearly every update of a 0.02-sized weight, and every one of a norm weight.
      "kahan": compensated summation. What rounding dropped is kept in a bf16 buffer per parameter (optimiser
        state "kahan_comp", saved and restored with it) and added back before the next update: weight + comp
        tracks the float32 update, and the bf16 weight is that sum rounded to nearest (on an exact tie, either
        neighbour). The recommendation: deterministic (no RNG, bitwise-reproducible runs and resumes), 2 bytes
        per parameter, and the weight the forward uses is the best bf16 value. Its limit: weight + comp holds
        ~16 significant bits, so once comp nears half a bf16 step an update is kept to ~2^-17 of the weight (at
        lr 1e-6 on a norm weight of 1, noise the size of the update; unbiased, it averages out over steps).
      "stochastic": the float32 result rounded up or down at random with the probabilities that make it exact in
        expectation; no extra state, but noise of up to a bf16 step per weight and update. Random bits from a
        torch.Generator on the parameter's device seeded with `rounding_seed` (its position is not checkpointed:
        a resumed run draws a fresh stream).
    Both can run torch's fused kernel on float32 copies of the weight (kahan: weight + comp) and AdamW state, one
    scratch-sized chunk at a time (`scratch_numel` elements, 20 bytes each, kept between steps: 320 MiB at
    most), so the AdamW math is the fused kernel's (float32 either way) and the bf16 exp_avg / exp_avg_sq are
    stored as it stores them. The price of staying with torch's kernels: ~100 bytes of memory traffic per bf16
    parameter and step instead of the kernel's 14 (Qwen3-0.6B on an H100: ~27 ms instead of ~6; eager adds ~10 ms
    of host launches, which `cuda_graph` removes).
    So on CUDA, with Triton importable, "kahan" runs as one Triton kernel per group and gradient dtype instead
    (`meshrl.optim_kernels`: the same per-element math as torch's CUDA kernel, weight + comp, gradient and
    state read once and written once, ~18 bytes per parameter with bf16 gradients, no scratch); what that
    saves against the plain step is to be measured on the GPU (bench/kahan_kernel.py). It also leaves a
    skipped step's tensors bitwise as they were. `fused_kahan=False` (taken from the environment variable
    MESHRL_FUSED_KAHAN=0 when the optimiser is built; the attribute can be set later) keeps the torch
    formulation, which CPU parameters and "stochastic" always take."""

    scratch_numel: int = 1 << 24  # smaller chunks: more launches, slower (1 << 22: +12% at 0.6B)

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        *,
        cuda_graph: bool = False,
        bf16_rounding: str = "nearest",
        rounding_seed: int = 0,
        **kwargs,
    ) -> None:
        if bf16_rounding not in BF16_ROUNDINGS:
            raise ValueError(f"bf16_rounding={bf16_rounding!r}: expected one of {BF16_ROUNDINGS}")
        super().__init__(params, lr=lr, fused=True, **kwargs)
        if bf16_rounding != "nearest" and any(g["amsgrad"] or g["maximize"] for g in self.param_groups):
            raise ValueError(f"bf16_rounding={bf16_rounding!r} supports neither amsgrad nor maximize")
        self.cuda_graph = cuda_graph
        self.bf16_rounding = bf16_rounding
        self.rounding_seed = rounding_seed
        self.fused_kahan = os.environ.get("MESHRL_FUSED_KAHAN", "1") != "0"
        self._generators: dict[torch.device, torch.Generator] = {}
        self._lists: list[tuple[list, list, list, list]] | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_warm = False

    # ---- bookkeeping -------------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._forget_lists()  # the state tensors were replaced

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._forget_lists()

    def _forget_lists(self) -> None:
        self._lists, self._graph, self._graph_warm = None, None, False
        self._plans: dict[tuple[int, ...], _Plan] = {}  # their views alias the state tensors
        self._kernels: dict[tuple[int, ...], optim_kernels.KahanAdamW | None] = {}  # tables of state addresses
        self._scratch: dict[torch.device, torch.Tensor] = {}

    def _rounds(self, p: torch.Tensor) -> bool:
        """Whether `p` takes the kahan / stochastic store instead of the fused kernel's own."""
        return self.bf16_rounding != "nearest" and p.dtype == torch.bfloat16

    def _state_lists(self) -> list[tuple[list, list, list, list]]:
        """Per group: params, exp_avgs, exp_avg_sqs, steps, the state allocated as torch's fused AdamW does."""
        if self._lists is None:
            lists = []
            for group in self.param_groups:
                if group["amsgrad"] or group["maximize"]:
                    raise ValueError("FusedAdamW.clip_and_step supports neither amsgrad nor maximize")
                for p in group["params"]:
                    state = self.state[p]
                    if not state:
                        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if self.bf16_rounding == "kahan" and self._rounds(p) and "kahan_comp" not in state:
                        # From a checkpoint of another rounding (or torch's AdamW): nothing was dropped yet.
                        state["kahan_comp"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                states = [self.state[p] for p in group["params"]]
                lists.append((group["params"], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                              [s["step"] for s in states]))  # fmt: skip
            self._lists = lists
        return self._lists

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._graph is not None:  # the captured gradient buffers stay; the graph reads them
            grads = [p.grad for params, *_ in self._state_lists() for p in params if p.grad is not None]
            if grads:
                torch._foreach_zero_(grads)
            return
        super().zero_grad(set_to_none=set_to_none)

    # ---- the step ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """torch's AdamW step; with kahan / stochastic rounding of bf16 parameters, the same update stored that
        way (honouring GradScaler's `grad_scale` / `found_inf`, as torch's fused step does). DCP's
        `get_state_dict` and `Policy.load_state` take a step with lr 0 to allocate the state before loading a
        checkpoint: this is where "kahan_comp" comes into being, so the checkpoint's is loaded into it."""
        if not any(self._rounds(p) for group in self.param_groups for p in group["params"]):
            return _ADAMW_STEP(self, closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lists, grads = _with_grads(self._state_lists())
        self._apply(lists, grads, [g["lr"] for g in self.param_groups], getattr(self, "grad_scale", None),
                    getattr(self, "found_inf", None))  # fmt: skip
        return loss

    @torch.no_grad()
    def clip_and_step(self, max_norm: float, skip: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
        """Global grad norm (float32, before clipping), clip to `max_norm` (inf: none), AdamW with each group's
        hyperparameters — skipped, state included, when the norm is not finite or the device scalar `skip` is
        > 0 (e.g. a non-finite loss, known only on the device yet) — and the gradients zeroed (set to None when
        eager, in place with `cuda_graph`), all queued on the device. Returns a function that waits for the
        norm's copy to the host alone (queued before the update, so the host can go on while the update runs)
        and gives it."""
        lists = self._state_lists()
        grads = [[p.grad for p in params] for params, *_ in lists]
        complete = all(g is not None for gs in grads for g in gs)
        if self.cuda_graph and complete and self.param_groups[0]["params"][0].device.type == "cuda":
            read_norm = self._graphed_step(lists, grads, max_norm, skip)
            if read_norm is not None:
                return read_norm
        lists, grads = _with_grads(lists)
        flat_grads = [g for gs in grads for g in gs]
        norm, divisor, found_inf = _clip_terms(flat_grads, max_norm, skip)
        read_norm = host_copy_when_ready(norm)
        self._apply(lists, grads, [group["lr"] for group in self.param_groups], divisor, found_inf)
        if self.cuda_graph:  # keep the buffers: the next capture reads them
            torch._foreach_zero_(flat_grads)
        else:
            for params, *_ in lists:
                for p in params:
                    p.grad = None
        return read_norm

    def _apply(self, lists, grads, lrs, divisor: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """Fused AdamW per group, the gradients divided by `divisor`, skipped where `found_inf` is 1."""
        for group, (params, exp_avgs, exp_avg_sqs, steps), gs, lr in zip(
            self.param_groups, lists, grads, lrs, strict=True
        ):
            if not params:
                continue
            beta1, beta2 = group["betas"]
            hyper = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"])
            rounded = [self._rounds(p) for p in params]
            if any(rounded):
                pick = [i for i, r in enumerate(rounded) if r]
                self._rounded_step([params[i] for i in pick], [gs[i] for i in pick], divisor, found_inf, **hyper)
                keep = [i for i, r in enumerate(rounded) if not r]
                params, exp_avgs, exp_avg_sqs, steps, gs = (
                    [lst[i] for i in keep] for lst in (params, exp_avgs, exp_avg_sqs, steps, gs)
                )
                if not params:
                    continue
            adamw(params, gs, exp_avgs, exp_avg_sqs, [], steps, fused=True, grad_scale=divisor, found_inf=found_inf,
                  amsgrad=False, maximize=False, **hyper)  # fmt: skip

    def _rounded_step(self, params, grads, divisor, found_inf, *, lr, beta1, beta2, weight_decay, eps) -> None:
        """The fused kernel on float32 copies, chunk by chunk, stored back with kahan / stochastic rounding.

        kahan: the weight widened is weight + comp (exact but for float32 rounding), so weight decay sees the
        weight the comp tracks; the new float32 weight w is split into round-to-nearest(w) and the remainder
        w - round(w), exact in float32, rounded to bf16. A skipped step (found_inf) leaves w = weight + comp
        and so re-splits the same value: the state is unchanged but for that float32 rounding (and, on an exact
        tie, the equivalent other split). stochastic: adding 16 random bits below bf16's last bit and cutting
        them off rounds up with probability (w - round_down(w)) / step, signs included (sign-magnitude), inf and
        nan kept; a skipped step's w is the bf16 weight itself, which this leaves unchanged.
        kahan on CUDA: the fused Triton kernel instead, where available (`_kahan_kernel`)."""
        hyper = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps)
        kernel = self._kahan_kernel(params)
        plan = self._plan(params) if kernel is None else None
        steps = kernel.steps if kernel is not None else plan.steps
        torch._foreach_add_(steps, 1)
        if kernel is not None:
            kernel.step(grads, **hyper, grad_scale=divisor, found_inf=found_inf)
        else:
            self._chunked_step(plan, params, grads, divisor, found_inf, **hyper)
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf] * len(steps))

    def _chunked_step(self, plan, params, grads, divisor, found_inf, *, lr, beta1, beta2, weight_decay, eps) -> None:
        """`_rounded_step`'s torch formulation: torch's fused kernel on float32 scratch, one chunk at a time."""
        kahan = self.bf16_rounding == "kahan"
        gen = None if kahan else self._generator(params[0].device)
        for chunk in plan.chunks:
            gs = [grads[i] if a is None else grads[i].reshape(-1)[a:b] for i, a, b in chunk.slices]
            (w, comp, g, m, v), (pw, pm, pv, *pc), (w_row, comp_row, narrow_row) = chunk.wide, chunk.state, chunk.flat
            # One widening copy per chunk where the dtypes allow (the multi-tensor copy takes one source dtype).
            same = all(t.dtype == torch.bfloat16 for t in gs)
            if kahan:
                torch._foreach_copy_(
                    w + comp + m + v + (g if same else []), pw + pc[0] + pm + pv + (gs if same else [])
                )
                w_row.add_(comp_row)
            else:
                torch._foreach_copy_(w + m + v + (g if same else []), pw + pm + pv + (gs if same else []))
            if not same:
                torch._foreach_copy_(g, gs)
            torch._fused_adamw_(w, g, m, v, [], chunk.steps, lr=lr, beta1=beta1, beta2=beta2,
                                weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
                                grad_scale=divisor, found_inf=found_inf)  # fmt: skip
            if kahan:
                narrow_row.copy_(w_row)
                w_row.sub_(narrow_row)
                torch._foreach_copy_(pm + pv + pc[0], m + v + w)
                torch._foreach_copy_(pw, chunk.narrow)
            else:
                bits, noise = w_row.view(torch.int32), comp_row.view(torch.int32)
                noise.random_(0, 1 << 16, generator=gen)
                bits.add_(noise).bitwise_and_(-(1 << 16))
                torch._foreach_copy_(pw + pm + pv, w + m + v)

    def _kahan_kernel(self, params: list[torch.Tensor]) -> optim_kernels.KahanAdamW | None:
        """The fused kahan step of these bf16 parameters (cached: tables of their state's addresses), or None where
        the torch formulation runs: not kahan, `fused_kahan` off, not CUDA, or no Triton (said once)."""
        if self.bf16_rounding != "kahan" or not self.fused_kahan:
            return None
        key = tuple(map(id, params))
        if key not in self._kernels:
            device = params[0].device
            missing = optim_kernels.kernel_missing(device)
            if missing is None and any(p.device != device for p in params):
                missing = "parameters on several devices"
            if missing is not None and device.type == "cuda":
                warnings.warn(f"FusedAdamW: no fused kahan kernel ({missing}); the slower torch formulation runs",
                              stacklevel=4)  # fmt: skip
            self._kernels[key] = None if missing else optim_kernels.KahanAdamW(
                params, *([self.state[p][k] for p in params] for k in ("kahan_comp", "exp_avg", "exp_avg_sq", "step"))
            )  # fmt: skip
        return self._kernels[key]

    def _retable_kernels(self, lists, grads) -> None:
        """Point the fused kahan kernels at these gradients now (before a capture: the graph replays the kernel
        with the addresses its table holds; a new gradient tensor is why a graph is captured again)."""
        for (params, *_), gs in zip(lists, grads, strict=True):
            pick = [i for i, p in enumerate(params) if self._rounds(p)]
            kernel = self._kahan_kernel([params[i] for i in pick]) if pick else None
            if kernel is not None:
                kernel.retable([gs[i] for i in pick])

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device).manual_seed(self.rounding_seed)
        return gen

    def _plan(self, params: list[torch.Tensor]) -> _Plan:
        """The chunks of these bf16 parameters (cached: views of their state and of the scratch)."""
        key = tuple(map(id, params))
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        device = params[0].device
        scratch = self._scratch.get(device)
        if scratch is None:  # sized for all of them, capped: a partial step's chunks fit it too
            total = sum(
                p.numel() for grp in self.param_groups for p in grp["params"] if self._rounds(p) and p.device == device
            )
            size = max(1, min(self.scratch_numel, total))
            scratch = self._scratch[device] = torch.empty((5, size), dtype=torch.float32, device=device)
        size = scratch.shape[1]
        names = ("exp_avg", "exp_avg_sq") + (("kahan_comp",) if self.bf16_rounding == "kahan" else ())
        states = [[p] + [self.state[p][k] for k in names] for p in params]
        for state in states:
            if any(not t.is_contiguous() for t in state):
                raise ValueError(f"bf16_rounding={self.bf16_rounding!r} needs contiguous parameters and state")
        plan = _Plan(chunks=[], steps=[self.state[p]["step"] for p in params])
        entries: list[tuple[int, int, int, int]] = []  # (parameter, start, end, offset in the scratch)
        fill = 0
        for i, p in enumerate(params):
            start, n = 0, p.numel()
            while start < n:
                take = min(n - start, size - fill)
                entries.append((i, start, start + take, fill))
                start, fill = start + take, fill + take
                if fill == size:
                    plan.chunks.append(self._chunk(entries, params, states, scratch))
                    entries, fill = [], 0
        if entries:
            plan.chunks.append(self._chunk(entries, params, states, scratch))
        self._plans[key] = plan
        return plan

    def _chunk(self, entries, params, states, scratch: torch.Tensor) -> _Chunk:
        n = entries[-1][3] + entries[-1][2] - entries[-1][1]
        narrow_all = scratch[1].view(torch.bfloat16)  # the comp row is spent once added to the weight row
        slices, state, steps, wide, narrow = [], [[] for _ in states[0]], [], [[] for _ in range(5)], []
        for i, start, end, off in entries:
            p = params[i]
            whole = start == 0 and end == p.numel()
            shape = p.shape if whole else (end - start,)
            slices.append((i, None, None) if whole else (i, start, end))
            for lst, t in zip(state, states[i], strict=True):
                lst.append(t if whole else t.view(-1)[start:end])
            steps.append(self.state[p]["step"])
            for row, lst in zip(scratch, wide, strict=True):
                lst.append(row[off : off + end - start].view(shape))
            narrow.append(narrow_all[off : off + end - start].view(shape))
        return _Chunk(slices, state, steps, wide, narrow, (scratch[0, :n], scratch[1, :n], narrow_all[:n]))

    def _graphed_step(self, lists, grads, max_norm: float, skip) -> Callable[[], torch.Tensor] | None:
        """Two graphs, so the norm's copy to the host sits between them: (norm, clip terms), then (AdamW,
        zeroing). None: capture failed, take the eager step."""
        flat_grads = [g for gs in grads for g in gs]
        hyper = [(tuple(g["betas"]), g["eps"], g["weight_decay"]) for g in self.param_groups]
        if self._graph is not None and (
            hyper != self._graph_hyper or any(a is not b for a, b in zip(flat_grads, self._graph_grads, strict=True))
        ):
            self._graph = None  # captured again below (the kernels already ran once: no new warm-up step)
        if self._graph is None:
            if not self._graph_warm:  # the kernels run once eagerly (lazy loading, allocator) before capture
                device = flat_grads[0].device
                self._lr_t = [torch.zeros((), dtype=torch.float32, device=device) for _ in self.param_groups]
                self._max_norm_t = torch.zeros((), dtype=torch.float32, device=device)
                self._skip_t = torch.zeros((), dtype=torch.float32, device=device)
                self._fill(max_norm, skip)
                norm, divisor, found_inf = _clip_terms(flat_grads, self._max_norm_t, self._skip_t)
                read_norm = host_copy_when_ready(norm)
                self._apply(lists, grads, self._lr_t, divisor, found_inf)
                torch._foreach_zero_(flat_grads)
                self._graph_warm, self._graph_grads, self._graph_hyper = True, flat_grads, hyper
                return read_norm
            self._retable_kernels(lists, grads)  # a host copy, which a capture cannot make
            try:
                clip_graph, update_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                for gen in self._generators.values():  # stochastic rounding: each replay draws new bits
                    update_graph.register_generator_state(gen)
                with torch.cuda.graph(clip_graph, capture_error_mode="thread_local"):
                    terms = _clip_terms(flat_grads, self._max_norm_t, self._skip_t)
                with torch.cuda.graph(update_graph, capture_error_mode="thread_local"):
                    self._apply(lists, grads, self._lr_t, terms[1], terms[2])
                    torch._foreach_zero_(flat_grads)
            except Exception as e:  # noqa: BLE001 - stay correct (eager) rather than fail the run
                warnings.warn(f"FusedAdamW: CUDA graph capture failed ({e!r}); the optimiser step stays eager",
                              stacklevel=2)  # fmt: skip
                self.cuda_graph = False
                return None
            self._graph, self._graph_terms = (clip_graph, update_graph), terms
            self._graph_grads, self._graph_hyper = flat_grads, hyper
        self._fill(max_norm, skip)
        self._graph[0].replay()
        read_norm = host_copy_when_ready(self._graph_terms[0])
        self._graph[1].replay()
        return read_norm

    def _fill(self, max_norm: float, skip: torch.Tensor | None) -> None:
        for t, group in zip(self._lr_t, self.param_groups, strict=True):
            t.fill_(group["lr"])
        self._max_norm_t.fill_(max_norm)
        if skip is None:
            self._skip_t.zero_()
        else:
            self._skip_t.copy_(skip)


def _with_grads(lists):
    """The lists of the parameters that have a gradient, and those gradients, per group."""
    grads = [[p.grad for p in params] for params, *_ in lists]
    kept = [[i for i, g in enumerate(gs) if g is not None] for gs in grads]
    lists = [tuple([lst[i] for i in idx] for lst in group) for group, idx in zip(lists, kept, strict=True)]
    return lists, [[gs[i] for i in idx] for gs, idx in zip(grads, kept, strict=True)]


# torch's AdamW step without the profiling / hook wrapper Optimizer puts on `step` (FusedAdamW's own step is
# wrapped: hooks would run twice).
_ADAMW_STEP = torch.optim.AdamW.step
_ADAMW_STEP = _ADAMW_STEP.__wrapped__ if getattr(_ADAMW_STEP, "hooked", False) else _ADAMW_STEP


def _clip_terms(grads: list[torch.Tensor], max_norm: float | torch.Tensor, skip: torch.Tensor | None = None):
    """(norm, clip divisor, found_inf) as device scalars; found_inf is 1 for a non-finite norm or skip > 0."""
    norm = grad_norm(grads)
    found_inf = ~torch.isfinite(norm)
    if skip is not None:
        found_inf = found_inf | (skip > 0)
    return norm, clip_divisor(norm, max_norm), found_inf.to(torch.float32)


def host_copy_when_ready(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Start copying a device tensor to the host; the returned function waits for that copy alone (not for
    work queued after it) and gives the host tensor."""
    if t.device.type != "cuda":
        return lambda: t.detach().cpu()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t.detach(), non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read() -> torch.Tensor:
        copied.synchronize()
        return host

    return read
