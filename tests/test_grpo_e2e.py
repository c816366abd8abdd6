"""The main job end to end, as a user runs it (a subprocess on the CLI), with a handful of steps; then the
final checkpoint is loaded in transformers and in vLLM."""

import json
import os
import subprocess
import sys

import pytest
import torch

METRIC_FIELDS = {
    "reward_mean",
    "reward_std",
    "loss",
    "grad_norm",
    "lr",
    "policy_version",
    "logprob_diff_mean",
    "logprob_diff_max",
    "tokens_per_s",
    "time_generate_s",
    "time_score_s",
    "time_train_s",
    "time_weight_sync_s",
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    cmd = [
        sys.executable,
        "-m",
        "meshrl.controller.grpo",
        "--preset",
        "tiny-reverse",
        "--log.plots",  # the test suite turns them off elsewhere (tests/conftest.py)
        "--warmup.steps",
        "3",
        "--grpo.steps",
        "3",
        "--grpo.prompts-per-step",
        "4",
        "--trainer.micro-batch-size",
        "16",
        "--warmup.batch-size",
        "16",
        "--reverse.num-train",
        "200",
        "--reverse.num-eval",
        "8",
        "--run.output-dir",
        str(out),
        "--run.name",
        "e2e",
        "--run.call-timeout-s",
        "120",
    ]
    # Processes started cold, as a user's run starts them (the rest of the suite forks them: tests/conftest.py).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MESHRL_PROC_ZYGOTE": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "held-out (correct = exact_match >= 1), before RL: greedy accuracy" in proc.stdout
    assert "supervised warm-up" in proc.stdout
    return out / "e2e"


def test_run_directory_has_config_metrics_plot_and_summary(run_dir):
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["grpo"]["steps"] == 3
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1, 2]
    assert METRIC_FIELDS <= rl[0].keys()
    assert all(r["logprob_diff_max"] < 1e-3 for r in rl)  # generator and trainer agree (fp32)
    assert [r["policy_version"] for r in rl] == [4, 5, 6]  # 3 warm-up steps, then one per RL step
    assert len([r for r in records if r["phase"] == "warmup"]) == 3
    assert {r.get("when") for r in records if r["phase"] == "eval"} == {"before_rl", "after_rl"}
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in (
        "reward_first5_mean",
        "reward_last5_mean",
        "eval_accuracy_before_rl",
        "eval_accuracy_after_rl",
    ):
        assert isinstance(summary[key], float)
    png = (run_dir / "reward_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_directory_has_tensorboard_rollouts_and_dashboard(run_dir, capsys):
    """What a user watches: TensorBoard event files of every phase, rollouts.jsonl (every trained sample of every
    step, with the policy version that sampled it) and training.png, all agreeing with metrics.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from meshrl.controller.grpo import warn_on_logprob_gap
    from meshrl.rollout_recorder import read_rollouts

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl"]
    tb = EventAccumulator(str(run_dir / "tb"))
    tb.Reload()
    got = [(e.step, e.value) for e in tb.Scalars("rl/reward_mean")]
    assert got == [(r["step"], pytest.approx(r["reward_mean"], rel=1e-6)) for r in rl]
    assert [e.step for e in tb.Scalars("warmup/loss")] == [0, 1, 2]
    assert {"eval/accuracy", "rl/grad_norm", "rl/entropy_sampled_est", "rl/time_train_s"} <= set(tb.Tags()["scalars"])

    lines = read_rollouts(run_dir)
    for r in rl:  # 4 prompts x 8 samples, sampled by the weights before the step's update
        step_lines = [x for x in lines if x["step"] == r["step"]]
        assert len(step_lines) == 32
        assert {x["policy_version"] for x in step_lines} == {r["policy_version"] - 1}
        assert sum(x["reward"] for x in step_lines) / 32 == pytest.approx(r["reward_mean"])
        assert sorted({x["prompt_index"] for x in step_lines}) == sorted(r["prompts"])
    assert {"prompt", "answer", "completion", "reward_parts", "correct", "advantage", "finish_reason"} <= set(lines[0])

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["training_plot"].endswith("training.png")
    assert (run_dir / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(r["entropy_sampled_est"] > 0 and r["logprob_gap_warning"] == 0 for r in rl)
    # The warning fires on a real record once its gap passes the threshold (fp32 agrees to ~1e-7 nats here).
    assert warn_on_logprob_gap(dict(rl[0]), threshold=rl[0]["logprob_diff_mean"] / 2)
    assert "WARNING: trainer and generator logprobs differ" in capsys.readouterr().err


def test_final_checkpoint_loads_in_transformers_and_vllm(run_dir):
    from transformers import AutoModelForCausalLM

    from meshrl.generation.vllm_engine import VLLMEngine
    from meshrl.policy import target_logprobs

    ckpt = run_dir / "final_model"
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    seqs = [[4, 5, 6, 12, 6, 5, 4, 1], [7, 8, 12, 8, 7, 1]]
    engine = VLLMEngine(str(ckpt), max_model_len=32, kv_cache_memory_bytes=16 * 2**20)
    try:
        got = engine.prompt_logprobs(seqs)
    finally:
        engine.shutdown()
    for seq, row in zip(seqs, got, strict=True):
        t = torch.tensor([seq])
        with torch.no_grad():
            want = target_logprobs(hf(t).logits, t)[0]
        torch.testing.assert_close(torch.tensor(row), want, rtol=1e-4, atol=1e-4)
