"""The single-device GPU optimiser step with almost no host work: torch's fused AdamW kernel, gradient clipping
folded into it, and a non-finite step skipped on the device.

Why: on one GPU the optimiser step runs while the GPU is idle, right after `forward_backward` has returned its
host values, so every millisecond of Python here is a millisecond of idle GPU per step. `torch.optim.AdamW.step`
walks every parameter in Python (state lookup, checks, list building: ~2 ms for Qwen3-0.6B's 310 tensors on an
H100 host) and `clip_grad_norm_` moves each per-tensor norm and builds its `stack` argument in Python (~4 ms).
Here the lists are built once, the norm is one `_foreach_norm` + `stack`, and the clip is the fused kernel's
`grad_scale` (the gradient is divided by it in float32 inside the update, as GradScaler unscales), so a step is
five kernel launches whatever the number of tensors.

Plain tensors only (FSDP's DTensors keep `clip_grad_norm_` + `torch.optim.AdamW`, see `Policy.optim_step`).
"""

from __future__ import annotations

import math

import torch
from torch.optim.adamw import adamw


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of `grads` as a float32 device scalar: per-tensor norms accumulated and returned in
    float32 (not rounded to a bf16 gradient's dtype, as `clip_grad_norm_` does), without a host sync."""
    if not grads:
        raise ValueError("grad_norm of no gradients")
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)))


def clip_divisor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What to divide the gradients by so their norm is at most `max_norm` (1 when it already is; NaN/inf for
    a non-finite norm, a step that is skipped anyway). `clip_grad_norm_`'s rule: scale by max_norm / (norm + 1e-6)
    when that is below 1."""
    if math.isinf(max_norm):
        return torch.ones_like(norm)
    return torch.clamp((norm + 1e-6) / max_norm, min=1.0)


class FusedAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW(fused=True)` whose step, after the first one, skips the per-parameter Python walk:
    the parameter and state lists are built once and the fused kernel called on them directly. Same kernel,
    same state layout and `state_dict` as torch's (checkpoints move between the two), same `grad_scale` /
    `found_inf` attributes (set them before `step`; they are cleared after it)."""

    def __init__(self, params, lr: float = 1e-3, **kwargs) -> None:
        super().__init__(params, lr=lr, fused=True, **kwargs)
        self._lists: list[tuple[list, list, list, list]] | None = None

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._lists = None  # the state tensors were replaced

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._lists = None

    def _build_lists(self) -> list[tuple[list, list, list, list]] | None:
        lists = []
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or not all(self.state.get(p) for p in group["params"]):
                return None  # first step (state not allocated yet) or an option the fast path does not carry
            states = [self.state[p] for p in group["params"]]
            lists.append((group["params"], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                          [s["step"] for s in states]))  # fmt: skip
        return lists

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        try:
            if closure is None and self._lists is None:
                self._lists = self._build_lists()
            if closure is not None or self._lists is None:
                return super().step(closure)  # torch's walk allocates the state; the next step takes the lists
            grads_per_group = [[p.grad for p in params] for params, *_ in self._lists]
            if any(g is None for grads in grads_per_group for g in grads):
                return super().step()  # some parameter got no gradient: torch's walk skips it
            for group, (params, exp_avgs, exp_avg_sqs, steps), grads in zip(
                self.param_groups, self._lists, grads_per_group, strict=True
            ):
                beta1, beta2 = group["betas"]
                adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, fused=True, grad_scale=grad_scale,
                      found_inf=found_inf, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                      weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)  # fmt: skip
            return None
        finally:
            self.grad_scale = self.found_inf = None
