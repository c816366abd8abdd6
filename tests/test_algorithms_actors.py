"""Algorithm invariants through the real actors (2-process FSDP trainer, vLLM generator, reward actor, and a
ReferenceModel mesh): on-policy first step, the frozen reference and its KL term, and dynamic sampling."""

from __future__ import annotations

import random

import pytest
import torch

from meshrl.losses import kl_estimate, make_loss_spec
from meshrl.types import Datum, OptimParams, SamplingParams


def _on_policy_batch(ctl, tokenizer, *, n_prompts=4, n=4, max_tokens=6, seed=0):
    """Completions sampled from the generator after a sync, with random non-zero advantages."""
    ctl.sync_weights()
    rng = random.Random(seed)
    prompts = [tokenizer.encode("".join(rng.choice("abcdefgh") for _ in range(3)) + "=") for _ in range(n_prompts)]
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=seed)
    groups = ctl.generate(prompts, params).result()
    g = torch.Generator().manual_seed(seed)
    return [
        Datum.from_completion(c.prompt_ids, c.token_ids, c.logprobs, float(torch.randn(1, generator=g)) or 0.5)
        for group in groups
        for c in group
    ]


@pytest.mark.parametrize("loss, aggregation", [("grpo", "token_mean"), ("gspo", "seq_mean_token_mean"),
                                               ("cispo", "token_mean")])  # fmt: skip
def test_first_step_is_on_policy_ratio_one_and_nothing_clipped(ctl, tokenizer, base_model_dir, loss, aggregation):
    ctl.load_checkpoint(base_model_dir)
    data = _on_policy_batch(ctl, tokenizer)
    spec = make_loss_spec(loss, data, aggregation=aggregation, return_logprobs=True)
    res = ctl.forward_backward(data, spec).result()
    n_tok = sum(d.num_loss_tokens for d in data)
    # The trainer's logprobs of the sampled tokens equal the generator's: log-ratio ~ 0 on every token.
    diff = max(
        abs(t - o)
        for d, lp in zip(data, res.logprobs, strict=True)
        for t, o, m in zip(lp, d.old_logprobs, d.loss_mask, strict=True)
        if m
    )
    assert diff < 1e-4
    assert res.metrics["ratio"] / n_tok == pytest.approx(1.0, abs=1e-4)
    assert res.metrics["clip_frac"] == 0.0
    ctl.load_checkpoint(base_model_dir)  # discards the accumulated gradients


def test_reference_model_is_frozen_and_its_kl_term_matches_by_hand(ctl, tokenizer, base_model_dir):
    ctl.load_checkpoint(base_model_dir)
    if ctl.reference is None:
        ctl.start_reference(base_model_dir, num_procs=2)
    data = _on_policy_batch(ctl, tokenizer, seed=1)
    ref0 = ctl.reference_logprobs(data).result()
    # At the start the reference IS the policy: same logprobs as the trainer's forward.
    torch.testing.assert_close(torch.tensor(sum(ref0, [])), torch.tensor(sum(ctl.forward(data).result(), [])))
    # One policy step later the reference has not moved, the trainer has.
    spec = make_loss_spec("grpo", data)
    ctl.forward_backward(data, spec).result()
    ctl.optim_step(OptimParams(lr=5e-3)).result()
    ref1 = ctl.reference_logprobs(data).result()
    assert sum(ref1, []) == sum(ref0, [])
    for d, row in zip(data, ref1, strict=True):
        d.ref_logprobs = row
    # The KL term of forward_backward: kl_coef * k3(policy, reference) per loss token, summed in the metrics.
    spec = make_loss_spec("grpo", data, kl_coef=0.1, kl_estimator="k3", return_logprobs=True)
    res = ctl.forward_backward(data, spec).result()
    f64 = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    want = sum(
        float((kl_estimate(f64(lp), f64(d.ref_logprobs)) * f64(d.loss_mask)).sum())
        for d, lp in zip(data, res.logprobs, strict=True)
    )
    assert want > 1e-6  # the step moved the policy away from the reference: the comparison is not vacuous
    assert res.metrics["kl"] == pytest.approx(want, rel=1e-3)
    ctl.load_checkpoint(base_model_dir)


def test_dynamic_sampling_with_the_real_generator_and_reward_actor(ctl, base_model_dir):
    """One-token completions of a random model: many groups get the same char_match reward for every sample
    (all wrong). Dynamic sampling must drop exactly those and train only groups with a signal."""
    from meshrl.config import GRPOConfig
    from meshrl.controller.rollouts import sample_groups
    from meshrl.data.sampler import EpochSampler
    from meshrl.rollout.render import Renderer
    from meshrl.tasks.reverse import ReverseTaskConfig, build_reverse_task
    from meshrl.tasks.setup import TaskSetup

    ctl.load_checkpoint(base_model_dir)
    ctl.sync_weights()
    renderer = Renderer.from_model_dir(base_model_dir)  # the model's own tokenizer, as the GRPO program uses
    task = build_reverse_task(ReverseTaskConfig(num_train=200, num_eval=5))
    setup = TaskSetup.build(task, renderer, None, "exact_match", train_budget=40, eval_budget=40)
    cfg = GRPOConfig(prompts_per_step=4, group_size=4, dynamic_sampling=True, max_sampling_rounds=3)
    sampling = SamplingParams(n=4, max_tokens=1, temperature=1.0)
    rng, dropped, sampler = random.Random(0), 0, EpochSampler(len(setup.train), seed=0)
    for _ in range(4):
        got = sample_groups(ctl, setup, sampler, rng, sampling, cfg, dp=2)
        groups = [got.rewards[i : i + 4] for i in range(0, len(got.rewards), 4)]
        assert all(max(g) != min(g) for g in groups)
        assert len(got.episodes) == 4 * len(got.rows) and len(got.episodes) % 2 == 0
        assert got.prompts_drawn == 4 * got.rounds and len(got.task_rewards) == 4 * got.prompts_drawn
        dropped += got.groups_dropped
    assert dropped > 0  # the filter really ran on real rewards
