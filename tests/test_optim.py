"""meshrl.optim: the single-device optimiser step (norm, clip, AdamW, zeroing on the device) against torch's
clip_grad_norm_ + AdamW(fused), and its CUDA-graph replay against the eager step (GPU only: skipped on CPU)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from markers import needs_cuda

from meshrl.optim import FusedAdamW, clip_divisor, grad_norm

SHAPES = [(7, 5), (5,), (3, 4, 2), (300, 260)]  # the last spans two of the multi-tensor kernels' chunks
KW = dict(betas=(0.9, 0.95), weight_decay=0.1)
# (lr, max_norm, non-finite gradient?) per step: clipping, not clipping, no clip at all, a skipped step
SCHEDULE = [(1e-2, 0.5, False), (2e-2, 1e3, False), (5e-3, math.inf, False), (1e-2, 0.5, True), (3e-3, 1.0, False)]


def _params(device: str, dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device, dtype)) for s in SHAPES]


def _grads(step: int, device: str, dtype: torch.dtype, nonfinite: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    grads = [(torch.randn(s, generator=g) * 3).to(device, dtype) for s in SHAPES]
    if nonfinite:
        grads[2].view(-1)[1] = float("nan")
    return grads


def _accumulate(params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
    """What backward does: into an existing gradient in place, else a new one."""
    for p, g in zip(params, grads, strict=True):
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.add_(g)


def test_clip_and_step_equals_torch_clip_grad_norm_and_adamw():
    """Same weights, state and norm as clip_grad_norm_ + AdamW(fused) over steps that clip, do not clip and are
    skipped (non-finite norm: weights, state and step count untouched); a state_dict round trip into a fresh
    optimiser in the middle (checkpoints are interchangeable with torch's)."""
    ours, theirs = _params("cpu", torch.float32), _params("cpu", torch.float32)
    opt_ours, opt_theirs = FusedAdamW(ours, lr=0.0, **KW), torch.optim.AdamW(theirs, lr=0.0, fused=True, **KW)
    for step, (lr, max_norm, nonfinite) in enumerate(SCHEDULE):
        grads = _grads(step, "cpu", torch.float32, nonfinite)
        _accumulate(ours, grads)
        _accumulate(theirs, grads)
        for opt in (opt_ours, opt_theirs):
            opt.param_groups[0]["lr"] = lr
        norm = opt_ours.clip_and_step(max_norm)()
        want = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
        if math.isfinite(want):
            opt_theirs.step()
        opt_theirs.zero_grad(set_to_none=True)
        if nonfinite:
            assert not math.isfinite(float(norm))
        else:
            torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
        for p, q in zip(ours, theirs, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m, s=step: f"step {s}: {m}")
            assert p.grad is None
        if step == 1:
            fresh = FusedAdamW(ours, lr=0.0, **KW)
            fresh.load_state_dict(opt_ours.state_dict())
            opt_ours = fresh
    want_steps = sum(not nonfinite for *_, nonfinite in SCHEDULE)
    assert all(float(opt_ours.state[p]["step"]) == want_steps for p in ours)
    assert opt_theirs.state_dict()["state"][0]["step"] == opt_ours.state_dict()["state"][0]["step"]


def test_clip_divisor_and_norm_edge_cases():
    assert float(clip_divisor(torch.tensor(0.5), 1.0)) == 1.0  # under the limit: untouched
    assert float(clip_divisor(torch.tensor(3.0), math.inf)) == 1.0
    assert float(clip_divisor(torch.tensor(3.0), 1.0)) == pytest.approx(3.0)
    assert not math.isfinite(float(clip_divisor(torch.tensor(float("inf")), 1.0)))
    with pytest.raises(ValueError, match="no gradients"):
        grad_norm([])
    with pytest.raises(ValueError, match="amsgrad"):
        FusedAdamW(_params("cpu", torch.float32), amsgrad=True).clip_and_step(1.0)


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-7), torch.bfloat16: dict(rtol=8e-3, atol=1e-5)}  # bf16: 1 ulp


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graph_step_equals_the_eager_step(dtype):
    """The captured step (after one eager warm-up step) replays the same update as the eager one, with the lr
    and max_norm of each call, skips a non-finite step, zeroes the gradients in place and keeps them as its
    static buffers; a changed hyperparameter or a replaced gradient tensor triggers a new capture."""
    eager, graphed = _params("cuda", dtype), _params("cuda", dtype)
    opt_eager = FusedAdamW(eager, lr=0.0, **KW)
    opt_graph = FusedAdamW(graphed, lr=0.0, cuda_graph=True, **KW)
    schedule = SCHEDULE + [(1e-2, 0.5, False)] * 2
    for step, (lr, max_norm, nonfinite) in enumerate(schedule):
        grads = _grads(step, "cuda", dtype, nonfinite)
        _accumulate(eager, grads)
        _accumulate(graphed, grads)
        buffers = [p.grad for p in graphed]
        if step == 5:  # a new weight decay: captured again
            for opt in (opt_eager, opt_graph):
                opt.param_groups[0]["weight_decay"] = 0.05
        if step == 6:  # a gradient tensor replaced (e.g. zero_grad(set_to_none=True) elsewhere): captured again
            graphed[0].grad = graphed[0].grad.clone()
            buffers[0] = graphed[0].grad
        for opt in (opt_eager, opt_graph):
            opt.param_groups[0]["lr"] = lr
        n_eager, n_graph = opt_eager.clip_and_step(max_norm)(), opt_graph.clip_and_step(max_norm)()
        torch.testing.assert_close(n_graph, n_eager, rtol=0, atol=0, equal_nan=True)  # the same kernels
        for p, q in zip(graphed, eager, strict=True):
            # The graph takes lr as a device tensor (fp32), the eager step as a Python float: last-bit differences.
            torch.testing.assert_close(p, q, **TOL[dtype], msg=lambda m, s=step: f"step {s}: {m}")
        assert all(p.grad is b and not p.grad.any() for p, b in zip(graphed, buffers, strict=True))
        assert (opt_graph._graph is not None) == (step >= 1)
    for p, q in zip(graphed, eager, strict=True):
        torch.testing.assert_close(opt_graph.state[p]["exp_avg_sq"], opt_eager.state[q]["exp_avg_sq"], **TOL[dtype])
        assert float(opt_graph.state[p]["step"]) == float(opt_eager.state[q]["step"]) == len(schedule) - 1


@needs_cuda
def test_cuda_graph_step_trains_a_model_like_the_eager_step():
    """Through real backward passes (gradients accumulated in place into the graph's buffers, two micro-batches
    per step): the same weights as the eager step after several steps, and zero_grad keeps the buffers."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)).cuda()
    models = [model, copy.deepcopy(model)]
    opts = [FusedAdamW(m.parameters(), lr=1e-2, cuda_graph=g, **KW) for m, g in zip(models, (False, True), strict=True)]
    x = torch.randn(6, 32, 64, device="cuda")
    for step in range(5):
        for m, opt in zip(models, opts, strict=True):
            for mb in x[step : step + 2]:
                m(mb).square().mean().backward()
            opt.clip_and_step(0.1)
        for p, q in zip(models[1].parameters(), models[0].parameters(), strict=True):
            torch.testing.assert_close(p, q, **TOL[torch.float32], msg=lambda m, s=step: f"step {s}: {m}")
    buffers = [p.grad for p in models[1].parameters()]
    models[1](x[0]).sum().backward()
    opts[1].zero_grad(set_to_none=True)
    assert all(p.grad is b and not b.any() for p, b in zip(models[1].parameters(), buffers, strict=True))
