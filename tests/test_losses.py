"""Losses against direct per-token references written from the formulas, values and gradients."""

import math

import pytest
import torch

from meshrl.advantages import group_advantages
from meshrl.losses import LossBatch, cross_entropy_loss, get_loss, grpo_loss
from meshrl.schedule import lr_at


def _batch(B=3, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    old = -torch.rand(B, T, generator=g) * 2 * mask
    adv = torch.randn(B, generator=g)
    logp = (old + torch.randn(B, T, generator=g) * 0.4).requires_grad_(True)
    return logp, LossBatch(mask=mask, old_logprobs=old, advantages=adv)


def test_grpo_loss_matches_per_token_reference():
    logp, b = _batch()
    lo, hi = 0.2, 0.28
    per_token, metrics = grpo_loss(logp, b, clip_low=lo, clip_high=hi)  # losses return [B, T]; masked sum here
    loss = (per_token * b.mask).sum()
    loss.backward()
    ref, n_clipped, grads = 0.0, 0, torch.zeros_like(logp)
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if b.mask[i, t] == 0:
                continue
            r = math.exp(logp[i, t].item() - b.old_logprobs[i, t].item())
            a = b.advantages[i].item()
            unclipped, clipped = r * a, min(max(r, 1 - lo), 1 + hi) * a
            ref += -min(unclipped, clipped)
            n_clipped += clipped < unclipped
            # d/dlogp of -r*a is -r*a when the unclipped branch is active; the clipped branch is constant.
            grads[i, t] = -r * a if unclipped <= clipped else 0.0
    assert loss.item() == pytest.approx(ref, rel=1e-5, abs=1e-6)
    assert metrics["clip_frac"].item() == n_clipped
    torch.testing.assert_close(logp.grad, grads, rtol=1e-5, atol=1e-6)


def test_grpo_on_policy_has_no_clipping_and_ratio_one():
    logp, b = _batch()
    on_policy = b.old_logprobs.clone().requires_grad_(True)
    per_token, m = grpo_loss(on_policy, b)
    loss = (per_token * b.mask).sum()
    assert m["clip_frac"].item() == 0
    assert m["ratio"].item() == pytest.approx(b.mask.sum().item())
    assert m["kl_k3"].item() == pytest.approx(0.0, abs=1e-7)
    # On policy the loss is -sum(A * mask): the REINFORCE surrogate.
    assert loss.item() == pytest.approx(-(b.advantages[:, None] * b.mask).sum().item(), rel=1e-6)


def test_cross_entropy_is_masked_nll():
    logp, b = _batch()
    per_token, _ = cross_entropy_loss(logp, b)
    loss = (per_token * b.mask).sum()
    assert loss.item() == pytest.approx(-(logp * b.mask).sum().item(), rel=1e-6)


def test_unknown_loss_is_named():
    with pytest.raises(ValueError, match="unknown loss 'nope'.*grpo"):
        get_loss("nope")


def test_group_advantages():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5], 4)
    assert adv[:4] == pytest.approx([0.866, -0.866, -0.866, 0.866], abs=1e-3)
    assert adv[4:] == pytest.approx([0.0] * 4)  # all-equal group: no signal
    assert group_advantages([1.0, 0.0], 2, normalize_std=False) == pytest.approx([0.5, -0.5])
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages([1.0, 2.0], 3)


def test_lr_schedule():
    kw = dict(peak_lr=1.0, total_steps=10, min_lr_ratio=0.1)
    assert [lr_at(s, warmup_steps=2, **kw) for s in (0, 1, 2)] == pytest.approx([0.5, 1.0, 1.0])
    assert lr_at(10, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_at(5, schedule="linear", **kw) == pytest.approx(0.55)
    with pytest.raises(ValueError, match="unknown LR schedule"):
        lr_at(0, schedule="warp", **kw)
