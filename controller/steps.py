"""Building blocks shared by the controller programs: micro-batching, greedy evaluation, supervised warm-up,
resumable run checkpoints, RL sampling (with DAPO's dynamic sampling) and reference-model logprobs."""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from meshrl.algorithms import informative_groups, overlong_penalty
from meshrl.batching import rank_sizes
from meshrl.checkpoint import (
    TRAINER_DIR,
    CheckpointManager,
    config_changes,
    read_controller_state,
    resolve_resume,
    resume_command,
)
from meshrl.config import EvalConfig
from meshrl.controller.api import ActorDiedError, Controller
from meshrl.controller.replicas import ActorFrozenError
from meshrl.data.sampler import EpochSampler
from meshrl.errors import ConfigError
from meshrl.rewards import ScoredSample
from meshrl.run_dir import RunDir
from meshrl.schedule import lr_at
from meshrl.tasks.setup import TaskSetup
from meshrl.types import Completion, Datum, ForwardBackwardResult, LossSpec, OptimParams, OptimResult, SamplingParams

T = TypeVar("T")


def micro_batches(items: Sequence[T], size: int) -> Iterator[list[T]]:
    for i in range(0, len(items), size):
        yield list(items[i : i + size])


def train_step(
    ctl: Controller, data: list[Datum], loss: LossSpec, micro_batch_size: int, params: OptimParams
) -> tuple[list[ForwardBackwardResult], OptimResult, list[list[float]]]:
    """One optimiser step: the sequences binned by length into `forward_backward` calls under the trainer's token
    budget (and at most `micro_batch_size` per call), balanced over the ranks (meshrl.batching); the gradients
    accumulate and the last call carries the step, all sent before any result is read. The trainer goes from the
    last backward straight to the update; `num_micro_batches` makes it refuse a batch in which a call failed (that
    call raises its own error here). Returns the calls' results, the step's, and the trainer's logprobs per datum
    in `data`'s order."""
    plan = ctl.micro_batch_plan([len(d.tokens) for d in data], micro_batch_size)
    params = dataclasses.replace(params, num_micro_batches=len(plan))
    last = len(plan) - 1
    pending = [
        ctl.forward_backward(
            [data[i] for part in call for i in part], loss, step=params if c == last else None, split=rank_sizes(call)
        )
        for c, call in enumerate(plan)
    ]
    results = [p.result() for p in pending]
    logprobs: list[list[float]] = [[] for _ in data]
    for call, result in zip(plan, results, strict=True):
        for i, row in zip((i for part in call for i in part), result.logprobs, strict=True):
            logprobs[i] = row
    return results, results[-1].optim, logprobs


def evaluate(
    ctl: Controller,
    setup: TaskSetup,
    cfg: EvalConfig,
    *,
    max_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = -1,
) -> dict[str, Any]:
    """Held-out evaluation through the Generator and the reward processes: greedy accuracy and mean reward; with
    `cfg.samples` = k > 0 also mean@k and pass@k (unbiased) over k samples per prompt at the training temperature.
    Correct means `setup.verifier` gives >= 1. Sampling seeds come from `cfg.seed`, not the run's RNG, so evaluating
    never changes what a run trains on."""
    from meshrl.evaluation import summarize

    prompts, views, stop = setup.eval.prompt_ids, setup.eval.views, setup.renderer.stop_token_ids
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=stop)
    sampled = None
    if cfg.samples:
        sampled = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, n=cfg.samples,
            stop_token_ids=stop, seed=cfg.seed,
        )  # fmt: skip
    pending_greedy = ctl.generate(prompts, greedy)
    pending_sampled = ctl.generate(prompts, sampled) if sampled else None
    texts = setup.renderer.completion_texts([group[0].token_ids for group in pending_greedy.result()])
    scored = ctl.score(texts, views).result()
    correct = [is_correct(s, setup.verifier) for s in scored]
    record: dict[str, Any] = {
        "accuracy": sum(correct) / len(correct),
        "reward_mean": sum(s.reward for s in scored) / len(scored),
        "reward_failures": sum(bool(s.failures) for s in scored),
        "samples": [
            f"{_prompt_text(row.prompt)}{text}" for row, text in zip(setup.eval.rows[:5], texts[:5], strict=False)
        ],
    }
    if pending_sampled is not None:
        k = cfg.samples
        groups = pending_sampled.result()
        texts_k = setup.renderer.completion_texts([c.token_ids for group in groups for c in group])
        scored_k = ctl.score(texts_k, views, group_size=k).result()
        correct_k = [[is_correct(s, setup.verifier) for s in scored_k[i * k : (i + 1) * k]] for i in range(len(views))]
        record.update(summarize(correct_k, cfg.ks))
        record["reward_failures"] += sum(bool(s.failures) for s in scored_k)
    return record


