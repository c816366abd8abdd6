"""Watching a run: metric backends (TensorBoard, wandb), the rollout recorder, the training dashboard, the logprob-gap
warning and --log.* validation. The real GRPO program's files (tb/, rollouts.jsonl, training.png) are checked by
tests/test_grpo_e2e.py, on the run it already makes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshrl.config import ConfigError, LogConfig
from meshrl.metric_sinks import TB_DIR, TensorBoardSink, WandbSink, open_sinks, scalars
from meshrl.rollout import Episode, EpisodeOutcome, EpisodeTokens, Group, SingleTurnEnv
from meshrl.rollout.batch import RolloutBatch
from meshrl.rollout_recorder import ROLLOUTS_FILE, RolloutRecorder, read_rollouts
from meshrl.run_dir import RunDir
from meshrl.tasks.base import Row
from meshrl.types import Completion, Datum


def tb_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of the event files under `log_dir`, as TensorBoard shows them (restarts purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def rl_record(step: int, **over) -> dict:
    return {
        "phase": "rl",
        "step": step,
        "policy_version": 10 + step,
        "reward_mean": 0.25 * step,
        "reward_std": 0.1,
        "reward/exact_match": 0.5,
        "memory/train/trainer0_peak_gib": 1.25,
        "reward_failures_by_kind": {"exact_match: timeout": 2},
        "prompts": [3, 1, 2],  # a list: not a scalar
        "grad_norm": 1.5 + step,
        **over,
    }


def run_dir(tmp_path, name="r", *, resume=False, backends="tensorboard") -> RunDir:
    run = RunDir(str(tmp_path), name, LogConfig(), resume=resume)
    run.add_sink(*open_sinks(LogConfig(backends=backends), run.path))
    return run


def test_scalars_are_the_records_numbers():
    got = scalars(rl_record(2, when="during_rl", ok=True, missing=None))
    assert got["reward_mean"] == 0.5 and got["reward/exact_match"] == 0.5 and got["ok"] == 1.0
    assert got["reward_failures_by_kind/exact_match: timeout"] == 2.0
    assert not {"phase", "step", "prompts", "when", "missing"} & got.keys()


def test_tensorboard_event_files_hold_what_was_logged(tmp_path):
    run = run_dir(tmp_path)
    with run.sinks_open():
        for s in range(3):
            run.log({"phase": "warmup", "step": s, "loss": 2.0 - s, "lr": 1e-3})
        run.log({"phase": "eval", "when": "before_rl", "step": 0, "accuracy": 0.125, "samples": ["abc"]})
        for s in range(2):
            run.log(rl_record(s))
    got = tb_scalars(run.path / TB_DIR)
    assert got["rl/reward_mean"] == [(0, 0.0), (1, 0.25)]
    assert got["rl/grad_norm"] == [(0, 1.5), (1, 2.5)]
    assert got["rl/reward/exact_match"] == [(0, 0.5), (1, 0.5)]
    assert got["rl/memory/train/trainer0_peak_gib"] == [(0, 1.25), (1, 1.25)]
    assert got["warmup/loss"] == [(0, 2.0), (1, 1.0), (2, 0.0)]
    assert got["eval/accuracy"] == [(0, 0.125)]
    assert not any(t.endswith(("prompts", "/when", "/samples", "/step")) for t in got)
    run.close()


def test_resume_rewinds_tensorboard_so_no_step_is_drawn_twice(tmp_path):
    """A run checkpointed after RL step 3, crashed after step 5, resumed: metrics.jsonl drops the records after the
    checkpoint, TensorBoard hides what it had from step 3 on (purge_step) — and shows again what is kept there (the
    warm-up's later steps, the evaluation at step 3)."""
    run = run_dir(tmp_path)
    for s in range(6):
        run.log({"phase": "warmup", "step": s, "loss": 10.0 + s})
    for s in range(3):
        run.log(rl_record(s))
    run.log({"phase": "eval", "when": "during_rl", "step": 3, "accuracy": 0.5})
    checkpoint_lines = run.num_metric_lines()
    for s in range(3, 6):
        run.log(rl_record(s, reward_mean=-1.0))  # what the crashed run logged after its checkpoint
    run.close_sinks()
    run.close()

    resumed = run_dir(tmp_path, resume=True)
    with resumed.sinks_open():
        resumed.truncate_metrics(checkpoint_lines)
        for s in range(3, 5):
            resumed.log(rl_record(s, reward_mean=100.0 + s))
    got = tb_scalars(resumed.path / TB_DIR)
    assert got["rl/reward_mean"] == [(0, 0.0), (1, 0.25), (2, 0.5), (3, 103.0), (4, 104.0)]
    assert got["warmup/loss"] == [(s, 10.0 + s) for s in range(6)]
    assert got["eval/accuracy"] == [(3, 0.5)]
    records = resumed.read_metrics()
    assert [r["reward_mean"] for r in records if r["phase"] == "rl"] == [0.0, 0.25, 0.5, 103.0, 104.0]
    resumed.close()


def test_tensorboard_sink_opens_nothing_before_its_first_record(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    sink.close()
    assert not (tmp_path / "tb").exists()


def test_wandb_offline_gets_every_phase_on_its_own_step_axis(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # never contacts a server
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    sinks = open_sinks(LogConfig(backends="tensorboard,wandb", wandb_project="t"), tmp_path, LogConfig())
    assert [type(s) for s in sinks] == [TensorBoardSink, WandbSink]
    wb = sinks[1]
    for s in range(3):
        wb.log({"phase": "warmup", "step": s, "loss": 2.0})
    wb.log(rl_record(0))
    wb.log(rl_record(1))
    summary = wb._run.summary
    assert summary["rl/reward_mean"] == 0.25 and summary["rl/step"] == 1 and summary["warmup/step"] == 2
    run_id = wb._run.id
    wb.close()
    assert (tmp_path / "wandb_id.txt").read_text().strip() == run_id  # a resumed run continues this wandb run
    assert list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))


def test_user_backend_by_import_path(tmp_path):
    run = run_dir(tmp_path, backends="tensorboard,test_observability:list_sink")
    run.log(rl_record(0))
    run.close_sinks()
    user = run.sinks[1]
    assert user.records[0]["reward_mean"] == 0.0 and user.closed
    run.close()


class ListSink:
    def __init__(self):
        self.records, self.closed = [], False

    def log(self, record):
        self.records.append(record)

    def close(self):
        self.closed = True


def list_sink(run_path, config):
    return ListSink()


def test_log_config_errors(monkeypatch):
    with pytest.raises(ConfigError, match="unknown 'tb'.*tensorboard, wandb"):
        LogConfig(backends="tensorboard,tb")
    with pytest.raises(ConfigError, match="no backend named"):
        LogConfig(backends=" , ")
    with pytest.raises(ConfigError, match="rollouts_every"):
        LogConfig(rollouts_every=-1)
    with pytest.raises(ConfigError, match="logprob_gap_warn"):
        LogConfig(logprob_gap_warn=0.0)
    assert LogConfig(backends="none").backend_names == []
    assert LogConfig(backends="TensorBoard").backend_names == ["tensorboard"]

    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ConfigError, match="pip install wandb"):
        LogConfig(backends="tensorboard,wandb")
    with pytest.raises(ConfigError, match="cannot import"):
        open_sinks(LogConfig(backends="no_such_module_xyz:make"), "/nonexistent")


