"""The colocated memory hand-off (controller/memory.py) on real processes: the generator (meshrl's transformers
engine, which can sleep on CPU too) frees its KV cache while the trainer trains and wakes for the next round with
the same outputs; every process's memory is recorded per phase."""

from __future__ import annotations

import pytest
from conftest import random_data

from meshrl.types import OptimParams, SamplingParams


@pytest.fixture(scope="module")
def colocated(base_model_dir, tokenizer):
    from meshrl.config import GeneratorConfig, ModelConfig, TrainerConfig
    from meshrl.controller.api import Controller

    c = Controller(
        model_dir=base_model_dir,
        model_cfg=ModelConfig(),
        trainer_cfg=TrainerConfig(num_procs=1, micro_batch_size=4),
        generator_cfg=GeneratorConfig(engine="transformers", max_model_len=48, max_tokens=8),
        tokenizer=tokenizer,
        call_timeout_s=120,
    )
    yield c
    c.shutdown()


def test_generator_sleeps_while_the_trainer_trains(colocated):
    from meshrl.controller.memory import MemoryHandoff
    from meshrl.controller.steps import train_step
    from meshrl.losses import make_loss_spec

    ctl = colocated
    handoff = MemoryHandoff(ctl, sleep_level=1)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    prompts = [[5, 6, 7], [8, 9]]
    before = [g[0].token_ids for g in ctl.generate(prompts, greedy).result()]

    awake = handoff.record("generate")
    assert awake["memory/generate/generator0_kv_cache_gib"] > 0
    assert {"memory/generate/trainer0_peak_gib", "memory/generate/generator0_rss_gib"} <= set(awake)
    handoff.to_trainer()
    asleep = ctl.generator_memory()[0]
    assert asleep["sleep_level"] == 1 and asleep["kv_cache_bytes"] == 0
    handoff.to_generator()
    assert ctl.generator_memory()[0]["sleep_level"] == 0
    assert [g[0].token_ids for g in ctl.generate(prompts, greedy).result()] == before  # same outputs after waking

    # A step trained while the generator sleeps; its weights reach the woken generator as usual.
    handoff.to_trainer()
    data = random_data(6, seed=21)
    train_step(ctl, data, make_loss_spec("grpo", data), 4, OptimParams(lr=1e-3))
    assert handoff.record("train")["memory/train/generator0_sleep_level"] == 1
    handoff.to_generator()
    ctl.sync_weights()
    assert ctl.generate(prompts, greedy).result()[0][0].policy_version == ctl.policy_version
