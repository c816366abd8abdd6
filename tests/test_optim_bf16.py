"""meshrl.optim.FusedAdamW with pure-bf16 weights at an RL learning rate (1e-6), on the CPU: the bf16 weight
rounded to nearest loses almost every update (a bf16 step of a 0.02 weight is ~1e-4), compensated (kahan)
summation tracks the float32-master update, stochastic rounding tracks it in expectation. The reference is
torch's AdamW on float32 master copies of the same weights, fed the same (bf16) gradients."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from markers import needs_cuda

from meshrl.optim import FusedAdamW

LR, STEPS = 1e-6, 100
KW = dict(betas=(0.9, 0.95), weight_decay=0.01)
# A 0.6B LM's tensors in miniature: projections ~N(0, 0.02) (an embedding-like one spanning several of the
# multi-tensor kernels' 65 536-element chunks), and norm weights ~1.
SHAPES = {"embed": (600, 160), "proj": (128, 192), "proj2": (192, 128), "norm": (192,), "norm2": (128,)}


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in SHAPES.items():
        w = (
            1 + 0.05 * torch.randn(shape, generator=g)
            if name.startswith("norm")
            else 0.02 * torch.randn(shape, generator=g)
        )
        out[name] = w.bfloat16()  # the bf16 runs and the float32 reference start from the same values
    return out


def _grads(step: int) -> list[torch.Tensor]:
    """A fixed direction per weight plus per-step noise (so updates add up, as they do over a run), in bf16."""
    direction, noise = torch.Generator().manual_seed(7), torch.Generator().manual_seed(1000 + step)
    return [
        (1e-3 * (torch.randn(s, generator=direction) + torch.randn(s, generator=noise))).bfloat16()
        for s in SHAPES.values()
    ]


def _bf16_run(rounding: str, steps: int = STEPS, lr: float = LR, *, seed: int = 0, scratch: int | None = None):
    params = [torch.nn.Parameter(w.clone()) for w in _weights().values()]
    opt = FusedAdamW(params, lr=lr, bf16_rounding=rounding, rounding_seed=seed, **KW)
    if scratch is not None:
        opt.scratch_numel = scratch
    for step in range(steps):
        for p, g in zip(params, _grads(step), strict=True):
            p.grad = g
        opt.clip_and_step(math.inf)  # the entry point meshrl.policy uses
    return params, opt


def _fp32_master_run(steps: int = STEPS, lr: float = LR) -> list[torch.Tensor]:
    params = [torch.nn.Parameter(w.float()) for w in _weights().values()]
    opt = torch.optim.AdamW(params, lr=lr, fused=True, **KW)
    for step in range(steps):
        for p, g in zip(params, _grads(step), strict=True):
            p.grad = g.float()
        opt.step()
    return [p.detach() for p in params]


@pytest.fixture(scope="module")
def reference() -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end) of the float32-master run, all weights flattened (float64 for the error sums)."""
    start = torch.cat([w.double().flatten() for w in _weights().values()])
    return start, torch.cat([p.double().flatten() for p in _fp32_master_run()])


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().double().flatten() for t in tensors])


def _tracking(weights: torch.Tensor, reference) -> tuple[float, float]:
    """(|error| / |update| of the whole weight vector against the float32 master, slope of the update taken
    regressed on the reference update: 1 when it is right on average)."""
    start, end = reference
    want, got = end - start, weights - start
    return float((weights - end).norm() / want.norm()), float(got @ want / (want @ want))


def test_nearest_bf16_loses_the_updates(reference):
    """The failure the issue describes, and what the other tests are measured against: plain bf16 AdamW at lr 1e-6
    leaves nearly every weight where it was, the total update almost entirely lost."""
    params, _ = _bf16_run("nearest")
    start = _flat(_weights().values())
    moved = float((_flat(params) != start).double().mean())
    err, slope = _tracking(_flat(params), reference)
    assert moved < 0.1, moved
    assert err > 0.9 and slope < 0.2, (err, slope)


def test_kahan_tracks_the_fp32_master_update(reference):
    """weight + comp tracks the float32 master within a few percent of the update (bf16 exp_avg / exp_avg_sq
    and the comp's own bf16 rounding), unbiased; the bf16 weight is the master rounded, within one bf16 step;
    the AdamW state is torch's fused kernel's to the bit (it does not depend on the weights)."""
    params, opt = _bf16_run("kahan")
    comps = [opt.state[p]["kahan_comp"] for p in params]
    assert all(c.dtype == torch.bfloat16 and c.shape == p.shape for c, p in zip(comps, params, strict=True))
    effective = _flat(params) + _flat(comps)
    err, slope = _tracking(effective, reference)
    assert err < 0.03 and abs(slope - 1) < 0.01, (err, slope)
    # The weight the forward pass uses: the master rounded, give or take one bf16 step of it; near 0, where that
    # step is finer than the tracking error, give or take a fraction of one update (lr).
    end = reference[1].float()
    _, exponent = torch.frexp(end)
    ulp = torch.ldexp(torch.ones_like(end), exponent - 8)
    off = (_flat(params).float() - end).abs()
    assert bool((off <= ulp + 0.5 * LR).all()) and bool((off[end.abs() > 1e-3] <= ulp[end.abs() > 1e-3]).all())
    nearest, torch_opt = _torch_bf16_adamw()
    for p, q in zip(params, nearest, strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], torch_opt.state[q][key]), key