# --- rollouts.jsonl ---


def completion(tokens, version=7, reason="stop"):
    return Completion([1, 2], list(tokens), [-0.5] * len(tokens), reason, version)


def scored(row, c, reward, correct, parts=None):
    """A one-turn episode of `c` on `row`, as the rubric leaves it."""
    episode = SingleTurnEnv.episode_of(row, c, "".join(chr(96 + t) for t in c.token_ids))
    episode.outcome.reward, episode.outcome.correct = reward, correct
    episode.outcome.reward_parts = dict(parts or {})
    return episode


def dynamic_sampling_batch():
    """Three prompts drawn (5, 7, 9), group size 2; the group of 7 had equal rewards and was dropped."""
    p5, p9 = Row("p5", answer="5p"), Row("p9", answer="9p")
    g5 = [scored(p5, completion([1, 2]), 1.0, True, {"exact_match": 1.0, "char_match": 1.0}),
          scored(p5, completion([3]), 0.0, False, {"exact_match": 0.0, "char_match": 0.5})]  # fmt: skip
    g9 = [scored(p9, completion([2, 1], reason="length"), 0.25, False, {"exact_match": 0.0, "char_match": 0.25}),
          scored(p9, completion([4]), 0.75, True, {"exact_match": 1.0, "char_match": 0.75})]  # fmt: skip
    return RolloutBatch(groups=[Group(5, g5, [1.0, 0.0]), Group(9, g9, [0.25, 0.75])], drawn=[5, 7, 9])


