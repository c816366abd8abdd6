"""Scaling with the GPUs of one host (issue 33), through the real program: `bench/gpu_check.sh` runs
`python -m meshrl.controller.grpo` in each layout at a workload that grows with the GPUs (32 prompts x 8 samples x 256
new tokens per GPU-equivalent of work), and this script reads its rows and reports, against the one-GPU row of the same
call, how each phase scales.

    python3 bench/scaling.py                    # the rows this machine's GPUs allow (1, 2, 4 GPUs), one call
    python3 bench/scaling.py --rows 1gpu gpus2-x2work coloc2-x2work
    python3 bench/scaling.py --from-dir results/h100x4-...   # re-read a call's gpu_check.json (no GPU needed)
    python3 bench/scaling.py --from-dir $OUT/a $OUT/b         # rows of two gpu_check.sh runs of one call, joined

Per row: step time (and per unit of work, against one GPU), generation tokens/s (model tokens over the time some
generator was generating), training tokens/s (tokens over the train phase), weight-sync time, overlap of generation
and training, the trainer's peak memory. Then per phase, tokens/s against the one-GPU row, and the efficiency per
doubling of the GPUs that phase runs on (1.0: each doubling doubles it). Carry `.whl` (../shared/gpu/make-wheels.sh).
Prints the table last and writes $OUT/scaling.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

# Layouts of bench/gpu_check.sh, per GPU count, each at `gpus` times the one-GPU job (weak scaling).
ROWS = {
    1: ["1gpu"],  # trainer and generator share GPU 0, synchronous
    2: ["gpus2-x2work", "coloc2-x2work"],  # split asynchronous (the defaults' layout); colocated, synchronous
    4: ["gpus4-x4work", "gpus4-x4work-defer"],  # split: 2 trainer ranks, 2 generators; FSDP reduce-scatter deferred
}
# GPUs each layout uses, and how many of them train and generate (for the per-phase efficiency).
GPUS = {"1gpu": (1, 1, 1), "gpus2": (2, 1, 1), "gpus2-x2work": (2, 1, 1), "coloc2-x2work": (2, 2, 2),
        "coloc2-mb64": (2, 2, 2), "gpus4": (4, 2, 2), "gpus4-x4work": (4, 2, 2), "gpus4-defer": (4, 2, 2),
        "gpus4-x4work-defer": (4, 2, 2), "gpus4-x4work-b24k": (4, 2, 2), "gpus4-x4work-tstore": (4, 2, 2),
        "gpus4-x4work-1gen": (3, 2, 1), "split-x2work-b32k": (2, 1, 1),
        "split3-2tr-x4work-b32k": (3, 2, 1)}  # fmt: skip


def efficiency(ratio: float, doublings: float) -> float:
    """The per-doubling efficiency that compounds to `ratio` over `doublings` (ideal: ratio = 2**doublings -> 1)."""
    if doublings <= 0 or not ratio > 0:
        return float("nan")
    return (ratio ** (1 / doublings)) / 2


def scaling_table(results: list[dict]) -> list[dict]:
    """Per row of gpu_check.json: the figures and their ratios to the first one-GPU row."""
    ok = [r for r in results if not r.get("failed")]
    # the one-GPU row; without one (a call of other rows only), the first row: ratios are then to it
    base = next((r for r in ok if GPUS.get(r["layout"], (0,))[0] == 1), ok[0] if ok else None)
    rows = []
    for r in results:
        if r.get("failed") or base is None:
            rows.append({"run": r["run"], "failed": True})
            continue
        gpus, trainer_gpus, generator_gpus = GPUS.get(r["layout"], (0, 0, 0))
        train_ratio = r["train_tokens_per_s"] / base["train_tokens_per_s"]
        gen_ratio = r["generate_tokens_per_s"] / base["generate_tokens_per_s"]
        # weak scaling: the step for `work` times the job, against the one-GPU step for the job
        work = r["prompts_per_step"] / base["prompts_per_step"]
        step_per_work = r["step_s"] / work / base["step_s"]
        rows.append({
            "run": r["run"], "layout": r["layout"], "gpus": gpus, "work": work, "step_s": r["step_s"],
            "step_per_work": step_per_work, "weak_efficiency": efficiency(1 / step_per_work, math.log2(gpus or 1)),
            "generate_tokens_per_s": r["generate_tokens_per_s"], "generate_ratio": gen_ratio,
            "generate_efficiency": efficiency(gen_ratio, math.log2(generator_gpus or 1)),
            "train_tokens_per_s": r["train_tokens_per_s"], "train_ratio": train_ratio,
            "train_efficiency": efficiency(train_ratio, math.log2(trainer_gpus or 1)),
            "sync_ms": 1000 * r["sync_s"], "overlap": r["overlap"], "peak_gib": r.get("peak_gib"),
            "logprob_diff_mean": r["logprob_diff_mean"],
        })  # fmt: skip
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'run':20} {'GPUs':>4} {'work':>4} {'step s':>7} {'/work':>6} {'gen tok/s':>9} {'x':>5} "
          f"{'train tok/s':>11} {'x':>5} {'sync ms':>7} {'overlap':>7} {'peak GiB':>8}")  # fmt: skip
    for r in rows:
        if r.get("failed"):
            print(f"{r['run']:20} FAILED")
            continue
        print(f"{r['run']:20} {r['gpus']:4} {r['work']:4.0f} {r['step_s']:7.2f} {r['step_per_work']:6.2f} "
              f"{r['generate_tokens_per_s']:9.0f} {r['generate_ratio']:5.2f} {r['train_tokens_per_s']:11.0f} "
              f"{r['train_ratio']:5.2f} {r['sync_ms']:7.1f} {r['overlap']:7.0%} {r['peak_gib'] or 0:8.1f}")  # fmt: skip
    print(
        "(/work: step time per unit of work over the one-GPU step (weak scaling; 0.5 on 2 GPUs and 0.25 on 4 is "
        "ideal); x: tokens/s over the one-GPU row's; efficiency per doubling in scaling.json.)"
    )
    for r in rows:
        if not r.get("failed") and r["gpus"] > 1:
            print(
                f"{r['run']:20} per doubling: step {r['weak_efficiency']:.2f}, generation "
                f"{r['generate_efficiency']:.2f}, training {r['train_efficiency']:.2f}"
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="*", help="gpu_check.sh layouts (default: ROWS for this machine's GPUs)")
    ap.add_argument("--from-dir", nargs="*", help="directories holding gpu_check.json of one call: read, run nothing")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    if args.from_dir:
        sources = [Path(d) / "gpu_check.json" for d in args.from_dir]
    else:
        import torch

        gpus = torch.cuda.device_count()
        rows = args.rows or [name for n, names in sorted(ROWS.items()) if n <= gpus for name in names]
        here = Path(__file__).resolve().parent
        rc = subprocess.run(["bash", str(here / "gpu_check.sh"), *rows], cwd=here.parent).returncode
        if rc:
            return rc
        sources = [out / "gpu_check.json"]
    table = scaling_table([row for source in sources for row in json.loads(source.read_text())])
    (out / "scaling.json").write_text(json.dumps(table, indent=1))
    print_table(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
