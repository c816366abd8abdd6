"""The asynchronous GRPO loop against the synchronous one, on the CPU main job, in the same run.

    python bench/grpo_async_cpu.py                   # the README's main job (--preset tiny-reverse), K = 0 and 1
    python bench/grpo_async_cpu.py --rounds 2 --seed 1 --extra --grpo.steps 20

Each configuration runs the real program (`python -m meshrl.controller.grpo`, a subprocess, its own actors) with
the same seed; K = 0 first, then K = 1, alternating over rounds. Reported: the RL phase's wall time (the sum of the
RL steps' own durations, evaluations excluded), its ratio to K = 0 of the same round, and the learning target
(sampled reward, first 5 → last 5 steps; held-out accuracy before → after RL). Prints a table, writes
bench/results/grpo_async_cpu.json (or $OUT/).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, environment, print_table, write_json


def run(k: int, seed: int, out: Path, extra: list[str]) -> dict:
    name = f"k{k}-s{seed}-{int(time.time())}"
    cmd = [
        sys.executable, "-m", "meshrl.controller.grpo", "--preset", "tiny-reverse", "--grpo.max-staleness", str(k),
        "--run.seed", str(seed), "--model.seed", str(seed), "--run.output-dir", str(out), "--run.name", name, *extra,
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl"]
    summary = json.loads((out / name / "summary.json").read_text())
    return {
        "k": k,
        "seed": seed,
        "rl_wall_s": sum(r["time_step_s"] for r in rl),
        "program_wall_s": wall,
        "generate_wait_s": sum(r["time_generate_s"] for r in rl),
        "train_s": sum(r["time_train_s"] for r in rl),
        "reward_first5": summary["reward_first5_mean"],
        "reward_last5": summary["reward_last5_mean"],
        "reward_gain": summary["reward_gain"],
        "eval_before": summary["eval_accuracy_before_rl"],
        "eval_after": summary["eval_accuracy_after_rl"],
        "staleness_mean": sum(r.get("staleness_mean", 0.0) for r in rl) / len(rl),
        "run_dir": str(out / name),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more flags for both programs")
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="grpo_async_"))
    results = []
    for r in range(args.rounds):
        base = run(0, args.seed, out, args.extra)
        base["round"] = r
        results.append(base)
        for k in (1,):
            res = run(k, args.seed, out, args.extra)
            res["round"], res["ratio"] = r, res["rl_wall_s"] / base["rl_wall_s"]
            results.append(res)
        base["ratio"] = 1.0
    rows = [
        [
            x["round"], x["k"], x["rl_wall_s"], x["ratio"], x["generate_wait_s"], x["train_s"], x["staleness_mean"],
            f"{x['reward_first5']:.3f} → {x['reward_last5']:.3f}", f"{x['eval_before']:.3f} → {x['eval_after']:.3f}",
        ]
        for x in results
    ]  # fmt: skip
    print_table(
        "GRPO main job (tiny-reverse), synchronous (K=0) vs asynchronous (K=1), same seed, same run",
        ["round", "K", "RL wall s", "× K=0", "waiting for generation s", "train s", "staleness", "reward", "held-out"],
        rows,
    )
    path = write_json("grpo_async_cpu", {"environment": environment(), "results": results})
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