def is_correct(scored: ScoredSample, verifier: str) -> bool:
    return scored.parts.get(verifier, 0.0) >= 1.0 - 1e-9 and verifier not in scored.failures


def _prompt_text(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else str(prompt[-1].get("content", "")) + " -> "


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
    from tqdm import tqdm

    if demos is None:  # `demos`: given by a multi-turn run (whole demonstrated episodes)
        demos = [Datum.from_completion(*pair) for pair in setup.demonstrations(max_len)[1]]
    if len(demos) < cfg.batch_size:
        raise ConfigError(
            f"warmup.batch_size={cfg.batch_size}, but only {len(demos)} training rows have a reference answer that "
            f"fits in {max_len} tokens with its prompt; lower --warmup.batch-size (or --warmup.steps 0)"
        )
    rng = random.Random(seed)
    for step in tqdm(range(cfg.steps), desc="warm-up (SFT)", unit="step"):
        data = [demos[i] for i in rng.sample(range(len(demos)), cfg.batch_size)]
        loss = LossSpec("cross_entropy", num_loss_tokens=sum(d.num_loss_tokens for d in data))
        lr = lr_at(step, peak_lr=cfg.lr, total_steps=cfg.steps, schedule="cosine", min_lr_ratio=0.1)
        params = OptimParams(lr=lr, betas=optim.betas, eps=optim.eps, grad_clip=optim.grad_clip)
        results, opt, _ = train_step(ctl, data, loss, micro_batch_size, params)
        nll = sum(r.loss for r in results)
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


def pad_rows(data: list[Datum], multiple: int, pad_id: int) -> list[Datum]:
    """Append loss-free 2-token rows so the row count splits evenly over the trainer ranks."""
    return data + [Datum([pad_id, pad_id], [0.0]) for _ in range((-len(data)) % multiple)]


def forward_all(ctl: Controller, data: list[Datum], micro_batch_size: int, dp: int) -> list[list[float]]:
    """Trainer logprobs of any number of sequences: micro-batches whose size the DP ranks can split (the last
    one padded with copies whose results are dropped), all queued at once."""
    pending = []
    for mb in micro_batches(data, micro_batch_size):
        pad = (-len(mb)) % dp
        pending.append((len(mb), ctl.forward(mb + [mb[-1]] * pad)))
    return [row for n, p in pending for row in p.result()[:n]]


def eval_nll(ctl: Controller, data: list[Datum], micro_batch_size: int, dp: int) -> float:
    """Mean negative log-likelihood per loss token (no gradient)."""
    rows = forward_all(ctl, data, micro_batch_size, dp)
    total = sum(float(-np.dot(row, d.loss_mask)) for d, row in zip(data, rows, strict=True))
    return total / sum(d.num_loss_tokens for d in data)


class RunFailedError(RuntimeError):
    """The run cannot continue; the message names the last good checkpoint and the command to resume."""


class RunCheckpoints:
    """A program's resumable checkpoints (shared by `sft` and `grpo`): restore on `--run.resume`, save every
    `run.save_every` steps, at `run.stop_at_step` and at the end, and turn any failure into a message that names
    the last good checkpoint and the command resuming from it.

    A checkpoint (meshrl.checkpoint) holds the trainer's model + optimiser (DCP, every rank), and the
    controller's state: the program's own (data cursor, RNG, ...) plus the step, policy version, the number of
    metrics lines written so far (a resumed run drops later ones and appends) and the config."""

    def __init__(self, program: str, run: RunDir, cfg: Any) -> None:
        self.program, self.run, self.cfg = program, run, cfg
        self.manager = CheckpointManager(run.path, cfg.run.keep_last_n)
        # Started as `python -m meshrl.controller.<program> FLAGS`: the resume command repeats FLAGS.
        self.flags = sys.argv[1:] if Path(sys.argv[0]).stem == program else None
        # Found and verified (every byte against its manifest) now, before any process starts: a run without a
        # valid checkpoint to resume fails here, and a damaged newest one is skipped for the newest valid one.
        try:
            self.resume_from = resolve_resume(cfg.run.resume, run.path) if cfg.run.resume else None
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from e

    def restore(self, ctl: Controller) -> dict[str, Any] | None:
        """Load the checkpoint named by `run.resume` into the trainer; its controller state (None: a fresh run)."""
        if self.resume_from is None:
            return None
        ckpt = self.resume_from
        state = read_controller_state(ckpt)
        ctl.load_checkpoint(str(ckpt / TRAINER_DIR))
        self.run.truncate_metrics(state["metrics_lines"])
        changed = config_changes(state.get("config", {}), _as_json(self.cfg))
        if changed:
            print(f"[meshrl] note: resuming with a config that differs from the checkpoint's: {'; '.join(changed)}")
        print(f"[meshrl] resumed from {ckpt} at step {state['step']} (policy version {ctl.policy_version})")
        return state

    def save(self, ctl: Controller, step: int, state: dict[str, Any]) -> str:
        """Trainer state + controller state, committed atomically as checkpoints/step_<step>."""
        tmp = self.manager.begin(step)
        ctl.save_checkpoint(str(tmp / TRAINER_DIR))
        full = {
            **state,
            "step": step,
            "policy_version": ctl.policy_version,
            "metrics_lines": self.run.num_metric_lines(),
            "config": _as_json(self.cfg),
        }
        return str(self.manager.commit(tmp, step, full))

    def after_step(self, ctl: Controller, done: int, total: int, state: Callable[[], dict[str, Any]]) -> str | None:
        """Call after step `done` (1-based) of `total`: saves when `run.save_every` says so. At `run.stop_at_step`
        it saves and returns the checkpoint: the caller stops there, as a preempted job would."""
        stop = self.cfg.run.stop_at_step == done and done < total
        every = self.cfg.run.save_every
        if not (stop or (every and done % every == 0 and done < total)):
            return None
        path = self.save(ctl, done, state())
        if not stop:
            return None
        print(f"[meshrl] stopped at step {done} (run.stop_at_step); checkpoint {path}")
        print(f"  resume with: {resume_command(self.program, Path(path), self.flags)}")
        return path

    @contextmanager
    def starting(self) -> Iterator[None]:
        """Around starting the run's processes (building the Controller): a process or host lost then ends the run
        as a later failure does, with the resume hint and no traceback. Other errors (a ConfigError) pass as
        they are."""
        try:
            yield
        except (ActorDiedError, ActorFrozenError):
            with self.resume_hint_on_failure():
                raise

    @contextmanager
    def resume_hint_on_failure(self) -> Iterator[None]:
        """Any failure inside ends the run with RunFailedError naming the last good checkpoint. On the way out,
        however it goes, the run directory's lock is released (a resume may start now)."""
        try:
            yield
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM through cli.stop_on_sigterm: stop, but say how to go on
            latest = self.manager.latest()
            print(
                f"[meshrl] interrupted; last good checkpoint: {latest or 'none yet'}\n"
                f"  resume with: {resume_command(self.program, latest, self.flags)}",
                file=sys.stderr,
                flush=True,
            )
            raise
        except Exception as e:  # noqa: BLE001 - every failure ends with the resume hint
            latest = self.manager.latest()
            kind = type(e).__name__
            if isinstance(e, ActorDiedError):
                kind = "an actor process died"
            elif isinstance(e, ActorFrozenError):
                kind = "an actor process stopped answering"
            raise RunFailedError(
                f"run failed ({kind}): {e}\n"
                f"  last good checkpoint: {latest or 'none yet'}\n"
                f"  resume with: {resume_command(self.program, latest, self.flags)}"
            ) from e
        finally:
            self.run.close()


def _as_json(cfg: Any) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


@dataclass
class SampledGroups:
    """What one RL step trains on, group by group (`group_size` completions per prompt)."""

    rows: list[int]  # indices into the training prompts of the groups kept
    drawn: list[int]  # indices of every prompt drawn this step, in order (kept or dropped)
    completions: list[Completion]
    rewards: list[float]  # per completion: task reward + overlong shaping (what advantages are computed from)
    task_rewards: list[float]  # the task reward of EVERY completion generated this step (kept or dropped)
    correct: list[bool]  # the verifier's verdict on every completion generated this step
    reward_failures: dict[str, int]  # "name: timeout" / "name: error" -> samples (scored 0 for that function)
    reward_parts: dict[str, list[float]]  # each reward function's raw value on every completion generated
    prompts_drawn: int
    rounds: int
    groups_dropped: int
    time_generate_s: float
    time_score_s: float
    # Multi-turn runs (controller/episodes.py): the kept episodes in place of `completions`, and their metrics.
    episodes: list[Any] = field(default_factory=list)  # meshrl.envs.rollout.Episode
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.completions or self.episodes)

    def datums(self) -> list[Datum]:
        """One training sequence per completion (loss on it) or per episode (loss on the model's turns)."""
        if self.episodes:
            return [e.tokens.datum() for e in self.episodes]
        return [Datum.from_completion(c.prompt_ids, c.token_ids, c.logprobs) for c in self.completions]

    def lengths(self) -> list[int]:
        """Model tokens per completion / episode."""
        if self.episodes:
            return [e.tokens.num_model_tokens for e in self.episodes]
        return [len(c.token_ids) for c in self.completions]

    def turn_rewards(self) -> list[list[float]] | None:
        return [list(e.outcome.turn_rewards) for e in self.episodes] if self.episodes else None

    @classmethod
    def start(cls) -> SampledGroups:
        return cls([], [], [], [], [], [], Counter(), {}, 0, 0, 0, 0.0, 0.0)

    def add_round(
        self, picks: list[int], samples: list[Any], rewards: list[float], into: list[Any], cfg, want: int
    ) -> None:
        """One sampling round's groups (`samples`: completions or episodes, `group_size` per pick): those DAPO's
        dynamic sampling keeps (every group without it), up to `want` groups in all, go `into` the batch; the
        round is counted either way."""
        g = cfg.group_size
        keep = informative_groups(rewards, g) if cfg.dynamic_sampling else list(range(len(picks)))
        keep = keep[: want - len(self.rows)]
        for i in keep:
            self.rows.append(picks[i])
            into += samples[i * g : (i + 1) * g]
            self.rewards += rewards[i * g : (i + 1) * g]
        self.drawn += picks
        self.prompts_drawn += len(picks)
        self.rounds += 1
        self.groups_dropped += len(picks) - len(keep)

    def trim(self, dp: int, group_size: int) -> None:
        """Drop whole groups from the end until the batch splits evenly over the `dp` trainer ranks."""
        samples = self.episodes or self.completions
        while len(samples) % dp:
            self.rows.pop()
            del samples[-group_size:], self.rewards[-group_size:]


