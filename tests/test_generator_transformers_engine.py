"""The Generator actor with engine='transformers' (meshrl's own engine, no vLLM): same contract as the vLLM one.
It runs beside the session's controller and pulls the trainer's weights from the same torchstore."""

from __future__ import annotations

import pytest
import torch
from conftest import random_data
from monarch.actor import this_host

from meshrl.config import GeneratorConfig
from meshrl.types import Datum, LossSpec, OptimParams, SamplingParams

TIMEOUT = 120


@pytest.fixture(scope="module")
def hf_generator(ctl, base_model_dir):
    from meshrl.actors.generator import Generator

    procs = this_host().spawn_procs(per_host={"procs": 1})
    cfg = GeneratorConfig(engine="transformers", max_model_len=48, max_tokens=8, max_num_seqs=16)
    gen = procs.spawn("hf_generator", Generator, base_model_dir, cfg, 0)
    info = gen.setup.call_one().get(timeout=TIMEOUT)
    assert info["engine"] == "transformers"
    yield gen
    procs.stop().get(timeout=60)


def _max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def test_pulled_weights_match_the_trainer_and_sampled_logprobs_agree(ctl, hf_generator, base_model_dir, tokenizer):
    ctl.load_checkpoint(base_model_dir)
    data = random_data(4, seed=30)
    ctl.forward_backward(data, LossSpec("cross_entropy", num_loss_tokens=sum(d.num_loss_tokens for d in data))).result()
    ctl.optim_step(OptimParams(lr=5e-2)).result()
    ctl.sync_weights()  # pushes this version to the store (the vLLM generator pulls it too)
    probe = random_data(4, seed=31)
    seqs = [d.tokens for d in probe]
    trainer = ctl.forward(probe).result()
    stale = hf_generator.prompt_logprobs.call_one(seqs).get(timeout=TIMEOUT)
    assert _max_diff(stale, trainer) > 1e-3  # still the base weights: the check below is not vacuous
    pulled = hf_generator.pull_weights.call_one(ctl.policy_version, ctl.store_name).get(timeout=TIMEOUT)
    assert pulled == ctl.policy_version
    assert _max_diff(hf_generator.prompt_logprobs.call_one(seqs).get(timeout=TIMEOUT), trainer) < 1e-4

    # Sampled completions: token ids + per-token logprobs that the trainer reproduces (what GRPO relies on).
    params = SamplingParams(max_tokens=6, temperature=0.8, n=3, seed=2, stop_token_ids=[tokenizer.eos_id])
    groups = hf_generator.generate.call_one([tokenizer.encode("abc="), tokenizer.encode("hgf=")], params, None)
    groups = groups.get(timeout=TIMEOUT)
    assert [len(g) for g in groups] == [3, 3]
    assert {c.policy_version for g in groups for c in g} == {ctl.policy_version}
    completions = [c for g in groups for c in g]
    data = [Datum.from_completion(c.prompt_ids, c.token_ids, c.logprobs) for c in completions]
    got = ctl.forward(data, temperature=0.8).result()
    diffs = [
        abs(t - o)
        for d, lp in zip(data, got, strict=True)
        for t, o, m in zip(lp, d.old_logprobs, d.loss_mask, strict=True)
        if m
    ]
    assert len(diffs) >= 6 and max(diffs) < 1e-4
    assert all(c.finish_reason in ("stop", "length") for c in completions)
    ctl.load_checkpoint(base_model_dir)


def test_greedy_generation_equals_the_vllm_generator(ctl, hf_generator, tokenizer):
    ctl.sync_weights()
    hf_generator.pull_weights.call_one(ctl.policy_version, ctl.store_name).get(timeout=TIMEOUT)
    prompts = [tokenizer.encode(s) for s in ("abc=", "hgfed=", "ab=")]
    params = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[tokenizer.eos_id])
    ours = hf_generator.generate.call_one(prompts, params, ctl.policy_version).get(timeout=TIMEOUT)
    vllm = ctl.generate(prompts, params).result()
    assert [g[0].token_ids for g in ours] == [g[0].token_ids for g in vllm]
    for a, b in zip(ours, vllm, strict=True):
        torch.testing.assert_close(torch.tensor(a[0].logprobs), torch.tensor(b[0].logprobs), rtol=1e-4, atol=1e-4)


def test_bad_engine_name_fails_at_launch():
    from meshrl.config import ConfigError

    with pytest.raises(ConfigError, match="generator.engine='sglang'"):
        GeneratorConfig(engine="sglang")