def test_rollouts_line_per_trained_sample_with_its_scores(tmp_path):
    rec = RolloutRecorder(tmp_path, 1)
    rec.write(4, dynamic_sampling_batch(), [1.0, 0.0, 0.2, 0.75], np.array([0.7, -0.7, -0.7, 0.7]))
    lines = read_rollouts(tmp_path)
    assert [(r["step"], r["prompt_index"], r["group"], r["sample"]) for r in lines] == [
        (4, 5, 0, 0), (4, 5, 0, 1), (4, 9, 1, 0), (4, 9, 1, 1),
    ]  # fmt: skip
    assert [r["completion"] for r in lines] == ["ab", "c", "ba", "d"]
    assert [r["reward"] for r in lines] == [1.0, 0.0, 0.25, 0.75]
    assert [r["correct"] for r in lines] == [True, False, False, True]
    assert lines[3]["reward_parts"] == {"exact_match": 1.0, "char_match": 0.75}
    assert [r["reward_trained"] for r in lines] == [1.0, 0.0, 0.2, 0.75]  # after overlong shaping
    assert [r["advantage"] for r in lines] == [0.7, -0.7, -0.7, 0.7]
    assert lines[2]["finish_reason"] == "length" and lines[2]["length"] == 2
    assert lines[0]["prompt"] == "p5" and lines[0]["answer"] == "5p" and lines[0]["policy_version"] == 7


def test_rollouts_of_a_prompt_drawn_twice_keep_their_scores(tmp_path):
    """Each sample carries its own scores: a prompt drawn twice in a step (8 rows, 16 prompts a step) no longer
    loses them (issue 31, item 7)."""
    row = Row("a", answer="a")
    group = [scored(row, completion([1]), 1.0, True, {"exact_match": 1.0}),
             scored(row, completion([2]), 0.0, False, {"exact_match": 0.0})]  # fmt: skip
    batch = RolloutBatch(groups=[Group(3, group, [1.0, 0.0]), Group(3, group, [1.0, 0.0])], drawn=[3, 3])
    RolloutRecorder(tmp_path, 1).write(0, batch, [1.0, 0.0, 1.0, 0.0], [0.5, -0.5, 0.5, -0.5])
    lines = read_rollouts(tmp_path)
    assert [r["reward"] for r in lines] == [1.0, 0.0, 1.0, 0.0] and lines[0]["reward_parts"] == {"exact_match": 1.0}
    assert [r["correct"] for r in lines] == [True, False, True, False]


def test_rollouts_every_n_steps_and_cut_back_on_resume(tmp_path):
    rec = RolloutRecorder(tmp_path, 2)
    for step in range(6):
        rec.write(step, dynamic_sampling_batch(), [0.0] * 4, [0.0] * 4)
    assert sorted({r["step"] for r in read_rollouts(tmp_path)}) == [0, 2, 4]
    RolloutRecorder(tmp_path, 2, start_step=3)  # resumed at step 3: steps 3.. run again
    assert sorted({r["step"] for r in read_rollouts(tmp_path)}) == [0, 2]
    assert len(read_rollouts(tmp_path)) == 8
    RolloutRecorder(tmp_path, 0).write(0, dynamic_sampling_batch(), [0.0] * 4, [0.0] * 4)  # a fresh run
    assert (tmp_path / ROLLOUTS_FILE).read_text() == ""


def test_rollouts_of_episodes_hold_the_conversation(tmp_path):
    def episode(reward, versions):
        tokens = EpisodeTokens([1] * 12, [0] * 3 + [1] * 9, [0.0] * 12, [3], set(versions))
        outcome = EpisodeOutcome(
            row=Row("2+3?", answer="5"), reward=reward, turn_rewards=[0.0, reward], correct=reward == 1.0,
            finish_reason="done", num_turns=2, error=None,
            messages=[{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "<tool>2+3</tool>"},
                      {"role": "user", "content": "5"}, {"role": "assistant", "content": "5"}],
        )  # fmt: skip
        return Episode(tokens, outcome)

    group = Group(0, [episode(1.0, {3}), episode(0.0, {3, 4})], [1.0, 0.0])
    batch = RolloutBatch(groups=[group], drawn=[0], multi_turn=True)
    RolloutRecorder(tmp_path, 1).write(1, batch, [1.0, 0.0], [np.float32(0.5), -0.5])
    lines = read_rollouts(tmp_path)
    assert lines[0]["messages"][1]["content"] == "<tool>2+3</tool>" and lines[0]["turns"] == 2
    assert lines[0]["policy_version"] == 3 and "policy_versions" not in lines[0] and lines[0]["length"] == 9
    assert lines[1]["policy_versions"] == [3, 4] and lines[1]["advantage"] == -0.5 and lines[0]["advantage"] == 0.5


