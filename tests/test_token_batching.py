"""Token-budget micro-batches balanced over the trainer ranks, and packed RL batches (meshrl.batching): the plan
obeys its bounds, and any plan — packed or not, uneven per-rank splits — trains the same update as one big batch."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from conftest import random_data
from test_trainer_endpoints import mismatch_from_rows

from meshrl.batching import layout_tokens, pack_rows, plan_micro_batches, rank_sizes
from meshrl.losses import make_loss_spec
from meshrl.models.sharding import full_tensor
from meshrl.types import LossSpec, OptimParams

LINEAR_ADAM = OptimParams(lr=1.0, eps=1e3, grad_clip=0.0)  # the update is linear in the gradient


# ---- the plan ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_plan_covers_every_sequence_once_within_the_budget(pack, ranks):
    rng = random.Random(ranks)
    lengths = [rng.choice([rng.randint(20, 60), rng.randint(300, 520)]) for _ in range(97)]
    budget = 1200
    plan = plan_micro_batches(lengths, num_ranks=ranks, max_tokens=budget, max_seqs=16, pack=pack)
    seen = sorted(i for call in plan for part in call for i in part)
    assert seen == list(range(len(lengths)))
    for call in plan:
        assert len(call) == ranks and sum(rank_sizes(call)) <= 16
        for part in call:
            assert layout_tokens([lengths[i] for i in part], pack=pack, row_len=0) <= budget
    # Few calls: at most ~2x the lower bound that the budget allows (packing removes the padding bound).
    lower = sum(lengths) / (budget * ranks)
    assert len(plan) <= max(2 * lower, len(lengths) / 16) + 2


def test_plan_balances_the_ranks_of_a_call():
    rng = random.Random(0)
    lengths = [rng.randint(10, 2000) for _ in range(256)]
    plan = plan_micro_batches(lengths, num_ranks=4, max_tokens=8192, pack=True)
    full_calls = plan[:-1]  # the last call takes what is left
    for call in full_calls:
        loads = [sum(lengths[i] for i in part) for part in call]
        assert max(loads) <= 1.35 * min(loads), loads


def test_packing_needs_fewer_tokens_than_padding():
    lengths = [500] + [40] * 30
    assert layout_tokens(lengths, pack=False, row_len=0) == 31 * 500
    assert layout_tokens(lengths, pack=True, row_len=0) <= 4 * 500
    rows = pack_rows(lengths, 0)
    assert sorted(i for r in rows for i in r) == list(range(31))
    assert all(sum(lengths[i] for i in r) <= 500 for r in rows)


@pytest.mark.parametrize("row_len", [0, 700])
@pytest.mark.parametrize("pack", [False, True])
def test_the_planner_counts_a_share_as_layout_tokens_does(pack, row_len):
    """The planner keeps each rank's layout up to date as sequences arrive (longest first) instead of re-packing
    the share per candidate (cubic: seconds per step at 1024 sequences): its count must stay layout_tokens'."""
    from meshrl.batching import _PartLayout

    rng = random.Random(row_len)
    for _ in range(50):
        lengths = sorted((rng.randint(2, 600) for _ in range(rng.randint(1, 60))), reverse=True)
        part = _PartLayout(pack, row_len)
        for n, length in enumerate(lengths, 1):
            predicted = part.cost_with(length)
            part.add(length)
            assert part.cost == predicted == layout_tokens(lengths[:n], pack=pack, row_len=row_len)


def test_a_sequence_over_the_budget_gets_a_call_of_its_own():
    plan = plan_micro_batches([50, 900, 60], num_ranks=2, max_tokens=100, pack=True)
    assert [1] in [part for call in plan for part in call]


def test_pack_for_forward_maps_back_to_every_target():
    from meshrl.policy import collate, pack_for_forward

    data = random_data(9, seed=4)
    tokens, positions, index = pack_for_forward(data, 0, 16, torch.device("cpu"))
    assert tokens.shape[0] < len(data)  # some rows hold several sequences
    # "logprob" of each target := the target token itself: the gathered layout must equal collate's targets.
    targets = tokens[:, 1:].reshape(-1).float()[index]
    plain, batch = collate(data, 0, torch.device("cpu"))
    mask = batch.mask > 0
    assert torch.equal(targets[mask], plain[:, 1:].float()[mask])
    # Every packed document starts at position 0 and counts up.
    assert (positions[:, 0] == 0).all()


# ---- one Policy: packed RL batches equal unpacked ----------------------------------------------------------------
def _loss_and_grads(model_dir, backend, data, spec, pack):
    from meshrl.policy import Policy

    p = Policy.from_options(model_dir, backend=backend, pack_sequences=pack)
    assert p.pack_sequences is pack  # the start-up check found packing sound for this model
    fb = p.forward_backward(data, spec)
    grads = {n: full_tensor(q.grad).clone() for n, q in p.model.named_parameters() if q.grad is not None}
    return fb, grads


