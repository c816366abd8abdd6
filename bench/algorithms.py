"""GRPO, DAPO, Dr.GRPO, GSPO and CISPO on the built-in task: same warm start, seed and step budget.

    .venv/bin/python bench/algorithms.py [--steps 60] [--out runs/bench_algorithms] [-- extra CLI flags for every run]

One supervised warm-up (the main job's, through the same endpoints) produces a shared starting checkpoint; each
algorithm then runs `meshrl.controller.grpo` from it as a user would (CLI flags only). Prints a table last and
writes `algorithms.json` (and `algorithms.md`, the README table) into the output dir.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# The flags that make each algorithm (meshrl.algorithms' docstring); everything else is the preset's.
ALGORITHMS: dict[str, list[str]] = {
    "GRPO": [],
    "DAPO": ["--grpo.clip-high", "0.28", "--grpo.dynamic-sampling", "--grpo.overlong-buffer", "2"],
    "Dr.GRPO": ["--grpo.advantage", "group_mean", "--grpo.aggregation", "token_sum_norm"],
    "GSPO": ["--grpo.loss", "gspo"],
    "CISPO": ["--grpo.loss", "cispo"],
}


def run(args: list[str], log: Path) -> dict:
    cmd = [sys.executable, "-m", "meshrl.controller.grpo", "--preset", "tiny-reverse", *args]
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}); see {log}")
    return {"wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="RL steps per algorithm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/bench_algorithms")
    ap.add_argument("--only", nargs="*", default=None, help="a subset of: " + ", ".join(ALGORITHMS))
    ap.add_argument("extra", nargs="*", help="flags passed to every run (after --)")
    a = ap.parse_args()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    common = ["--run.output-dir", str(out), "--run.seed", str(a.seed), *a.extra]

    warm = out / "warm_start"
    if not (warm / "final_model" / "config.json").is_file():
        print("[bench] supervised warm-up (shared starting checkpoint)...", flush=True)
        run([*common, "--run.name", "warm_start", "--grpo.steps", "0"], out / "warm_start.log")
    start = ["--model.path", str(warm / "final_model"), "--warmup.steps", "0", "--grpo.steps", str(a.steps)]

    results = {}
    for name, flags in ALGORITHMS.items():
        if a.only and name not in a.only:
            continue
        print(f"[bench] {name}: {' '.join(flags) or '(defaults)'}", flush=True)
        run_name = name.replace(".", "").lower()
        info = {}
        if not (out / run_name / "summary.json").is_file():  # a finished run is kept (delete it to redo it)
            info = run([*common, *start, *flags, "--run.name", run_name], out / f"{run_name}.log")
        summary = json.loads((out / run_name / "summary.json").read_text())
        rl = [json.loads(line) for line in (out / run_name / "metrics.jsonl").read_text().splitlines()]
        rl = [r for r in rl if r.get("phase") == "rl"]
        results[name] = {
            "flags": " ".join(flags),
            "reward_first5": summary["reward_first5_mean"],
            "reward_last5": summary["reward_last5_mean"],
            "eval_exact_match_before": summary["eval_accuracy_before_rl"],
            "eval_exact_match_after": summary["eval_accuracy_after_rl"],
            "steps_trained": len(rl),
            **info,
        }
    (out / "algorithms.json").write_text(json.dumps({"steps": a.steps, "seed": a.seed, "results": results}, indent=2))

    header = (
        "| algorithm | flags | reward, first 5 steps | reward, last 5 steps | held-out exact match before → after |"
    )
    lines = [header, "| --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        lines.append(
            f"| {name} | `{r['flags'] or '(defaults)'}` | {r['reward_first5']:.3f} | {r['reward_last5']:.3f} | "
            f"{r['eval_exact_match_before']:.2f} → {r['eval_exact_match_after']:.2f} |"
        )
    table = "\n".join(lines)
    (out / "algorithms.md").write_text(table + "\n")
    print(f"\n{a.steps} RL steps each, seed {a.seed}, from one warm start ({out})\n{table}")


if __name__ == "__main__":
    main()