# --- training.png ---


def full_records(steps=4):
    out = [{"phase": "warmup", "step": s, "loss": 1.0} for s in range(3)]
    for s in range(steps):
        out.append(
            rl_record(
                s, completion_len_mean=5.0 + s, entropy_sampled_est=1.2 - 0.1 * s, kl=0.01 * s,
                logprob_diff_mean=1e-7, logprob_diff_max=1e-6, accuracy_sampled=0.1 * s,
                time_generate_s=1.0, time_score_s=0.2, time_advantages_s=0.01, time_train_s=2.0,
                time_weight_sync_s=0.1, **{"memory/generate/generator0_reserved_gib": 20.0,
                                           "memory/generate/trainer0_peak_gib": 3.0,
                                           "memory/train/trainer0_allocated_gib": 2.0},
            )
        )  # fmt: skip
    return out


def test_training_dashboard_has_a_panel_per_signal(tmp_path):
    from meshrl.plots import memory_series_keys, plot_training, training_panels

    titles = [p.title for p in training_panels(full_records())]
    for word in ("reward", "completion length", "entropy", "KL", "grad norm", "logprob", "time", "memory"):
        assert any(word in t for t in titles), (word, titles)
    keys = {k for r in full_records() for k in r}
    assert memory_series_keys(keys) == [
        ("memory/generate/generator0_reserved_gib", "generator0 reserved @generate"),
        ("memory/generate/trainer0_peak_gib", "trainer0 peak @generate"),
        ("memory/train/trainer0_peak_gib", "trainer0 peak @train"),  # the peak where a process reports it
    ]
    path = plot_training(full_records(), tmp_path / "training.png", logprob_gap_warn=0.1)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_training_dashboard_leaves_out_what_a_run_does_not_measure(tmp_path):
    from meshrl.plots import plot_training, training_panels

    cpu = [{k: v for k, v in r.items() if not k.startswith("memory/") and k != "kl"} for r in full_records()]
    titles = [p.title for p in training_panels(cpu)]
    assert not any("memory" in t or "KL" in t for t in titles) and len(titles) == 6
    assert plot_training([{"phase": "warmup", "step": 0, "loss": 1.0}], tmp_path / "t.png") is None
    assert not (tmp_path / "t.png").exists()


# --- the logprob-gap warning ---


def test_logprob_gap_warning_is_loud_once_per_step_and_counted(capsys):
    """A record as rl_step makes it, from a trainer whose logprobs are 0.5 nats off the generator's: the warning
    fires on stderr for each such step, and the record says so; an agreeing step is silent and says 0."""
    from meshrl.controller.grpo import sampled_entropy_estimate, warn_on_logprob_gap

    data = [Datum.from_completion([1, 2], [3, 4, 5], [-1.0, -2.0, -0.5], 1.0) for _ in range(2)]
    for trainer_offset, expect in ((0.5, True), (1e-7, False), (0.5, True)):
        # the trainer's mismatch (train_step): every loss token `trainer_offset` off the generator's
        record = {"phase": "rl", "step": 3, "logprob_diff_mean": trainer_offset, "logprob_diff_max": trainer_offset}
        assert warn_on_logprob_gap(record, LogConfig(logprob_gap_warn=0.1).logprob_gap_warn) is expect
        err = capsys.readouterr().err
        assert record["logprob_gap_warning"] == int(expect)
        if expect:
            assert err.count("WARNING") == 1 and "0.500 nats" in err and "--log.logprob-gap-warn" in err
        else:
            assert err == ""
    assert sampled_entropy_estimate(data) == pytest.approx((1.0 + 2.0 + 0.5) / 3)
    stale = {"step": 4, "logprob_diff_mean": 2.0, "logprob_diff_max": 3.0, "staleness_max": 1}
    assert not warn_on_logprob_gap(stale)  # the asynchronous loop: an older policy's samples differ by design


def test_run_dir_holds_json_lines_unchanged_by_sinks(tmp_path):
    run = run_dir(tmp_path)
    with run.sinks_open():
        run.log(rl_record(0))
    assert json.loads((run.path / "metrics.jsonl").read_text())["prompts"] == [3, 1, 2]
    run.close()