@dataclass
class LaunchedRound:
    """One round of generation sent to the generators: the prompts drawn, its seed, and the completions (a
    `Pending` until they arrive; plain groups once restored from a checkpoint)."""

    picks: list[int]
    seed: int
    pending: Any

    def groups(self) -> list[list[Completion]]:
        return self.pending.result() if hasattr(self.pending, "result") else self.pending

    def state(self) -> dict[str, Any]:
        """Waits for the completions; JSON-able (floats round-trip exactly)."""

        def plain(c: Completion) -> dict[str, Any]:
            return {
                "prompt_ids": [int(t) for t in c.prompt_ids],
                "token_ids": [int(t) for t in c.token_ids],
                "logprobs": [float(x) for x in c.logprobs],
                "finish_reason": c.finish_reason,
                "policy_version": int(c.policy_version),
            }

        return {"picks": list(self.picks), "seed": self.seed, "groups": [[plain(c) for c in g] for g in self.groups()]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> LaunchedRound:
        groups = [[Completion(**c) for c in group] for group in state["groups"]]
        return cls(list(state["picks"]), int(state["seed"]), groups)


def launch_round(
    ctl: Controller, setup: TaskSetup, sampler: EpochSampler, rng: random.Random, sampling: SamplingParams, want: int
) -> LaunchedRound:
    """Draw `want` prompts and a seed, and send their generation (returns at once)."""
    picks = sampler.next_indices(want)
    seeded = dataclasses.replace(sampling, seed=rng.getrandbits(32))
    prompts = [setup.train.prompt_ids[i] for i in picks]
    return LaunchedRound(picks, seeded.seed, ctl.generate(prompts, seeded))


def sample_groups(
    ctl: Controller,
    setup: TaskSetup,
    sampler: EpochSampler,
    rng: random.Random,
    sampling: SamplingParams,
    cfg,
    *,
    dp: int,
    first: LaunchedRound | None = None,
) -> SampledGroups:
    """Generate and score `cfg.prompts_per_step` groups (cfg: a GRPOConfig), with DAPO's overlong reward shaping.
    With `cfg.dynamic_sampling`, groups whose rewards are all equal are dropped and refilled from new prompts
    (prompts_per_step more per round, at most `cfg.max_sampling_rounds` rounds): the result never holds an
    all-equal group. If the rounds run out it holds fewer groups, trimmed to a count the `dp` trainer ranks can
    split (possibly none). `first`: the first round, already launched (the asynchronous loop's rollout buffer
    sends it a step or more ahead).

    The prompts come from `sampler` (deterministic shuffled epochs over the training prompts) and each round's
    generation seed from `rng` (the engines derive every sample's noise from it), so restoring both reproduces the
    step exactly — e.g. after a resume."""
    g, want = cfg.group_size, cfg.prompts_per_step
    out = SampledGroups.start()
    while len(out.rows) < want and out.rounds < (cfg.max_sampling_rounds if cfg.dynamic_sampling else 1):
        t0 = time.perf_counter()
        launched = first if first is not None and out.rounds == 0 else None
        launched = launched or launch_round(ctl, setup, sampler, rng, sampling, want)
        picks = launched.picks
        completions = [c for group in launched.groups() for c in group]
        t1 = time.perf_counter()
        texts = setup.renderer.completion_texts([c.token_ids for c in completions])
        scored = ctl.score(texts, [setup.train.views[i] for i in picks], group_size=g).result()
        task_rewards = [s.reward for s in scored]
        for s in scored:
            for name, why in s.failures.items():
                out.reward_failures[f"{name}: {why.split(':')[0]}"] += 1
            for name, value in s.parts.items():
                out.reward_parts.setdefault(name, []).append(value)
        out.correct += [is_correct(s, setup.verifier) for s in scored]
        out.time_generate_s += t1 - t0
        out.time_score_s += time.perf_counter() - t1
        rewards = [
            r + overlong_penalty(len(c.token_ids), sampling.max_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
            for r, c in zip(task_rewards, completions, strict=True)
        ]
        out.add_round(picks, completions, rewards, out.completions, cfg, want)
        out.task_rewards += task_rewards
    out.trim(dp, g)  # a short batch must still split evenly over the trainer ranks
    return out


def attach_reference_logprobs(ctl: Controller, data: list[Datum], micro_batch_size: int, temperature: float) -> None:
    """Fill `Datum.ref_logprobs` from the ReferenceModel (micro-batches queued at once)."""
    pending = [ctl.reference_logprobs(mb, temperature) for mb in micro_batches(data, micro_batch_size)]
    rows = [row for p in pending for row in p.result()]
    for d, row in zip(data, rows, strict=True):
        d.ref_logprobs = np.asarray(row, dtype=np.float64)
