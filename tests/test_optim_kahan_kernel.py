"""The fused kahan AdamW kernel (meshrl.optim_kernels, Triton). On the CPU it runs in Triton's interpreter
(TRITON_INTERPRET=1, set before Triton is imported: a subprocess) against FusedAdamW's torch formulation of the
same step; on a GPU, FusedAdamW with the kernel against FusedAdamW with MESHRL_FUSED_KAHAN=0, eager and in a
CUDA graph, and both against the float32-master update at lr 1e-6 (test_optim_bf16's setting)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from markers import needs_cuda
from test_optim_bf16 import KW, LR, _flat, _fp32_master_run, _grads, _tracking, _weights

from meshrl import optim_kernels
from meshrl.optim import FusedAdamW

_triton = pytest.mark.skipif(optim_kernels.triton_missing() is not None, reason="Triton does not import here")

# Runs in the interpreter: KahanAdamW on CPU tensors beside FusedAdamW("kahan")'s torch formulation, fed the
# same bf16 gradients (one tensor's as float32, to cover that launch), at lr 1e-6; then the skipped step and
# the gradient divisor. Prints one JSON line of what the test asserts.
_INTERPRETED = textwrap.dedent(
    """
    import json, math, sys, torch
    sys.path.insert(0, {tests!r})
    from meshrl.optim import FusedAdamW
    from meshrl.optim_kernels import KahanAdamW
    from test_optim_bf16 import KW, LR, _flat, _fp32_master_run, _grads, _tracking, _weights

    steps = {steps}
    beta1, beta2 = KW["betas"]
    hyper = dict(lr=LR, beta1=beta1, beta2=beta2, weight_decay=KW["weight_decay"], eps=1e-8)
    params = [torch.nn.Parameter(w.clone()) for w in _weights().values()]
    opt = FusedAdamW(params, lr=LR, bf16_rounding="kahan", **KW)
    weights = [w.clone() for w in _weights().values()]
    comps, exp_avgs, exp_avg_sqs = ([torch.zeros_like(w) for w in weights] for _ in range(3))
    counts = [torch.zeros((), dtype=torch.float32) for _ in weights]
    kernel = KahanAdamW(weights, comps, exp_avgs, exp_avg_sqs, counts, block=8192)
    for step in range(steps):
        grads = _grads(step)
        for p, g in zip(params, grads):
            p.grad = g
        opt.clip_and_step(math.inf)
        grads[2] = grads[2].float()  # a second launch, of float32 gradients
        torch._foreach_add_(counts, 1)
        kernel.step(grads, **hyper)
    state = [opt.state[p] for p in params]
    start, end = _flat(_weights().values()), _flat(_fp32_master_run(steps))
    out = dict(
        launches=[len(ls) for ls in kernel._launches.values()],
        kernel=_tracking(_flat(weights) + _flat(comps), (start, end)),
        torch=_tracking(_flat(params) + _flat(s["kahan_comp"] for s in state), (start, end)),
        weight_diff=float((_flat(weights) + _flat(comps) - _flat(params) - _flat(s["kahan_comp"] for s in state))
                          .abs().max()),
        weights_differing=float((_flat(weights) != _flat(params)).double().mean()),
        exp_avg_rel=float((_flat(exp_avgs) - _flat(s["exp_avg"] for s in state)).norm()
                          / _flat(exp_avgs).norm()),
        exp_avg_sq_rel=float((_flat(exp_avg_sqs) - _flat(s["exp_avg_sq"] for s in state)).norm()
                             / _flat(exp_avg_sqs).norm()),
    )
    # A skipped step leaves every tensor bitwise; a divisor of 4 is the step of the gradients divided by 4.
    before = [t.clone() for t in weights + comps + exp_avgs + exp_avg_sqs]
    torch._foreach_add_(counts, 1)
    kernel.step(_grads(steps), **hyper, found_inf=torch.ones(()))
    out["skip_kept"] = all(torch.equal(a, b) for a, b in zip(before, weights + comps + exp_avgs + exp_avg_sqs))
    kernel.step(_grads(steps), **hyper, grad_scale=torch.tensor(4.0), found_inf=torch.zeros(()))
    divided = [t.clone() for t in weights + comps + exp_avgs + exp_avg_sqs]
    for t, b in zip(weights + comps + exp_avgs + exp_avg_sqs, before):
        t.copy_(b)
    kernel.step([g / 4 for g in _grads(steps)], **hyper)
    out["divisor_same"] = all(torch.equal(a, b) for a, b in zip(divided, weights + comps + exp_avgs + exp_avg_sqs))
    print(json.dumps(out))
    """
)


@_triton
def test_kernel_in_the_interpreter_is_the_torch_formulation():
    """The kernel's math is FusedAdamW's kahan step: after 12 steps at lr 1e-6 both track the float32 master
    alike (weight + comp within float32 noise of the torch formulation's; the CPU's fused kernel and the
    interpreter differ in a few float32 roundings, so a bf16 state value is now and then one step apart); bf16
    and float32 gradients in one step (two launches), tensors of odd sizes (a masked tail block); a skipped step
    changes no bit; the gradient divisor divides."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = _INTERPRETED.format(tests=os.path.dirname(__file__), steps=12)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["launches"] == [2], out
    (kernel_err, kernel_slope), (torch_err, torch_slope) = out["kernel"], out["torch"]
    assert kernel_err < 0.03 and abs(kernel_slope - 1) < 0.01, out
    assert abs(kernel_err - torch_err) < 0.005 and abs(kernel_slope - torch_slope) < 0.002, out
    assert out["weight_diff"] < 1e-6 and out["weights_differing"] < 0.01, out
    assert out["exp_avg_rel"] < 4e-3 and out["exp_avg_sq_rel"] < 4e-3, out  # under one bf16 step (2**-8)
    assert out["skip_kept"] and out["divisor_same"], out


