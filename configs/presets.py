"""Presets are plain Python functions; copy one and change what you need."""

from __future__ import annotations

from meshrl.config import (
    EvalConfig,
    EvalRunConfig,
    GeneratorConfig,
    GRPOConfig,
    GRPORunConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    SFTConfig,
    SFTRunConfig,
    TrainerConfig,
    WarmupConfig,
)
from meshrl.envs import EnvConfig
from meshrl.tasks.arithmetic import ArithmeticConfig
from meshrl.tasks.reverse import ReverseTaskConfig
from meshrl.tasks.shapes import ShapesConfig


def reverse_task() -> ReverseTaskConfig:
    """Strings of 2-4 letters from 10: the held-out prompts (never in the training set) are mostly 4 letters
    long, like most of the training prompts, so held-out accuracy measures the rule and not memorisation.
    Reward (the task's default): half per-position credit (dense), half exact match (what held-out accuracy
    counts)."""
    return ReverseTaskConfig(min_len=2, max_len=4, alphabet="abcdefghij", num_eval=200)


def tiny_reverse() -> GRPORunConfig:
    """The built-in main job: a tiny Qwen3 learns to reverse strings on a 2-core CPU, in minutes.
    A short supervised warm-up gets the random model producing answers of the right shape and length; GRPO
    then raises the reward and the held-out exact match (bench/RL_NOTES.md has the measurements behind
    these numbers)."""
    return GRPORunConfig(
        model=ModelConfig(flavor="tiny", dtype="float32"),
        trainer=TrainerConfig(num_procs=2, micro_batch_size=64),
        # 64 prompts x 8 samples per step: with 16 prompts the policy gradient of this 300k-parameter model
        # is so noisy that Adam's steps mostly random-walk (reward +0.1 in 120 steps, held-out accuracy down);
        # with 64 it climbs steadily and held-out accuracy rises with it.
        optim=OptimConfig(lr=1e-3, schedule="constant", grad_clip=1.0),
        # The CPU processes share one host: hand weights over through a shared-memory buffer, not torchstore.
        generator=GeneratorConfig(num_replicas=1, max_model_len=32, max_tokens=8, temperature=1.0, weight_sync="shm"),
        grpo=GRPOConfig(steps=200, prompts_per_step=64, group_size=8),
        warmup=WarmupConfig(steps=40, batch_size=64, lr=3e-3),
        reverse=reverse_task(),
    )


def tiny_reverse_sft() -> SFTRunConfig:
    """SFT of the tiny Qwen3 on the reversal task's demonstrations (the warm start before GRPO)."""
    return SFTRunConfig(
        model=ModelConfig(flavor="tiny", dtype="float32"),
        trainer=TrainerConfig(num_procs=2, micro_batch_size=64),
        optim=OptimConfig(lr=3e-3, schedule="cosine", warmup_steps=10),
        generator=GeneratorConfig(num_replicas=1, max_model_len=32, max_tokens=8),
        sft=SFTConfig(max_steps=300, batch_size=64, eval_every=100),
        reverse=reverse_task(),
        run=RunConfig(save_every=100),
    )


def tiny_math() -> GRPORunConfig:
    """A real pipeline on a 2-core CPU: tiny Qwen3 + BPE tokenizer + ChatML template made in code, SFT then GRPO on
    arithmetic with the math_verify reward; held-out greedy accuracy, mean@8 and pass@8 every 50 RL steps.

    The program trains a byte-level BPE tokenizer on the task's rows (digits split one per token), makes a new
    random Qwen3 'tiny' model with it, renders every question through the chat template ('What is 23 + 58?' as one
    user turn), warms up on demonstrations ('\\boxed{81}') and runs GRPO on math-verify's verdict. The recipe and
    the sweep behind it: bench/MATH_NOTES.md."""
    return GRPORunConfig(
        task="arithmetic",
        model=ModelConfig(flavor="tiny", dtype="float32", bpe_vocab_size=512),
        trainer=TrainerConfig(num_procs=2, micro_batch_size=64),
        optim=OptimConfig(lr=5e-4, schedule="constant", grad_clip=1.0),
        generator=GeneratorConfig(num_replicas=1, max_model_len=40, max_tokens=8, temperature=1.0, weight_sync="shm"),
        grpo=GRPOConfig(steps=300, prompts_per_step=64, group_size=8),
        # A warm-up that leaves room to climb: greedy accuracy ~0.2 when RL starts (longer SFT saturates the task).
        warmup=WarmupConfig(steps=900, batch_size=64, lr=3e-3),
        arithmetic=ArithmeticConfig(num_train=14000, num_eval=500, operations="+-", max_value=99),
        eval=EvalConfig(every=50, samples=8),
    )


def tiny_calculator() -> GRPORunConfig:
    """Multi-turn tool use on a 2-core CPU: a tiny Qwen3 learns when to call a calculator (<tool>17*23</tool>), to
    read its result and to answer; SFT on demonstrations of which half use the tool, then GRPO on the environment.

    Every sample is an episode of up to 3 turns, trained as one sequence with the loss on the model's tokens only.
    Half the warm-up demonstrations answer at once (mental arithmetic a tiny model mostly gets wrong), half call the
    tool: RL has a choice to learn. Held-out greedy accuracy, correct tool calls, mean@8 / pass@8 and the sampled
    tool-call rate every 50 RL steps."""
    return GRPORunConfig(
        env=EnvConfig(name="calculator", max_turns=3, num_train=2000, num_eval=200, kwargs='{"demo_tool_rate": 0.5}'),
        model=ModelConfig(flavor="tiny", dtype="float32", bpe_vocab_size=512),
        trainer=TrainerConfig(num_procs=2, micro_batch_size=64),
        optim=OptimConfig(lr=3e-4, schedule="constant", grad_clip=1.0),
        generator=GeneratorConfig(num_replicas=1, max_model_len=128, max_tokens=16, temperature=1.0, weight_sync="shm"),
        grpo=GRPOConfig(steps=150, prompts_per_step=16, group_size=8),
        warmup=WarmupConfig(steps=300, batch_size=64, lr=3e-3),
        eval=EvalConfig(every=50, samples=8),
    )