def _torch_bf16_adamw(steps: int = STEPS):
    params = [torch.nn.Parameter(w.clone()) for w in _weights().values()]
    opt = torch.optim.AdamW(params, lr=LR, fused=True, **KW)
    for step in range(steps):
        for p, g in zip(params, _grads(step), strict=True):
            p.grad = g
        opt.step()
    return params, opt


def test_kahan_first_step_is_the_fused_kernels_and_chunking_changes_nothing():
    """With no compensation yet, one kahan step stores exactly what torch's bf16 fused kernel stores (the same
    float32 math, rounded to nearest); the scratch chunking (parameters split across chunks) changes no bit."""
    kahan, _ = _bf16_run("kahan", steps=1, lr=1e-3)
    torch_bf16, _ = _torch_bf16_adamw(steps=0)
    opt = torch.optim.AdamW(torch_bf16, lr=1e-3, fused=True, **KW)
    for p, g in zip(torch_bf16, _grads(0), strict=True):
        p.grad = g
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(kahan, torch_bf16, strict=True))
    whole, opt_whole = _bf16_run("kahan", steps=20)
    split, opt_split = _bf16_run("kahan", steps=20, scratch=10_000)
    assert len(opt_split._plans[tuple(map(id, split))].chunks) > 10
    for p, q in zip(whole, split, strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt_whole.state[p]["kahan_comp"], opt_split.state[q]["kahan_comp"])


def test_stochastic_rounding_tracks_in_expectation(reference):
    """Each weight is off by up to a bf16 step, but the update is right on average (the regression slope over
    ~150k weights), far from nearest's; reproducible from its seed."""
    params, _ = _bf16_run("stochastic")
    err, slope = _tracking(_flat(params), reference)
    assert abs(slope - 1) < 0.05, (err, slope)
    start, end = reference
    bias = float((_flat(params) - end).mean() / (end - start).abs().mean())
    assert abs(bias) < 0.05, bias
    again, _ = _bf16_run("stochastic", steps=10)
    assert all(torch.equal(p, q) for p, q in zip(_bf16_run("stochastic", steps=10)[0], again, strict=True))
    other, _ = _bf16_run("stochastic", steps=10, seed=1)
    assert not all(torch.equal(p, q) for p, q in zip(other, again, strict=True))


@pytest.mark.parametrize("rounding", ["kahan", "stochastic"])
def test_skipped_step_keeps_the_weights_and_state(rounding):
    """A non-finite gradient norm skips the step on the device: AdamW state unchanged; stochastic: weights too.
    kahan re-splits the unchanged float32 weight + comp: the same value to float32 rounding, and the same bf16
    weight but where weight + comp was an exact tie of two bf16 values (then the other one, comp negated)."""
    params, opt = _bf16_run(rounding, steps=5)
    before = copy.deepcopy([dict(opt.state[p]) for p in params]), [p.detach().clone() for p in params]
    for p, g in zip(params, _grads(5), strict=True):
        p.grad = g
    params[1].grad.view(-1)[3] = float("nan")
    assert not math.isfinite(float(opt.clip_and_step(1.0)()))
    for p, state, old in zip(params, *before, strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], state[key]), key
        if rounding == "stochastic":
            assert torch.equal(p, old)
            continue
        comp, old_comp = opt.state[p]["kahan_comp"].double(), state["kahan_comp"].double()
        value, old_value = p.double() + comp, old.double() + old_comp
        torch.testing.assert_close(value, old_value, rtol=2**-24, atol=0)
        flipped = p != old
        assert bool((old_comp[flipped].abs() == (p.double() - old.double())[flipped].abs() / 2).all())


def test_kahan_state_dict_round_trip_is_exact():
    """The comp is optimiser state: saved, loaded into a fresh optimiser (over split chunks), the run goes on
    bitwise as if uninterrupted; loading a checkpoint without it (torch's AdamW, "nearest") starts it at 0."""
    whole, opt_whole = _bf16_run("kahan", steps=30)
    resumed, opt = _bf16_run("kahan", steps=20, scratch=10_000)
    saved = copy.deepcopy(opt.state_dict())
    assert all("kahan_comp" in s for s in saved["state"].values())
    fresh = FusedAdamW(resumed, lr=LR, bf16_rounding="kahan", **KW)
    fresh.load_state_dict(saved)
    for step in range(20, 30):
        for p, g in zip(resumed, _grads(step), strict=True):
            p.grad = g
        fresh.clip_and_step(math.inf)
    for p, q in zip(whole, resumed, strict=True):
        assert torch.equal(p, q)
        for key in ("kahan_comp", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt_whole.state[p][key], fresh.state[q][key]), key
    _, nearest = _bf16_run("nearest", steps=2)
    fresh.load_state_dict(nearest.state_dict())
    fresh._state_lists()
    assert all(not fresh.state[p]["kahan_comp"].any() for p in resumed)


