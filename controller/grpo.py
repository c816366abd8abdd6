"""GRPO on Monarch meshes — the whole RL loop, top to bottom.

    python -m meshrl.controller.grpo --preset tiny-reverse [--grpo.steps 40 ...]   (--help lists every field)
    python -m meshrl.controller.grpo --model.path ./my-qwen3 --data.train train.jsonl --data.eval test.jsonl \
        --data.prompt-field question --reward math_verify=1.0,format=0.1
    python -m meshrl.controller.grpo --model.path ./my-llama --task reasoning_gym:countdown --reward task=1.0
    python -m meshrl.controller.grpo --preset tiny-calculator          # multi-turn: --env calculator / pkg.mod:Env

From Python: `main(cfg, train_rows=[...], eval_rows=[...], reward_fns={"mine": fn})`.

sample rows → roll out G episodes each (one turn of a task, or an --env environment's turns: controller/rollouts.py) →
score (+ DAPO overlong shaping; dynamic sampling refills groups whose rewards are all equal) → [reference logprobs
for KL] → advantages → forward_backward over micro-batches (gradients accumulate; the loss is normalised over the
whole step; the last call takes the optimiser step, lr from the schedule) →
push/pull weights → log. The algorithm (GRPO, DAPO, Dr.GRPO, GSPO, CISPO, ...) is chosen by the `grpo.*` flags.
A resumable checkpoint is written every `run.save_every` RL steps and at the end; `--run.resume latest` continues
the run exactly where it was (same prompts, same samples, same updates).
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from meshrl.advantages import compute_advantages
from meshrl.algorithms import kl_penalties, step_loss_spec
from meshrl.checkpoint import rng_state, set_rng_state
from meshrl.config import GRPORunConfig, LogConfig
from meshrl.controller.api import Controller
from meshrl.controller.memory import MemoryHandoff
from meshrl.controller.process import prepare_process
from meshrl.controller.provision import Provisioner
from meshrl.controller.rollouts import AheadSchedule, EnvRollout, Rollouts, SingleTurnRollout
from meshrl.controller.run_checkpoints import RunCheckpoints, RunFailedError
from meshrl.controller.training import attach_reference_logprobs, train_step
from meshrl.controller.warmup import supervised_warmup, task_demonstrations
from meshrl.data.sampler import EpochSampler
from meshrl.metric_sinks import open_sinks
from meshrl.plots import plot_training
from meshrl.preflight import check_run_inputs
from meshrl.progress import progress
from meshrl.rollout_recorder import RolloutRecorder
from meshrl.run_dir import RunDir, plot_rewards
from meshrl.schedule import optim_params
from meshrl.tasks import Row, build_task
from meshrl.tasks.setup import TaskSetup, ensure_model
from meshrl.types import Datum, SamplingParams


def sampled_entropy_estimate(data: list[Datum]) -> float:
    """−mean of the sampled tokens' generator logprobs over loss tokens. The tokens were drawn from the distribution
    those logprobs are of, so this is a Monte-Carlo estimate of its entropy per token (nats): the policy's own at
    temperature 1 without top-p / top-k; no loss here computes the entropy over the whole vocabulary."""
    lps = [np.asarray(d.old_logprobs)[np.asarray(d.loss_mask) > 0] for d in data if d.old_logprobs is not None]
    lp = np.concatenate(lps) if lps else np.zeros(0)
    return float(-lp.mean()) if lp.size else 0.0


def rl_step(
    ctl: Controller,
    cfg: GRPORunConfig,
    rollouts: Rollouts,
    sampler: EpochSampler,
    rng: random.Random,
    step: int,
    ahead: AheadSchedule | None = None,
    handoff: MemoryHandoff | None = None,
    recorder: RolloutRecorder | None = None,
) -> dict:
    """One RL step, sampling through training and weight sync; returns its metrics record. Every sample is an
    episode (one turn of a task, or an environment's turns), trained as one sequence with the loss on the model's
    tokens. `ahead`: the asynchronous schedule (--grpo.max-staleness K). `handoff`: memory per phase recorded, and
    handed between generator and trainer on a shared GPU (controller/memory.py)."""
    g = cfg.grpo.group_size
    t0 = time.perf_counter()
    if ahead is not None:  # asynchronous: this step's groups were sent up to max_staleness steps ago
        batch = ahead.next_batch(step, sampler, rng)
    else:
        batch = rollouts.sample(sampler, rng)
    if batch.empty:  # dynamic sampling found no group with a learning signal
        return {"phase": "rl_skipped", "step": step, "prompts_drawn": batch.prompts_drawn, "prompts": batch.drawn}
    memory = {}
    if handoff is not None:  # the generators' cache goes to the trainer until the step is trained
        memory = handoff.record("generate")
        handoff.to_trainer()
    rewards = batch.rewards
    data = batch.datums()
    if ctl.reference is not None:
        attach_reference_logprobs(ctl, data, cfg.trainer.micro_batch_size, cfg.generator.temperature)
        if cfg.grpo.kl_mode == "reward":
            kl = kl_penalties(data, cfg.grpo.kl_estimator)
            rewards = [r - cfg.grpo.kl_coef * k for r, k in zip(rewards, kl, strict=True)]
    advantages = compute_advantages(cfg.grpo.advantage, rewards, g, turn_rewards=batch.turn_rewards())
    for d, a in zip(data, advantages, strict=True):  # an episode's advantage on every one of its model tokens
        d.advantage = a
    if recorder is not None:  # every log.rollouts_every steps: prompts, completions, rewards to rollouts.jsonl
        recorder.write(step, batch, rewards, advantages)
    t2 = time.perf_counter()

    # Loss, aggregation and its global normaliser over the whole step, KL term, TIS (meshrl.algorithms).
    max_tokens = rollouts.source.max_model_tokens
    loss = step_loss_spec(cfg.grpo, data, temperature=cfg.generator.temperature, max_tokens=max_tokens)
    params = optim_params(cfg.optim, step, cfg.grpo.steps)
    # forward_backward over micro-batches (gradients accumulate), the last one taking the optimiser step.
    # `mismatch`: trainer vs generator logprobs over the loss tokens (mean, max), reduced on the trainer.
    results, opt, mismatch = train_step(ctl, data, loss, cfg.trainer.micro_batch_size, params)
    if handoff is not None:
        memory |= handoff.record("train")
        handoff.to_generator()  # the trainer's AdamW state to the host (if asked), the generators wake
    t3 = time.perf_counter()

    # Synchronous: the generators load the new weights now. Asynchronous: they are published, and the generators
    # load them after the batches they are sampling (controller/rollouts.py, AheadSchedule).
    sync = ctl.sync_weights(wait=ahead is None)
    t4 = time.perf_counter()

    n_tokens = sum(len(d.tokens) for d in data)
    token_means = {k: sum(r.metrics[k] for r in results) / loss.num_loss_tokens for k in results[0].metrics}
    return {
        "phase": "rl",
        "step": step,
        "policy_version": opt.policy_version,
        "reward_mean": statistics.fmean(batch.task_rewards),  # every completion sampled this step
        "reward_std": statistics.pstdev(batch.task_rewards),
        "reward_trained_mean": statistics.fmean(rewards),  # the trained groups, after shaping
        "accuracy_sampled": statistics.fmean(batch.correct),  # the verifier's verdict on every sample
        "reward_failures": sum(batch.reward_failures.values()),  # verifier errors / timeouts (scored 0)
        **{f"reward/{name}": statistics.fmean(values) for name, values in batch.reward_parts.items()},
        **({"reward_failures_by_kind": dict(batch.reward_failures)} if batch.reward_failures else {}),
        "loss": sum(r.loss for r in results),
        "grad_norm": opt.grad_norm,
        "lr": opt.lr,
        "clip_frac": token_means.pop("clip_frac", 0.0),
        **token_means,  # per loss token: ratio, kl, tis_weight, ... (whatever the loss reports)
        "logprob_diff_mean": mismatch[0],
        "logprob_diff_max": mismatch[1],
        "entropy_sampled_est": sampled_entropy_estimate(data),
        "completion_len_mean": statistics.fmean(batch.lengths()),  # model tokens per completion / episode
        **batch.metrics,  # episodes: turns, tool calls, environment time and failures, finish reasons
        "groups_trained": len(batch.rows),
        "groups_dropped": batch.groups_dropped,
        "prompts_drawn": batch.prompts_drawn,
        "prompts": batch.drawn,  # indices into the training prompts, in draw order (kept or dropped)
        "epoch": sampler.epochs_done,
        "sampling_rounds": batch.rounds,
        "tokens_per_s": n_tokens / (t4 - t0),
        "tokens_trained": n_tokens,  # prompt and completion tokens of the trained episodes
        "tokens_generated": sum(batch.lengths()),  # the model's tokens of the trained episodes
        "time_generate_s": batch.time_generate_s,
        "time_score_s": batch.time_score_s,
        "time_advantages_s": t2 - t0 - batch.time_generate_s - batch.time_score_s,
        "time_train_s": t3 - t2,
        "time_weight_sync_s": t4 - t3,  # asynchronous: publishing only (the generators load it later)
        "time_step_s": t4 - t0,
        "weight_sync_bytes": sync.bytes,
        "micro_batches": len(results),
        "replicas_restarted": ctl.replicas_restarted,  # generator / reward processes replaced so far in this process
        **memory,
    }


def warn_on_logprob_gap(record: dict, threshold: float = LogConfig.logprob_gap_warn) -> bool:
    """Trainer and generator compute the same logprobs up to rounding (~1e-6 nats in float32, ~1e-2 in bfloat16). A
    mean gap over `threshold` (--log.logprob-gap-warn) means they run different models — dropout left on, another
    checkpoint, a broken weight sync — and every importance ratio of the loss is wrong: said on stderr at every such
    step, and counted in the record (`logprob_gap_warning` 1, else 0)."""
    gap = record.get("logprob_diff_mean", 0.0)
    # Samples of an older policy version (the asynchronous loop) differ by the updates since, not by a mismatch.
    warned = gap > threshold and not record.get("staleness_max", 0)
    record["logprob_gap_warning"] = int(warned)
    if warned:
        rule = "!" * 100
        print(
            f"{rule}\n[meshrl] WARNING: trainer and generator logprobs differ by {gap:.3f} nats per token on average "
            f"(max {record['logprob_diff_max']:.3f}; warning above {threshold:g}, --log.logprob-gap-warn) at step "
            f"{record['step']}: they are not computing the same model (dropout on? different dtypes or weights?). "
            f"The policy-gradient ratios are off; check before trusting this run.\n{rule}",
            file=sys.stderr,
            flush=True,
        )
    return warned


def memory_handoff(ctl: Controller, cfg: GRPORunConfig) -> MemoryHandoff:
    """The run's memory hand-off and readings (controller/memory.py). Memory is read on every run, CPU included, so
    that CPU runs make the same calls at the same points of the loop as GPU runs. `generator.sleep_level` None: the
    generators sleep during training (level 1: KV cache freed) when one shares a CUDA trainer's GPU in the
    synchronous loop; the asynchronous loop generates while training, so they stay awake."""
    level = cfg.generator.sleep_level
    if level is None:
        trainer_gpu = ctl.trainer_info["device_identity"]
        shared = any(g["device_identity"] == trainer_gpu for g in ctl.generator_info)
        level = 1 if cfg.trainer.device == "cuda" and shared and not cfg.grpo.max_staleness else 0
    offload, asynchronous = cfg.trainer.offload_optimizer, bool(cfg.grpo.max_staleness)
    return MemoryHandoff(ctl, sleep_level=level, offload_optimizer=offload, asynchronous=asynchronous)


def main(
    cfg: GRPORunConfig,
    *,
    train_rows: Sequence[dict | Row] | None = None,
    eval_rows: Sequence[dict | Row] | None = None,
    reward_fns: Mapping[str, Callable] | None = None,
) -> dict:
    """Run GRPO. `train_rows` / `eval_rows` (row dicts as in a JSONL file, or `Row`s) stand in for --data.train /
    --data.eval; `reward_fns` ({name: fn(completion, row) -> float}) add reward functions, weight 1.0 unless
    cfg.reward weighs them."""
    # ---- The run: its directory, task, model, rubric and rollout source (no process started yet) --------------
    check_run_inputs(cfg)  # a bad checkpoint, process count or length is refused before anything else runs
    run = RunDir(cfg.run.output_dir, cfg.run.name, cfg)
    run.add_sink(*open_sinks(cfg.log, run.path, cfg))  # every record also to TensorBoard (tb/), wandb, ...
    task = build_task(cfg, train_rows=train_rows, eval_rows=eval_rows)
    model_dir = ensure_model(cfg, task, run.path)
    eval_tokens = cfg.eval.max_tokens or cfg.generator.max_tokens
    setup = TaskSetup.prepare(cfg, task, model_dir, reward_fns=reward_fns, eval_max_tokens=eval_tokens)
    if cfg.env.name:  # an environment's episodes (its rewards, plus --reward's rubric if given)
        source = EnvRollout(cfg.env, setup, max_model_len=cfg.generator.max_model_len,
                            turn_max_tokens=cfg.generator.max_tokens)  # fmt: skip
    else:  # the task's rows as one-turn episodes, scored by the rubric
        source = SingleTurnRollout(setup, cfg.generator.max_tokens)
    demos = None  # the warm-up's sequences, made (and a batch they cannot fill refused) before any process starts
    if cfg.warmup.steps and not source.multi_turn:
        demos = task_demonstrations(setup, cfg.warmup, cfg.generator.max_model_len)
    print(
        f"[meshrl] run dir {run.path}\n[meshrl] task {task.name}: {'; '.join(setup.notes)}\n"
        f"[meshrl] rewards: {setup.describe_rewards()}; correct = {setup.verifier} >= 1\n"
        f"[meshrl] starting {cfg.trainer.num_procs} trainer + {cfg.generator.num_replicas} generator + "
        f"{0 if setup.rewards is None else cfg.scoring.num_procs} reward processes from {model_dir}"
        + (f"\n[meshrl] {note}" if (note := cfg.gpu_layout_note()) else "")
    )

    # ---- How it samples: the sampling parameters, the controller's randomness, checkpoints, evaluation ---------
    sampling = SamplingParams(
        max_tokens=cfg.generator.max_tokens,
        temperature=cfg.generator.temperature,
        top_p=cfg.generator.top_p,
        top_k=cfg.generator.top_k,
        n=cfg.grpo.group_size,
        stop_token_ids=setup.renderer.stop_token_ids,
    )
    rng = random.Random(cfg.run.seed)  # generation seeds: with the sampler, all of the controller's randomness
    sampler = EpochSampler(len(setup.train), seed=cfg.run.seed)  # shuffled epochs over the training prompts
    ckpts = RunCheckpoints("grpo", run, cfg)

    ahead = None  # --grpo.max-staleness K > 0: generation runs up to K steps ahead of training

    def run_eval(when: str, step: int) -> dict:
        if ahead is not None:  # the asynchronous loop publishes without waiting: serve the latest weights
            ahead.finish_in_flight()
            ctl.sync_weights(wait=False)
        record = rollouts.evaluate(
            cfg.eval, max_tokens=eval_tokens, temperature=cfg.generator.temperature, top_p=cfg.generator.top_p,
            top_k=cfg.generator.top_k,
        )  # fmt: skip
        run.log({"phase": "eval", "when": when, "step": step, **record})
        return record

    # ---- The processes: this one prepared, every role placed (cfg.placement), the Controller started ----------
    # The asynchronous loop (--grpo.max-staleness K) is its mode from the start (controller/api.py).
    prepare_process()
    provision = Provisioner(cfg.placement)
    with ckpts.starting():  # a host lost while the processes start ends the run with the resume hint
        ctl = Controller.start(
            cfg, model_dir=model_dir, rewards=setup.rewards, tokenizer=setup.renderer.tokenizer, provision=provision
        )
    handoff = memory_handoff(ctl, cfg)
    rollouts = Rollouts(ctl, setup, source, sampling, cfg.grpo, dp=cfg.trainer.num_procs)
    with ctl, ckpts.resume_hint_on_failure(), run.sinks_open():
        describe_processes(ctl)

        # ---- Resume, or warm up and evaluate before RL ---------------------------------------------------------
        # Checkpoints are taken at RL steps only, after the warm-up and the before-RL evaluation: a resumed run
        # never repeats either; it reloads the trainer, the RNG, the data cursor and the before-RL result.
        if resumed := ckpts.restore(ctl):
            start, before, ref_dir = resumed["step"], resumed["before_rl"], resumed["reference_model"]
            set_rng_state(rng, resumed["rng"])
            sampler = restore_sampler(resumed, len(setup.train))
            ctl.sync_weights()  # the generators sample from the resumed weights
        else:
            start = 0
            if cfg.warmup.steps:
                warm_up(ctl, cfg, setup, source, run, demos)
            ref_dir = None
            if cfg.grpo.needs_reference:  # KL is measured against the policy as RL starts (after the warm-up)
                ref_dir = ctl.export_hf(str(run.path / "reference_model")) if cfg.warmup.steps else model_dir
            before = run_eval("before_rl", 0)
        if ref_dir is not None:
            ctl.start_reference(ref_dir, num_procs=cfg.grpo.reference_procs)
        if cfg.grpo.max_staleness:
            ahead = AheadSchedule(rollouts, max_staleness=cfg.grpo.max_staleness, total_steps=cfg.grpo.steps)
            if resumed:
                ahead.restore(resumed.get("rollouts", {}))
        print(f"[meshrl] held-out before RL: {describe_eval(before)}")

        def checkpoint_state() -> dict:
            return {
                "rng": rng_state(rng),
                "sampler": {**sampler.state(), "num_prompts": len(setup.train)},
                "before_rl": before,
                "reference_model": ref_dir,
                "warmup_done": True,
                **({"rollouts": ahead.state()} if ahead is not None else {}),  # rounds in flight, waited for
            }

        # ---- RL steps ------------------------------------------------------------------------------------------
        recorder = RolloutRecorder(run.path, cfg.log.rollouts_every, start_step=start)  # rollouts.jsonl
        bar = progress(range(start, cfg.grpo.steps), desc="GRPO", initial=start, total=cfg.grpo.steps)
        for step in bar:
            record = rl_step(ctl, cfg, rollouts, sampler, rng, step, ahead, handoff, recorder)
            if record["phase"] == "rl":
                warn_on_logprob_gap(record, cfg.log.logprob_gap_warn)
                bar.set_postfix(reward=f"{record['reward_mean']:.3f}", diff=f"{record['logprob_diff_max']:.1e}")
            run.log(record)
            done = step + 1
            if cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.grpo.steps:
                bar.write(f"[meshrl] held-out at step {done}: {describe_eval(run_eval('during_rl', done))}")
            if stopped := ckpts.after_step(ctl, done, cfg.grpo.steps, checkpoint_state):
                return {"stopped_at": done, "checkpoint": stopped, "run_dir": str(run.path)}

        # ---- The end: the timeline, held-out evaluation after RL, the last checkpoint, the HF export -------------
        rl_window = [r for r in run.read_metrics() if r["phase"] == "rl"]
        timeline = write_timeline(run, ctl.timeline(), rl_window=rl_window, plot=cfg.log.plots)
        after = run_eval("after_rl", cfg.grpo.steps)
        last_ckpt = ckpts.save(ctl, cfg.grpo.steps, checkpoint_state())
        final_dir = ctl.export_hf(str(run.path / "final_model"))
    return write_summary(run, cfg, task.name, setup.verifier, before, after, final_dir, last_ckpt, timeline)


def describe_processes(ctl: Controller) -> None:
    print(f"[meshrl] model: {ctl.trainer_info['num_params']:,} parameters")
    print(f"[meshrl] trainer processes (pids): {ctl.trainer_pids}", flush=True)
    print(f"[meshrl] generator processes (pids): {[g['pid'] for g in ctl.generator_info]}", flush=True)
    if ctl.reward is not None:
        print(f"[meshrl] reward processes (pids): {ctl.reward.pids}", flush=True)
    print(f"[meshrl] placement: {ctl.provision.describe()}", flush=True)


def warm_up(
    ctl: Controller, cfg: GRPORunConfig, setup: TaskSetup, source: SingleTurnRollout | EnvRollout, run: RunDir,
    demos: list[Datum] | None = None,
) -> None:  # fmt: skip
    """The supervised warm-up (--warmup.steps) on the task's reference answers (`demos` when made already; an
    environment's demonstrated episodes), through the same endpoints as RL; the generators then serve its weights."""
    print(
        f"[meshrl] supervised warm-up: {cfg.warmup.steps} cross-entropy steps on the task's "
        "reference answers (same forward_backward/optim_step endpoints), then RL"
    )
    supervised_warmup(
        ctl,
        setup,
        cfg.warmup,
        micro_batch_size=cfg.trainer.micro_batch_size,
        optim=cfg.optim,
        seed=cfg.run.seed,
        max_len=cfg.generator.max_model_len,
        log=run.log,
        demos=source.demonstrations(setup, cfg.generator.max_model_len) if source.multi_turn else demos,
    )
    ctl.sync_weights()


def write_summary(
    run: RunDir,
    cfg: GRPORunConfig,
    task_name: str,
    verifier: str,
    before: dict,
    after: dict,
    final_dir: str,
    last_ckpt: str,
    timeline: str,
) -> dict:
    """summary.json and the closing lines, over the whole run's metrics: a resumed run appended to the records of
    the run it continues."""
    rl = [r for r in run.read_metrics() if r.get("phase") == "rl"]
    plots = cfg.log.plots
    k = min(5, len(rl))
    first = statistics.fmean(r["reward_mean"] for r in rl[:k]) if rl else float("nan")
    last = statistics.fmean(r["reward_mean"] for r in rl[-k:]) if rl else float("nan")
    summary = {
        "reward_first5_mean": first,
        "reward_last5_mean": last,
        "reward_gain": last - first,
        "eval_accuracy_before_rl": before["accuracy"],
        "eval_accuracy_after_rl": after["accuracy"],
        "eval_before_rl": {k: v for k, v in before.items() if k != "samples"},
        "eval_after_rl": {k: v for k, v in after.items() if k != "samples"},
        "task": task_name,
        "warmup_steps": cfg.warmup.steps,
        "rl_steps": cfg.grpo.steps,
        "run_dir": str(run.path),
        "final_checkpoint": final_dir,
        "resumable_checkpoint": last_ckpt,
        "metrics": str(run.metrics_path),
        "reward_plot": str(plot_rewards(run.read_metrics(), run.path / "reward_curve.png")) if plots else None,
        "training_plot": (
            str(plot_training(rl, run.path / "training.png", logprob_gap_warn=cfg.log.logprob_gap_warn))
            if plots
            else None
        ),
        "timeline": timeline,
    }
    run.write_json("summary.json", summary)
    print(f"[meshrl] reward: first 5 steps {first:.3f} → last 5 steps {last:.3f} (gain {last - first:+.3f})")
    print(f"[meshrl] held-out (correct = {verifier} >= 1), before RL: {describe_eval(before)}")
    print(f"[meshrl] held-out (correct = {verifier} >= 1), after RL:  {describe_eval(after)}")
    drawn = f"[meshrl] plot:       {summary['reward_plot']}\n[meshrl] dashboard:  {summary['training_plot']}\n"
    print(
        f"[meshrl] metrics:    {summary['metrics']}\n{drawn if plots else ''}"
        f"[meshrl] checkpoint: {final_dir} (HF format); {last_ckpt} (resumable)\n"
        f"[meshrl] summary:    {run.path / 'summary.json'}"
    )
    return summary


def write_timeline(
    run: RunDir, intervals: list[dict], *, rl_window: list[dict], last_steps: int = 5, plot: bool = True
) -> str:
    """The actors' busy intervals of the run (this process's part of it, after a resume) as `timeline.jsonl`, and
    the last `last_steps` RL steps as `timeline.png`: where generation, scoring, training and weight sync overlap."""
    import json

    path = run.path / "timeline.jsonl"
    with path.open("a") as f:
        for interval in intervals:
            f.write(json.dumps(interval) + "\n")
    steps = [r["time_step_s"] for r in rl_window[-last_steps:] if "time_step_s" in r]
    ends = [i["end"] for i in intervals if i["what"] in ("forward_backward", "push_weights")]
    if plot and steps and ends:
        end = max(ends)
        start = end - sum(steps) * 1.02
        recent = [i for i in intervals if i["end"] >= start and i["start"] <= end]
        from meshrl.timeline import plot_timeline

        plot_timeline(recent, run.path / "timeline.png", title=f"the last {len(steps)} RL steps: who is busy when")
    return str(path)


def restore_sampler(state: dict, num_prompts: int) -> EpochSampler:
    """The checkpointed data cursor, refused if the training prompts changed since (it would index other rows)."""
    saved = state["sampler"]
    if saved.get("num_prompts", num_prompts) != num_prompts:
        raise RuntimeError(
            f"the checkpoint's data cursor was taken over {saved['num_prompts']} training prompts, but this run has "
            f"{num_prompts}: the data (or --data.*, --generator.max-model-len) changed; resume with the run's own "
            "data and flags"
        )
    return EpochSampler.from_state(num_prompts, saved)


def describe_eval(record: dict) -> str:
    """'greedy accuracy 0.365, mean@8 0.301, pass@1 0.301, pass@8 0.640'"""
    parts = [f"greedy accuracy {record['accuracy']:.3f}"]
    parts += [f"{k} {v:.3f}" for k, v in record.items() if k.startswith(("mean@", "pass@"))]
    return ", ".join(parts)


if __name__ == "__main__":
    from meshrl.controller.cli import parse_run_config, stop_on_sigterm
    from meshrl.errors import ConfigError, DataError

    stop_on_sigterm()
    try:
        main(parse_run_config(GRPORunConfig, description=__doc__))
    except RunFailedError as e:
        sys.exit(f"[meshrl] {e}")
    except (ConfigError, DataError) as e:  # found as the task, model and rewards load, before any process starts
        sys.exit(f"config error: {e}" if isinstance(e, ConfigError) else f"data error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)
