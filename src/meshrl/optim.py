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
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch.optim.adamw import adamw


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


class FusedAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW(fused=True)` (same kernel, state layout and `state_dict`: checkpoints move between the
    two; its `step` is unchanged) plus `clip_and_step`, the whole optimiser step queued on the device.

    `cuda_graph=True` (CUDA only): `clip_and_step` runs eagerly once, then is captured as a CUDA graph and
    replayed; the learning rates and `max_norm` are device tensors filled before each replay. The gradients
    become static buffers: zeroed in place, never set to None, so backward accumulates into them (one extra
    add per parameter on the GPU, and one gradient's memory held between steps). The graph is captured again
    when a gradient tensor, a hyperparameter other than lr or the optimiser state (load_state_dict) changes; a
    step where some parameter has no gradient runs eagerly. If capture fails, it warns and stays eager."""

    def __init__(self, params, lr: float = 1e-3, *, cuda_graph: bool = False, **kwargs) -> None:
        super().__init__(params, lr=lr, fused=True, **kwargs)
        self.cuda_graph = cuda_graph
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
        kept = [[i for i, g in enumerate(gs) if g is not None] for gs in grads]
        lists = [tuple([lst[i] for i in idx] for lst in group) for group, idx in zip(lists, kept, strict=True)]
        grads = [[gs[i] for i in idx] for gs, idx in zip(grads, kept, strict=True)]
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

    def _apply(self, lists, grads, lrs, divisor: torch.Tensor, found_inf: torch.Tensor) -> None:
        """Fused AdamW per group, the gradients divided by `divisor`, skipped where `found_inf` is 1."""
        for group, (params, exp_avgs, exp_avg_sqs, steps), gs, lr in zip(
            self.param_groups, lists, grads, lrs, strict=True
        ):
            if not params:
                continue
            beta1, beta2 = group["betas"]
            adamw(params, gs, exp_avgs, exp_avg_sqs, [], steps, fused=True, grad_scale=divisor, found_inf=found_inf,
                  amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=group["weight_decay"],
                  eps=group["eps"], maximize=False)  # fmt: skip

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
            try:
                clip_graph, update_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
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
