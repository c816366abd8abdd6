"""The asynchronous loop overlaps generation and training — asserted from the real program's timeline (issue 32) —
and the loop's GPU-only paths (memory readings, the memory hand-off) run on CPU.

On a GPU the loop once waited, at every step, for a memory reading queued behind the generator's next round, so the
trainer idled through every round (no overlap, 1.11x the synchronous step). CPU runs now take the same memory
readings as GPU runs (controller/memory.py), and this test slows the generator (one sequence decoded at a time) so
that each round takes longer than the controller's work between sending it and training: every step that has the
next round in flight must start training before that round is done. A blocking call to a generator with work
queued ahead fails it."""

import json

from meshrl.config import GRPORunConfig
from meshrl.controller.cli import parse_run_config

STEPS = 3


def _intervals(run_dir, actor: str, what: str) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    return sorted((i for i in rows if i["actor"].startswith(actor) and i["what"] == what), key=lambda i: i["start"])


def test_trainer_trains_while_the_next_round_is_generated(tmp_path):
    from meshrl.controller import grpo

    argv = [
        "--preset", "tiny-reverse", "--warmup.steps", "0", "--grpo.steps", str(STEPS), "--grpo.prompts-per-step", "4",
        "--grpo.group-size", "4", "--trainer.num-procs", "1", "--trainer.micro-batch-size", "16",
        "--generator.engine", "transformers", "--generator.max-num-seqs", "1", "--reverse.num-train", "16",
        "--reverse.num-eval", "2", "--eval.samples", "0", "--grpo.max-staleness", "1", "--run.output-dir",
        str(tmp_path), "--run.name", "overlap",
    ]  # fmt: skip
    grpo.main(parse_run_config(GRPORunConfig, argv=argv))
    run = tmp_path / "overlap"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == list(range(STEPS))
    # The memory readings are taken on CPU too (the calls a GPU run makes), the generators' without waiting.
    assert all(any(k.startswith("memory/train/trainer0_") for k in r) for r in rl)
    assert any(any(k.startswith("memory/generate/generator0_") for k in r) for r in rl[1:])

    # The generator's calls in the timeline (written before the evaluation after RL), in order: the held-out
    # evaluation before RL (greedy), then the STEPS rounds (one call each).
    gens = _intervals(run, "generator", "generate")
    assert len(gens) == 1 + STEPS
    rounds = gens[1:]
    trains = _intervals(run, "trainer", "forward_backward")
    assert len(trains) == STEPS  # 16 samples per step, micro-batches of 16: one call per step
    # Steps 0 .. STEPS-2 send the next step's round before they train: each step's training starts before that
    # round is done (a controller that waits on the generator first would start it only after).
    timeline = [(i["actor"], i["what"], round(i["start"] - rounds[0]["start"], 3), round(i["end"] - i["start"], 3))
                for i in sorted(gens + trains, key=lambda i: i["start"])]  # fmt: skip
    for s in range(STEPS - 1):
        assert trains[s]["start"] < rounds[s + 1]["end"], f"step {s} waited for round {s + 1}: {timeline}"


def test_generators_cannot_sleep_in_the_asynchronous_loop():
    import dataclasses

    import pytest

    from configs import tiny_reverse
    from meshrl.errors import ConfigError

    cfg = tiny_reverse()
    generator = dataclasses.replace(cfg.generator, sleep_level=1)
    with pytest.raises(ConfigError, match=r"sleep_level=1 with grpo.max_staleness=1.*--generator.sleep-level"):
        dataclasses.replace(cfg, generator=generator, grpo=dataclasses.replace(cfg.grpo, max_staleness=1))


def test_the_memory_hand_off_runs_on_cpu_through_the_real_program(tmp_path):
    """The colocated hand-off (the generators sleep while the trainer trains, wake before the weights load) was a
    GPU-only path of the loop; the transformers engine sleeps on CPU too, so a CPU run takes it when asked."""
    from meshrl.controller import grpo

    steps = 3
    argv = [
        "--preset", "tiny-reverse", "--warmup.steps", "0", "--grpo.steps", str(steps), "--grpo.prompts-per-step", "4",
        "--grpo.group-size", "4", "--trainer.num-procs", "1", "--trainer.micro-batch-size", "8",
        "--generator.engine", "transformers", "--generator.sleep-level", "1", "--reverse.num-train", "16",
        "--reverse.num-eval", "2", "--eval.samples", "0", "--run.output-dir", str(tmp_path), "--run.name", "handoff",
    ]  # fmt: skip
    grpo.main(parse_run_config(GRPORunConfig, argv=argv))
    run = tmp_path / "handoff"
    rl = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["phase"] == "rl"]
    assert len(rl) == steps
    for r in rl:  # awake while generating, asleep (no KV cache) once the step is trained
        assert r["memory/generate/generator0_sleep_level"] == 0 and r["memory/train/generator0_sleep_level"] == 1
        assert r["memory/train/generator0_kv_cache_gib"] == 0
    sleeps, wakes = _intervals(run, "generator", "sleep"), _intervals(run, "generator", "wake_up")
    trains, pushes = _intervals(run, "trainer", "forward_backward"), _intervals(run, "trainer", "push_weights")
    assert len(sleeps) == steps and len(trains) == 2 * steps  # 16 samples, micro-batches of 8
    for s in range(steps):  # each step: sleep, then train, then wake before its weights are pushed
        first, last = trains[2 * s], trains[2 * s + 1]
        assert sleeps[s]["end"] <= first["start"] and last["end"] <= wakes[s]["start"]
        assert wakes[s]["end"] <= next(p for p in pushes if p["start"] >= last["end"])["start"]
