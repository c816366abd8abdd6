"""PolicyTrainer endpoints on a real 2-process FSDP2 mesh (Monarch + gloo), driven through the Controller."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from conftest import random_data
from monarch._src.actor.actor_mesh import ActorError

from meshrl.losses import LossBatch, grpo_loss
from meshrl.policy import collate
from meshrl.types import Datum, LossSpec, OptimParams

# Adam with a huge eps is SGD with lr/eps: the update is linear in the gradient, so comparing weights after
# one step compares the accumulated gradients themselves.
LINEAR_ADAM = OptimParams(lr=1.0, eps=1e3, grad_clip=0.0)


def _probe(ctl, data):
    return torch.tensor([x for row in ctl.forward(data).result() for x in row])


def mismatch_from_rows(data: list[Datum], trainer_logprobs: list[list[float]]) -> tuple[float, float]:
    """The controller's former computation from per-datum rows (controller/grpo.py `logprob_mismatch` until issue 30):
    mean and max |trainer − generator| logprob over the loss tokens of the data that carry old_logprobs."""
    diffs = [
        np.abs(np.asarray(lp) - np.asarray(d.old_logprobs))[np.asarray(d.loss_mask) > 0]
        for d, lp in zip(data, trainer_logprobs, strict=True)
        if d.old_logprobs is not None
    ]
    diff = np.concatenate(diffs) if diffs else np.zeros(0)
    return (float(diff.mean()), float(diff.max())) if diff.size else (0.0, 0.0)


def test_forward_backward_contract(ctl):
    data = random_data(8)
    n_tok = sum(d.num_loss_tokens for d in data)
    before = ctl.forward(data).result()
    assert [len(r) for r in before] == [len(d.tokens) - 1 for d in data]
    res = ctl.forward_backward(data, LossSpec("grpo", num_loss_tokens=n_tok, return_logprobs=True)).result()
    # forward_backward returns the pre-update logprobs, equal to forward's, for every datum in order (when asked).
    torch.testing.assert_close(torch.tensor(sum(res.logprobs, [])), torch.tensor(sum(before, [])))
    assert res.num_tokens == n_tok
    # The reported loss is the direct per-token reference computed from those logprobs.
    tokens, batch = collate(data, 0, torch.device("cpu"))
    width = batch.mask.shape[1]
    logp = torch.tensor([r + [0.0] * (width - len(r)) for r in res.logprobs])
    per_token, _ = grpo_loss(logp, batch)  # per-token [B, T]; token_mean = masked sum / n_tok
    ref = (per_token * batch.mask).sum()
    assert res.loss == pytest.approx(ref.item() / n_tok, rel=1e-5, abs=1e-6)
    v0 = ctl.policy_version
    out = ctl.optim_step(OptimParams(lr=1e-2)).result()
    assert out.policy_version == v0 + 1 == ctl.policy_version and out.lr == 1e-2 and out.grad_norm > 0
    after = ctl.forward(data).result()
    assert not torch.allclose(torch.tensor(sum(after, [])), torch.tensor(sum(before, [])))
    info = ctl.trainer_info
    assert info["world_size"] == 2 and info["num_params"] > 0
    assert info["peak_memory_gib"] is None and ctl.trainer_peak_memory_gib() is None  # CPU trainers


def test_micro_batches_equal_one_big_batch(ctl, base_model_dir):
    data = random_data(8, seed=1)
    probe = random_data(4, seed=2)
    spec = LossSpec("grpo", num_loss_tokens=sum(d.num_loss_tokens for d in data))

    ctl.load_checkpoint(base_model_dir)  # fresh weights and optimiser
    big = ctl.forward_backward(data, spec).result()
    g_big = ctl.optim_step(LINEAR_ADAM).result().grad_norm
    w_big = _probe(ctl, probe)

    ctl.load_checkpoint(base_model_dir)
    parts = [ctl.forward_backward(data[i : i + 2], spec) for i in range(0, 8, 2)]  # k=4 calls, queued
    parts = [p.result() for p in parts]
    g_micro = ctl.optim_step(LINEAR_ADAM).result().grad_norm
    w_micro = _probe(ctl, probe)

    assert sum(p.loss for p in parts) == pytest.approx(big.loss, rel=1e-5)
    assert g_micro == pytest.approx(g_big, rel=1e-5)
    torch.testing.assert_close(w_micro, w_big, rtol=0, atol=1e-6)
    # ...and the step really moved the weights (the comparison is not vacuous).
    ctl.load_checkpoint(base_model_dir)
    assert (w_big - _probe(ctl, probe)).abs().max() > 1e-3


def test_logprob_mismatch_is_reduced_on_the_trainer(ctl, base_model_dir):
    """forward_backward returns the trainer-vs-generator logprob mismatch (sum, count, max over both ranks) instead of
    per-token rows: equal to the controller's former computation from the rows (asked for here with
    return_logprobs), with uneven splits, a rank given nothing, sequences without old_logprobs, and the largest gap
    on the second rank (the max is a MAX over the ranks, not rank 0's)."""
    ctl.load_checkpoint(base_model_dir)
    data = random_data(8, seed=21)
    data[0].old_logprobs = None  # SFT-like sequences take no part
    data[3].old_logprobs = None
    data[6].old_logprobs = np.asarray(data[6].old_logprobs) - 20.0 * np.asarray(data[6].loss_mask)  # the max
    spec = LossSpec("grpo", num_loss_tokens=sum(d.num_loss_tokens for d in data))
    with_rows = dataclasses.replace(spec, return_logprobs=True)
    count = sum(d.num_loss_tokens for d in data if d.old_logprobs is not None)
    for split in ([4, 4], [5, 3], [8, 0], [0, 8]):
        ref = ctl.forward_backward(data, with_rows, split=split).result()
        mean, peak = mismatch_from_rows(data, ref.logprobs)
        assert peak > 10.0 and ref.logprob_diff_count == count
        assert ref.logprob_diff_sum / ref.logprob_diff_count == pytest.approx(mean, rel=1e-5)
        assert ref.logprob_diff_max == pytest.approx(peak, rel=1e-5)
        res = ctl.forward_backward(data, spec, split=split).result()  # the default: no rows travel
        assert res.logprobs is None
        assert (res.logprob_diff_sum, res.logprob_diff_count, res.logprob_diff_max) == pytest.approx(
            (ref.logprob_diff_sum, ref.logprob_diff_count, ref.logprob_diff_max), rel=1e-6
        )
    for d in data:  # no generator logprobs at all (SFT): zeros, as the controller's formula gave
        d.old_logprobs = None
    res = ctl.forward_backward(data, LossSpec("cross_entropy", num_loss_tokens=spec.num_loss_tokens)).result()
    assert (res.logprob_diff_sum, res.logprob_diff_count, res.logprob_diff_max) == (0.0, 0, 0.0)
    ctl.load_checkpoint(base_model_dir)  # discards the accumulated gradients


def test_gradients_accumulate_until_optim_step(ctl, base_model_dir):
    data = random_data(4, seed=3)
    spec = LossSpec("cross_entropy", num_loss_tokens=sum(d.num_loss_tokens for d in data))
    ctl.load_checkpoint(base_model_dir)
    ctl.forward_backward(data, spec).result()
    once = ctl.optim_step(LINEAR_ADAM).result().grad_norm
    ctl.load_checkpoint(base_model_dir)
    ctl.forward_backward(data, spec).result()
    ctl.forward_backward(data, spec).result()
    twice = ctl.optim_step(LINEAR_ADAM).result().grad_norm
    assert twice == pytest.approx(2 * once, rel=1e-5)
    with pytest.raises(ActorError, match="optim_step without gradients"):
        ctl.optim_step(LINEAR_ADAM).result()  # zeroed by the previous step
    # The step carried by the last forward_backward (as the GRPO loop sends it): the same step.
    ctl.load_checkpoint(base_model_dir)
    version = ctl.policy_version
    ctl.forward_backward(data, spec)
    step = dataclasses.replace(LINEAR_ADAM, num_micro_batches=2)
    carried = ctl.forward_backward(data, spec, step=step).result().optim
    assert carried.grad_norm == pytest.approx(twice, rel=1e-5)
    assert carried.policy_version == ctl.policy_version == version + 1


def test_nan_loss_is_a_clear_error_and_the_trainer_survives(ctl, base_model_dir):
    ctl.load_checkpoint(base_model_dir)
    data = random_data(4, seed=4)
    data[1].advantage = math.nan
    spec = LossSpec("grpo", num_loss_tokens=sum(d.num_loss_tokens for d in data))
    with pytest.raises(ActorError, match="loss is NaN or inf on 1 trainer rank"):
        ctl.forward_backward(data, spec).result()
    # The NaN was on rank 0 only, yet both ranks raised together (none left waiting in a collective):
    # the trainer still works.
    data[1].advantage = 1.0
    ctl.forward_backward(data, spec).result()
    assert math.isfinite(ctl.optim_step(OptimParams(lr=1e-3)).result().grad_norm)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: [], "empty batch"),
        (lambda: random_data(3), "cannot be split evenly over 2 trainer ranks"),
        (lambda: [Datum.from_completion([4] * 200, [5] * 100)] * 2, "exceeds the model's limit of 256"),
        (lambda: [Datum.from_completion([4, 99], [5])] * 2, "outside"),
    ],
)
def test_bad_batches_are_refused_before_any_collective(ctl, make, message):
    with pytest.raises(ActorError, match=message):
        ctl.forward_backward(make(), LossSpec("grpo", num_loss_tokens=10)).result()
    assert len(ctl.forward(random_data(2)).result()) == 2  # still healthy


