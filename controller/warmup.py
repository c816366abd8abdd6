"""The supervised warm-up before RL: a short cross-entropy phase on the task's reference answers."""

from __future__ import annotations

import random

from meshrl.controller.api import Controller
from meshrl.controller.training import train_step
from meshrl.errors import ConfigError
from meshrl.schedule import optim_params
from meshrl.tasks.setup import TaskSetup
from meshrl.types import Datum, LossSpec


def task_demonstrations(setup: TaskSetup, cfg, max_len: int) -> list[Datum]:
    """The task's reference answers as cross-entropy sequences (those that fit in `max_len` tokens with their
    prompt), checked to fill a warm-up batch (`cfg`: the WarmupConfig). Cheap: no process is needed, so the programs
    call it before they start any (a batch the rows cannot fill is refused then, not after the processes are up)."""
    keep, pairs = setup.demonstrations(max_len)
    images = setup.train.images_of(keep)
    demos = [Datum.from_completion(*pair) for pair in pairs]
    if images:  # a vision-language task: the prompts carry their images
        for d, own in zip(demos, images, strict=True):
            d.images = own or None
    check_demonstration_count(len(demos), cfg, max_len)
    return demos


def check_demonstration_count(count: int, cfg, max_len: int) -> None:
    if count < cfg.batch_size:
        raise ConfigError(
            f"warmup.batch_size={cfg.batch_size}, but only {count} training rows have a reference answer that "
            f"fits in {max_len} tokens with its prompt; lower --warmup.batch-size (or --warmup.steps 0)"
        )


def supervised_warmup(
    ctl: Controller,
    setup: TaskSetup,
    cfg,
    *,
    micro_batch_size: int,
    optim,
    seed: int,
    max_len: int,
    log,
    demos: list[Datum] | None = None,
) -> None:
    """A short cross-entropy phase on the task's reference answers, rendered like the RL prompts (a completion
    the generator would sample), through the same forward_backward / optim_step endpoints as RL (the loss on
    response tokens only)."""
    from meshrl.progress import progress

    if demos is None:  # `demos`: given by a multi-turn run (whole demonstrated episodes)
        demos = task_demonstrations(setup, cfg, max_len)
    check_demonstration_count(len(demos), cfg, max_len)
    rng = random.Random(seed)
    for step in progress(range(cfg.steps), desc="warm-up (SFT)", total=cfg.steps):
        data = [demos[i] for i in rng.sample(range(len(demos)), cfg.batch_size)]
        loss = LossSpec("cross_entropy", num_loss_tokens=sum(d.num_loss_tokens for d in data))
        # Its own peak and schedule (cosine to 10 %, no LR warm-up); --optim's betas, eps, clip and weight decay
        # (the warm-up used to drop the weight decay: issue 30).
        params = optim_params(
            optim, step, cfg.steps, peak_lr=cfg.lr, schedule="cosine", warmup_steps=0, min_lr_ratio=0.1
        )  # fmt: skip
        results, opt, _ = train_step(ctl, data, loss, micro_batch_size, params)
        nll = sum(r.loss for r in results)
        log(
            {
                "phase": "warmup",
                "step": step,
                "loss": nll,
                "grad_norm": opt.grad_norm,
                "lr": params.lr,
                "policy_version": opt.policy_version,
            }
        )