def test_kahan_comp_round_trips_through_dcp(tmp_path):
    """As Policy.save_state / load_state do it (torch DCP through get_state_dict / set_state_dict; the fresh
    optimiser's state allocated by a step at lr 0, which must leave the weights alone): bitwise continuation."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def model_and_opt(weights, lr=LR):
        model = torch.nn.ParameterDict({k: torch.nn.Parameter(w.clone()) for k, w in weights.items()})
        return model, FusedAdamW(model.parameters(), lr=lr, bf16_rounding="kahan", **KW)

    def steps(model, opt, start, stop):
        for step in range(start, stop):
            for p, g in zip([model[k] for k in SHAPES], _grads(step), strict=True):
                p.grad = g
            opt.clip_and_step(math.inf)

    model, opt = model_and_opt(_weights())
    steps(model, opt, 0, 10)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path))
    steps(model, opt, 10, 15)

    other, other_opt = model_and_opt(_weights(seed=1), lr=0.0)  # the checkpoint brings the lr back
    start = [p.detach().clone() for p in other.values()]
    for p in other.values():
        p.grad = torch.zeros_like(p)
    other_opt.step()
    other_opt.zero_grad(set_to_none=True)
    assert all(torch.equal(p, q) for p, q in zip(other.values(), start, strict=True))
    model_sd, optim_sd = get_state_dict(other, other_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(tmp_path))
    set_state_dict(other, other_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    steps(other, other_opt, 10, 15)
    for p, q in zip(model.values(), other.values(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["kahan_comp"], other_opt.state[q]["kahan_comp"])


@pytest.mark.parametrize("rounding", ["kahan", "stochastic"])
def test_fp32_params_are_unaffected(rounding):
    """float32 parameters beside bf16 ones take torch's fused kernel as before: bitwise what "nearest" gives,
    through clip_and_step (clipping) and step(); no comp for them."""
    runs = []
    for mode in ("nearest", rounding):
        g = torch.Generator().manual_seed(3)
        fp32 = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(64, 32), (32,)]]
        bf16 = [torch.nn.Parameter(torch.randn(40, 8, generator=g).bfloat16())]
        opt = FusedAdamW([{"params": fp32}, {"params": bf16 + fp32[:0], "lr": 1e-3}], lr=1e-2, bf16_rounding=mode, **KW)
        for step in range(4):
            gg = torch.Generator().manual_seed(50 + step)
            for p in fp32 + bf16:
                p.grad = torch.randn(p.shape, generator=gg).to(p.dtype)
            if step % 2:
                opt.step()
            else:
                opt.clip_and_step(0.5)
        runs.append((fp32, opt))
    (want, opt_want), (got, opt_got) = runs
    for p, q in zip(want, got, strict=True):
        assert torch.equal(p, q)
        assert "kahan_comp" not in opt_got.state[q]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt_want.state[p][key], opt_got.state[q][key])


def test_bad_rounding_is_refused():
    with pytest.raises(ValueError, match="bf16_rounding"):
        FusedAdamW([torch.nn.Parameter(torch.zeros(2))], bf16_rounding="truncate")
    with pytest.raises(ValueError, match="amsgrad"):
        FusedAdamW([torch.nn.Parameter(torch.zeros(2))], bf16_rounding="kahan", amsgrad=True)


@needs_cuda
@pytest.mark.parametrize("rounding", ["kahan", "stochastic"])
def test_cuda_graph_step_with_bf16_rounding(rounding):
    """The compensated / stochastically rounded step is captured too (no fall-back to eager) and replays the
    eager update: kahan to float32 rounding (the graph's lr is a device tensor), stochastic in expectation (the
    generator, registered with the graph, gives each replay fresh bits) and reproducibly from its seed."""
    runs = []
    for graph, seed in ((False, 0), (True, 0), (True, 0)):
        params = [torch.nn.Parameter(w.cuda()) for w in _weights().values()]
        opt = FusedAdamW(params, lr=LR, bf16_rounding=rounding, cuda_graph=graph, rounding_seed=seed, **KW)
        for step in range(12):
            for p, g in zip(params, _grads(step), strict=True):
                if p.grad is None:
                    p.grad = g.cuda()
                else:
                    p.grad.copy_(g)
            opt.clip_and_step(math.inf)
        assert opt.cuda_graph == graph and (opt._graph is not None) == graph
        runs.append((params, opt))
    (eager, opt_eager), (graphed, opt_graph), (again, _) = runs
    start = _flat(_weights().values()).cuda()
    if rounding == "kahan":
        got = _flat(graphed) + _flat(opt_graph.state[p]["kahan_comp"] for p in graphed)
        want = _flat(eager) + _flat(opt_eager.state[p]["kahan_comp"] for p in eager)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-8)
    else:
        got, want = _flat(graphed) - start, _flat(eager) - start
        assert abs(float(got @ want / (want @ want)) - 1) < 0.1
    assert all(torch.equal(p, q) for p, q in zip(graphed, again, strict=True))
