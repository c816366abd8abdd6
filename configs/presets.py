"""Presets are plain Python functions; copy one and change what you need."""

from __future__ import annotations

from meshrl.config import (
    GeneratorConfig,
    GRPOConfig,
    GRPORunConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    SFTConfig,
    SFTRunConfig,
    TaskConfig,
    TrainerConfig,
    WarmupConfig,
)


def tiny_reverse() -> GRPORunConfig:
    """The built-in main job: a tiny Qwen3 learns to reverse strings on a 2-core CPU, in minutes.
    A short supervised warm-up gets the random model producing answers of the right shape; GRPO then
    raises the reward and the held-out exact match."""
    return GRPORunConfig(
        model=ModelConfig(flavor="tiny", dtype="float32"),
        trainer=TrainerConfig(num_procs=2, micro_batch_size=64),
        # lr 3e-4: at 1e-3 the sampled reward fell over 40 steps (Adam turns the noisy policy gradient of this
        # 300k-parameter model into full-size steps); at 3e-4 it rises, slowly (bench/NOTES.md, "main job").
        optim=OptimConfig(lr=3e-4, schedule="constant", grad_clip=1.0),
        generator=GeneratorConfig(num_replicas=1, max_model_len=32, max_tokens=8, temperature=1.0),
        grpo=GRPOConfig(steps=120, prompts_per_step=16, group_size=8),
        warmup=WarmupConfig(steps=60, batch_size=64, lr=3e-3),
        task=TaskConfig(name="reverse", min_len=2, max_len=5, alphabet="abcdefgh"),
    )


def tiny_reverse_sft() -> SFTRunConfig:
    """SFT of the tiny Qwen3 on the reversal task's demonstrations (the warm start before GRPO)."""
    return SFTRunConfig(
        model=ModelConfig(flavor="tiny", dtype="float32"),
        trainer=TrainerConfig(num_procs=2, micro_batch_size=64),
        optim=OptimConfig(lr=3e-3, schedule="cosine", warmup_steps=10),
        generator=GeneratorConfig(num_replicas=1, max_model_len=32, max_tokens=8),
        sft=SFTConfig(max_steps=300, batch_size=64, eval_every=100),
        task=TaskConfig(name="reverse", min_len=2, max_len=5, alphabet="abcdefgh"),
        run=RunConfig(save_every=100),
    )


PRESETS = {"tiny-reverse": tiny_reverse}
SFT_PRESETS = {"tiny-reverse-sft": tiny_reverse_sft}