def tiny_vision() -> GRPORunConfig:
    """Vision-language RL on a 2-core CPU: a tiny Qwen2.5-VL made in code (vision tower, BPE tokenizer with the
    Qwen-VL special tokens, its chat template and image processor) answers questions about pictures drawn in code
    (--task shapes: 'How many shapes are there?', 'What colour is the shape?'), scored by exact match; SFT on the
    answers, then GRPO. Generation runs on meshrl's transformers engine (vLLM's vision-language models need
    torchvision, which this CPU build of torch cannot load); on a GPU machine with torchvision, --generator.engine
    vllm. Held-out greedy accuracy every 50 RL steps; about 4.5 minutes (figures in docs/vision.md)."""
    return GRPORunConfig(
        task="shapes",
        shapes=ShapesConfig(num_train=4000, num_eval=200),
        model=ModelConfig(flavor="tiny-qwen2.5-vl", backend="hf", dtype="float32", bpe_vocab_size=384),
        trainer=TrainerConfig(num_procs=1, micro_batch_size=64),
        optim=OptimConfig(lr=3e-4, schedule="constant", grad_clip=1.0),
        generator=GeneratorConfig(
            engine="transformers", num_replicas=1, max_model_len=96, max_tokens=4, temperature=1.0, weight_sync="shm"
        ),  # fmt: skip
        grpo=GRPOConfig(steps=300, prompts_per_step=16, group_size=8),
        # A short warm-up that leaves RL room (500 steps reach 0.925 greedy, after which RL added nothing measured).
        warmup=WarmupConfig(steps=150, batch_size=32, lr=3e-3),
        eval=EvalConfig(every=50, samples=0),
    )


def gpu_math() -> GRPORunConfig:
    """For a GPU machine: a ~63M-parameter Qwen3 made in code (--model.flavor small) with a BPE tokenizer and ChatML
    template learns two-digit addition and subtraction ('What is 82 - 17?' -> '\\boxed{65}'): SFT on
    demonstrations, then GRPO on math-verify's verdict; held-out greedy accuracy before RL and every 20 RL steps.

    The GPU settings are left to the GPU defaults (docs/gpu.md): cuda, bf16 compute with float32 master weights,
    the hf backend unless torchtitan imports, vLLM when it imports, every GPU in the measured layout. Measured on one
    H100 (CUDA_VISIBLE_DEVICES=0, bench/NOTES.md 'gpu-math'): held-out greedy accuracy 0.000 -> 1.000 by the end of
    the warm-up (131 s), 0.998 after RL: the SFT teaches the task and RL holds it (it has little left to add here).
    On a CPU it runs too, slowly."""
    return GRPORunConfig(
        task="arithmetic",
        model=ModelConfig(flavor="small", bpe_vocab_size=512),
        # Whole warm-up batches in one call: sequences of <= 40 tokens on a 63M model are far inside the token budget,
        # and each call costs fixed host work (one H100: 0.48 s a warm-up step in 4 calls of 32, 0.16 s in one of 256).
        # Numerics unchanged (the same update to float rounding).
        trainer=TrainerConfig(micro_batch_size=256),
        optim=OptimConfig(lr=1e-4, schedule="constant", grad_clip=1.0),
        generator=GeneratorConfig(max_model_len=64, max_tokens=12, temperature=1.0),
        grpo=GRPOConfig(steps=40, prompts_per_step=64, group_size=8),
        # Measured on one H100: 128 demonstrations a step for 300 steps left greedy accuracy at 0.08 (600 steps on
        # three-digit operands: 0.02); 256 a step for 800 steps reached 1.000.
        warmup=WarmupConfig(steps=800, batch_size=256, lr=1e-3),
        arithmetic=ArithmeticConfig(num_train=14000, num_eval=500, operations="+-", max_value=99),
        eval=EvalConfig(every=20, samples=8),
    )


def default() -> GRPORunConfig:
    """The config dataclasses' own defaults: for your own model, task and flags (python -m meshrl.controller.grpo)."""
    return GRPORunConfig()


def default_sft() -> SFTRunConfig:
    """The config dataclasses' own defaults."""
    return SFTRunConfig()


PRESETS = {"default": default, "tiny-reverse": tiny_reverse, "tiny-math": tiny_math, "tiny-calculator": tiny_calculator,
           "tiny-vision": tiny_vision, "gpu-math": gpu_math}  # fmt: skip
SFT_PRESETS = {"default": default_sft, "tiny-reverse-sft": tiny_reverse_sft}


def default_eval() -> EvalRunConfig:
    """The config dataclasses' own defaults (name the checkpoint with --model.path)."""
    return EvalRunConfig()


EVAL_PRESETS = {"default": default_eval}


def presets_for(cls: type) -> dict:
    """The presets of a program's root config class."""
    by_class = {GRPORunConfig: PRESETS, SFTRunConfig: SFT_PRESETS, EvalRunConfig: EVAL_PRESETS}
    if cls not in by_class:
        raise ValueError(f"no presets for {cls.__name__}; pass presets=")
    return by_class[cls]
