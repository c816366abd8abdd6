"""The colocated memory hand-off (controller/memory.py) on real processes: the generator (meshrl's transformers
engine, which can sleep on CPU too) frees its KV cache while the trainer trains and wakes for the next round with
the same outputs; every process's memory is recorded per phase."""

from __future__ import annotations

import pytest
from conftest import random_data
from markers import needs_cuda

from meshrl.types import OptimParams, SamplingParams


@pytest.fixture(scope="module")
def colocated(base_model_dir, tokenizer):
    from meshrl.config import GeneratorConfig, ModelConfig, TrainerConfig
    from meshrl.controller.api import Controller

    c = Controller(
        model_dir=base_model_dir,
        model_cfg=ModelConfig(),
        trainer_cfg=TrainerConfig(num_procs=1, micro_batch_size=4),
        # devices=[1]: the generator process is pinned to "GPU 1" (an environment variable; this CPU has none)
        generator_cfg=GeneratorConfig(engine="transformers", max_model_len=48, max_tokens=8, devices=[1]),
        tokenizer=tokenizer,
        call_timeout_s=120,
    )
    yield c
    c.shutdown()


def test_generator_sleeps_while_the_trainer_trains(colocated):
    from meshrl.controller.memory import MemoryHandoff
    from meshrl.controller.training import train_step
    from meshrl.losses import make_loss_spec

    ctl = colocated
    assert ctl.generator_info[0]["cuda_visible_devices"] == "1"  # meshrl.devices pinned the replica
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


@needs_cuda
def test_offloaded_optimizer_state_comes_back_exactly(tmp_path):
    """GPU: the AdamW state leaves the device between steps (its memory is freed) and the run trains bitwise as if
    it had stayed; the trainer's cached blocks are returned on request."""
    import torch
    import torch.distributed as dist

    from meshrl.losses import make_loss_spec
    from meshrl.models.tiny_hf import create_tiny_checkpoint
    from meshrl.policy import Policy
    from meshrl.tokenizer import default_corpus, train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(default_corpus(200), 300)
    model_dir = str(create_tiny_checkpoint(tmp_path / "m", arch="qwen3", tokenizer=tokenizer))

    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    data = random_data(6, seed=3)
    spec = make_loss_spec("grpo", data)
    weights = []
    for offload in (False, True):
        p = Policy.from_options(model_dir, device="cuda", backend="hf")
        for _ in range(3):
            p.forward_backward(data, spec, OptimParams(lr=1e-3))
            if offload:
                held = torch.cuda.memory_allocated()
                moved = p.offload_optimizer_state()
                assert moved > 0 and torch.cuda.memory_allocated() <= held - moved // 2
                assert p.release_cached_memory() >= 0
        weights.append({k: v.clone() for k, v in p.hf_state_dict().items()})
        del p
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
