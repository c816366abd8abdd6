"""After a sync the generator runs exactly the trainer's weights, and never serves a stale version."""

import pytest
import torch
from conftest import random_data
from monarch._src.actor.actor_mesh import ActorError

from meshrl.types import LossSpec, OptimParams, SamplingParams


def _max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def test_generator_logprobs_match_trainer_after_each_sync(ctl, base_model_dir):
    ctl.load_checkpoint(base_model_dir)
    ctl.sync_weights()
    probe = random_data(4, seed=10)
    seqs = [d.tokens for d in probe]
    assert _max_diff(ctl.prompt_logprobs(seqs).result(), ctl.forward(probe).result()) < 1e-4

    for step in range(2):
        data = random_data(4, seed=20 + step)
        ctl.forward_backward(data, LossSpec("cross_entropy", num_loss_tokens=30)).result()
        version = ctl.optim_step(OptimParams(lr=5e-2)).result().policy_version
        stale = ctl.prompt_logprobs(seqs).result()
        trainer = ctl.forward(probe).result()
        assert _max_diff(stale, trainer) > 1e-3  # the update is visible: the check below is not vacuous
        timing = ctl.sync_weights()
        assert timing.version == version and timing.bytes > 0
        assert _max_diff(ctl.prompt_logprobs(seqs).result(), trainer) < 1e-4


def test_completions_carry_the_version_and_stale_requests_are_refused(ctl, tokenizer):
    ctl.sync_weights()
    params = SamplingParams(max_tokens=4, temperature=1.0, n=2, seed=0)
    groups = ctl.generate([tokenizer.encode("abc=")], params).result()
    assert {c.policy_version for c in groups[0]} == {ctl.policy_version}

    # The trainer moves on; until the generators pull, generate() refuses to serve the old weights.
    ctl.forward_backward(random_data(2), LossSpec("cross_entropy", num_loss_tokens=10)).result()
    ctl.optim_step(OptimParams(lr=1e-3)).result()
    with pytest.raises(ActorError, match="generator holds policy_version=.* call pull_weights first"):
        ctl.generate([tokenizer.encode("abc=")], params).result()
    ctl.sync_weights()
    assert ctl.generate([tokenizer.encode("abc=")], params).result()[0][0].policy_version == ctl.policy_version
    # Going back to an older version is refused.
    with pytest.raises(ActorError, match="refusing to go back"):
        ctl.generators.actor(0).pull_weights.call_one(ctl.policy_version - 1).get(timeout=60)


def test_generator_logprobs_match_trainer_on_sampled_completions(ctl, tokenizer):
    """The GRPO loss relies on this: the generator's sampled-token logprobs equal the trainer's."""
    from meshrl.types import Datum

    ctl.sync_weights()
    params = SamplingParams(max_tokens=6, temperature=0.8, n=4, seed=1)
    groups = ctl.generate([tokenizer.encode(s) for s in ("abc=", "hgfe=")], params).result()
    data = [Datum.from_completion(c.prompt_ids, c.token_ids, c.logprobs) for g in groups for c in g]
    got = ctl.forward(data, temperature=0.8).result()
    diffs = [
        abs(t - g)
        for d, lp in zip(data, got, strict=True)
        for t, g, m in zip(lp, d.old_logprobs, d.loss_mask, strict=True)
        if m
    ]
    assert len(diffs) >= 8 and max(diffs) < 1e-4


def test_overlong_prompt_is_a_clear_error(ctl):
    params = SamplingParams(max_tokens=8)
    with pytest.raises(ActorError, match="max_model_len"):
        ctl.generate([[4] * 45], params).result()
    assert torch.tensor(1)  # the generator still answers below
    assert len(ctl.generate([[4, 5, 12]], params).result()) == 1


def test_two_controllers_in_one_process_keep_their_own_weights(ctl, base_model_dir, tokenizer):
    """Each Controller has a torchstore of its own: another one pushing the same version numbers, then shutting
    down (which tears its store down), neither feeds nor breaks this one's generators."""
    from meshrl.config import GeneratorConfig, ModelConfig, TrainerConfig
    from meshrl.controller.api import Controller

    probe = random_data(4, seed=30)
    with Controller(
        model_dir=base_model_dir,
        model_cfg=ModelConfig(),
        trainer_cfg=TrainerConfig(num_procs=1, micro_batch_size=4),
        # The transformers engine (~10 CPU-s less to start than vLLM): the stores are the point, and `ctl`'s
        # generator, whose weights are checked, is vLLM.
        generator_cfg=GeneratorConfig(engine="transformers", max_model_len=48, max_tokens=8),
        tokenizer=tokenizer,
        reward_weights=None,
        call_timeout_s=120,
    ) as other:
        assert other.store_name != ctl.store_name
        other.load_checkpoint(base_model_dir)
        other.forward_backward(random_data(4, seed=31), LossSpec("cross_entropy", num_loss_tokens=30)).result()
        other.optim_step(OptimParams(lr=5e-2)).result()
        other.sync_weights()
    ctl.forward_backward(random_data(4, seed=32), LossSpec("cross_entropy", num_loss_tokens=30)).result()
    ctl.optim_step(OptimParams(lr=1e-2)).result()
    ctl.sync_weights()
    assert _max_diff(ctl.prompt_logprobs([d.tokens for d in probe]).result(), ctl.forward(probe).result()) < 1e-4
