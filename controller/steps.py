"""Building blocks shared by the controller programs: micro-batching, greedy evaluation, supervised warm-up."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import TypeVar

from meshrl.controller.api import Controller

from meshrl.schedule import lr_at
from meshrl.tasks import Example, Task
from meshrl.types import Datum, LossSpec, OptimParams, SamplingParams

T = TypeVar("T")


def micro_batches(items: Sequence[T], size: int) -> Iterator[list[T]]:
    for i in range(0, len(items), size):
        yield list(items[i : i + size])


def evaluate(ctl: Controller, task: Task, examples: list[Example], max_tokens: int) -> dict[str, float]:
    """Greedy exact-match accuracy (and mean reward) on held-out examples, through the Generator."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=[task.tokenizer.eos_id])
    completions = [group[0] for group in ctl.generate(task.prompt_ids(examples), params).result()]
    scored = ctl.score([c.token_ids for c in completions], [e.answer for e in examples]).result()
    exact = [s.text == e.answer for s, e in zip(scored, examples, strict=True)]
    return {
        "accuracy": sum(exact) / len(exact),
        "reward_mean": sum(s.reward for s in scored) / len(scored),
        "samples": [f"{e.prompt}{s.text}" for s, e in zip(scored[:5], examples[:5], strict=True)],
    }


def supervised_warmup(ctl: Controller, task: Task, cfg, *, micro_batch_size: int, optim, seed: int, log) -> None:
    """A short cross-entropy phase on the task's demonstrations, through the same forward_backward /
    optim_step endpoints as RL (the loss on response tokens only)."""
    from tqdm import tqdm

    rng = random.Random(seed)
    for step in tqdm(range(cfg.steps), desc="warm-up (SFT)", unit="step"):
        data = [Datum.from_completion(*task.demonstration_ids(e)) for e in rng.sample(task.train, cfg.batch_size)]
        loss = LossSpec("cross_entropy", num_loss_tokens=sum(d.num_loss_tokens for d in data))
        pending = [ctl.forward_backward(mb, loss) for mb in micro_batches(data, micro_batch_size)]
        nll = sum(p.result().loss for p in pending)
        lr = lr_at(step, peak_lr=cfg.lr, total_steps=cfg.steps, schedule="cosine", min_lr_ratio=0.1)
        opt = ctl.optim_step(OptimParams(lr=lr, betas=optim.betas, eps=optim.eps, grad_clip=optim.grad_clip)).result()
        log(
            {
                "phase": "warmup",
                "step": step,
                "loss": nll,
                "grad_norm": opt.grad_norm,
                "lr": lr,
                "policy_version": opt.policy_version,
            }
        )