def test_unknown_loss_is_refused(ctl):
    with pytest.raises(ActorError, match="unknown loss 'ppo2'"):
        ctl.forward_backward(random_data(2), LossSpec("ppo2")).result()


def test_datum_validation():
    with pytest.raises(ValueError, match="loss_mask has 1 entries; expected len\\(tokens\\) - 1 = 2"):
        Datum([1, 2, 3], [1.0])
    with pytest.raises(ValueError, match="empty response"):
        Datum.from_completion([1, 2], [])
    assert LossBatch  # re-exported type used by custom losses


def test_checkpoint_loads_in_transformers_with_trainer_logits(ctl, base_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from meshrl.policy import target_logprobs

    ctl.load_checkpoint(base_model_dir)
    data = random_data(4, seed=5)
    ctl.forward_backward(data, LossSpec("cross_entropy", num_loss_tokens=40)).result()
    ctl.optim_step(OptimParams(lr=1e-2)).result()
    path = ctl.export_hf(str(tmp_path / "ckpt"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    probe = random_data(2, seed=6)
    want = ctl.forward(probe).result()
    tokens, _ = collate(probe, 0, torch.device("cpu"))
    with torch.no_grad():
        got = target_logprobs(hf(tokens).logits, tokens)
    for i, row in enumerate(want):
        torch.testing.assert_close(got[i, : len(row)], torch.tensor(row), rtol=1e-5, atol=1e-5)


def test_packed_rows_give_the_same_loss_and_update(ctl, base_model_dir):
    """Sequence packing (document-masked attention, per-document positions) is an optimisation only."""
    from meshrl.controller.training import pad_rows
    from meshrl.data.sft import SFTExample, pack_examples

    examples = [SFTExample(d.tokens[:3], d.tokens[3:]) for d in random_data(10, seed=8)]
    plain = [Datum.from_completion(e.prompt_ids, e.response_ids) for e in examples]
    packed = pad_rows(pack_examples(examples, 24), 2, 0)
    assert len(packed) < len(plain) and any(d.positions.count(0) > 1 for d in packed)
    spec = LossSpec("cross_entropy", num_loss_tokens=sum(d.num_loss_tokens for d in plain))
    probe = random_data(2, seed=9)
    results = []
    for data in (plain, packed):
        ctl.load_checkpoint(base_model_dir)
        loss = ctl.forward_backward(data, spec).result().loss
        ctl.optim_step(LINEAR_ADAM).result()
        results.append((loss, _probe(ctl, probe)))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=1e-6)