def test_the_kernel_runs_only_on_cuda_with_triton():
    """CPU parameters take the torch formulation, silently (the kernel is compiled for CUDA); the reason is named."""
    assert "cpu" in optim_kernels.kernel_missing(torch.device("cpu"))
    params = [torch.nn.Parameter(w.clone()) for w in _weights().values()]
    opt = FusedAdamW(params, lr=LR, bf16_rounding="kahan", **KW)
    for p, g in zip(params, _grads(0), strict=True):
        p.grad = g
    opt.clip_and_step(math.inf)
    assert opt._kernels == {tuple(map(id, params)): None} and opt._plans
    with pytest.raises(ValueError, match="bf16 tensors"):
        w = torch.zeros(8)
        optim_kernels.KahanAdamW([w], [w], [w], [w], [torch.zeros(())])


def _cuda_run(fused: bool, graph: bool, steps: int) -> tuple[list[torch.Tensor], FusedAdamW]:
    params = [torch.nn.Parameter(w.cuda()) for w in _weights().values()]
    opt = FusedAdamW(params, lr=LR, bf16_rounding="kahan", cuda_graph=graph, **KW)
    opt.fused_kahan = fused
    for step in range(steps):
        for p, g in zip(params, _grads(step), strict=True):
            if p.grad is None:
                p.grad = g.cuda()
            else:
                p.grad.copy_(g)
        opt.clip_and_step(1.0)
    assert (opt._graph is not None) == graph
    assert all((k is not None) == fused for k in opt._kernels.values())
    return params, opt


@needs_cuda
@_triton
def test_kernel_on_the_gpu_is_torchs_step_and_tracks_the_master():
    """On CUDA, the kernel's kahan step is the torch formulation's (torch's CUDA fused kernel on float32 scratch)
    but for float32 roundings, eager and replayed from a CUDA graph; both track the float32 master at lr 1e-6."""
    steps = 100
    start = _flat(_weights().values()).cuda()
    end = _flat(_fp32_master_run(steps)).cuda()
    runs = {}
    for fused, graph in ((False, False), (True, False), (True, True)):
        params, opt = _cuda_run(fused, graph, steps)
        effective = _flat(params) + _flat(opt.state[p]["kahan_comp"] for p in params)
        runs[fused, graph] = (params, opt, effective)
        err, slope = _tracking(effective, (start, end))
        assert err < 0.03 and abs(slope - 1) < 0.01, (fused, graph, err, slope)
    (torch_p, torch_opt, torch_eff), (eager_p, eager_opt, eager_eff), (_, _, graph_eff) = runs.values()
    # weight + comp differ by float32 roundings, which can flip the comp's own bf16 rounding (up to ~1e-5 on a
    # norm weight ~1): measured against the size of the update, not elementwise.
    update = float((end - start).norm())
    assert float((eager_eff - torch_eff).norm()) / update < 0.003, float((eager_eff - torch_eff).norm()) / update
    assert float((graph_eff - eager_eff).norm()) / update < 0.003, float((graph_eff - eager_eff).norm()) / update
    assert float((_flat(eager_p) != _flat(torch_p)).double().mean()) < 0.001
    for key in ("exp_avg", "exp_avg_sq"):
        a = _flat(eager_opt.state[p][key] for p in eager_p)
        b = _flat(torch_opt.state[p][key] for p in torch_p)
        assert float((a != b).double().mean()) < 0.001, key
    assert all(
        torch.equal(eager_opt.state[p]["step"], torch_opt.state[q]["step"])
        for p, q in zip(eager_p, torch_p, strict=True)
    )
    assert math.isfinite(float(_flat(eager_p).sum()))