@pytest.mark.parametrize("backend", ["hf", "torchtitan"])
@pytest.mark.parametrize(("loss", "aggregation"), [("grpo", "token_mean"), ("gspo", "seq_mean_token_mean")])
def test_packed_rl_batch_equals_unpacked(one_rank_group, base_model_dir, backend, loss, aggregation):
    """RL data (per-sequence advantages, generator logprobs, sequence-level losses) packed into shared rows inside
    the trainer: same loss, per-datum logprobs and gradients as one sequence per row."""
    data = random_data(10, seed=5)
    spec = make_loss_spec(loss, data, aggregation=aggregation, return_logprobs=True)
    plain, g_plain = _loss_and_grads(base_model_dir, backend, data, spec, pack=False)
    packed, g_packed = _loss_and_grads(base_model_dir, backend, data, spec, pack=True)
    assert packed.loss == pytest.approx(plain.loss, rel=1e-5, abs=1e-7)
    assert [len(r) for r in packed.logprobs] == [len(d.tokens) - 1 for d in data]
    torch.testing.assert_close(
        torch.tensor(sum(packed.logprobs, [])), torch.tensor(sum(plain.logprobs, [])), rtol=0, atol=1e-5
    )
    # The trainer's logprob mismatch, reduced over packed rows, is the one computed from the rows it returns.
    mean, peak = mismatch_from_rows(data, packed.logprobs)
    assert packed.logprob_diff_count == sum(d.num_loss_tokens for d in data)
    assert packed.logprob_diff_sum / packed.logprob_diff_count == pytest.approx(mean, rel=1e-5)
    assert packed.logprob_diff_max == pytest.approx(peak, rel=1e-5)
    assert g_plain
    for name, grad in g_plain.items():
        torch.testing.assert_close(g_packed[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


# ---- the trainer mesh: token-budget steps, uneven splits -----------------------------------------------------------
def _probe(ctl, data):
    return torch.tensor([x for row in ctl.forward(data).result() for x in row])


def test_token_budget_step_equals_one_big_batch(ctl, base_model_dir):
    """`train_step` under a small token budget: several calls, uneven per-rank splits (one rank may get nothing),
    packed rows; the update equals one call holding every sequence, and the step's logprob mismatch (reduced on the
    trainer, combined over the calls) is the one computed from that call's per-datum logprobs."""
    from meshrl.controller.training import train_step

    data = random_data(11, seed=12)  # odd: the ranks cannot split it evenly
    probe = random_data(4, seed=13)
    spec = make_loss_spec("grpo", data)
    saved = ctl.trainer_cfg
    try:
        ctl.load_checkpoint(base_model_dir)
        big = ctl.forward_backward(data, dataclasses.replace(spec, return_logprobs=True), split=[6, 5]).result()
        ctl.optim_step(LINEAR_ADAM).result()
        w_big = _probe(ctl, probe)

        ctl.trainer_cfg = dataclasses.replace(saved, max_tokens_per_micro_batch=16)
        plan = ctl.micro_batch_plan([len(d.tokens) for d in data], 8)
        assert len(plan) > 2 and any(len(set(rank_sizes(call))) > 1 for call in plan)
        ctl.load_checkpoint(base_model_dir)
        results, opt, mismatch = train_step(ctl, data, spec, 8, LINEAR_ADAM)
        w_plan = _probe(ctl, probe)
    finally:
        ctl.trainer_cfg = saved
    assert len(results) == len(plan) and opt.policy_version == ctl.policy_version
    assert sum(r.loss for r in results) == pytest.approx(big.loss, rel=1e-5)
    assert all(r.logprobs is None for r in results)  # no rows unless asked for
    assert mismatch == pytest.approx(mismatch_from_rows(data, big.logprobs), rel=1e-5)
    torch.testing.assert_close(w_plan, w_big, rtol=0, atol=1e-6)
    ctl.load_checkpoint(base_model_dir)
    assert (w_big - _probe(ctl, probe)).abs().max() > 1e-3  # the step moved the weights: not vacuous


def test_trainer_reports_budget_and_memory(ctl):
    assert ctl.token_budget() >= 256  # derived from the host's free memory on CPU
    memory = ctl.trainer_memory()
    assert len(memory) == 2 and set(memory[0]) == {"allocated_gib", "reserved_gib", "peak_gib"}
    assert ctl.offload_optimizer_state().result() == 0  # CPU trainers keep their state


def test_split_is_checked(ctl):
    data = random_data(3)
    spec = LossSpec("grpo", num_loss_tokens=sum(d.num_loss_tokens for d in data))
    with pytest.raises(Exception, match="split="):
        ctl.forward_backward(data, spec, split=[1, 1]).result()
    rows = ctl.forward(data, split=[3, 0]).result()  # a rank with nothing computes a loss-free row, not returned
    assert [len(r) for r in rows] == [len(d.tokens) - 1 for d in data]
