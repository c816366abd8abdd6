"""math_verify scoring throughput of a Rubric: threads per process x reward processes.

    .venv/bin/python bench/scoring.py [--samples 512] [--group 8] [--repeats 3] [--out bench/results/scoring.json]

Synthetic GSM8K-like completions (a few lines of arithmetic, then the answer as '#### n', '\\boxed{n}', 'The answer
is n.' or a fraction; about a third wrong), G completions per gold answer as in a GRPO batch. Each configuration
scores its own fresh golds, so the gold-parse cache starts cold as it does for a new batch. Processes are a
multiprocessing Pool (spawn) of Rubric copies sent with cloudpickle, as the reward actors receive them; each
scores a contiguous share of the batch. Checks every configuration's rewards against the known right answers (a
thread-safety check too), prints a table with ratios to the 1-thread/1-process run of the same invocation, and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import time
from fractions import Fraction
from pathlib import Path

import cloudpickle

_RS = None  # this worker process's Rubric


def _init_worker(pickled: bytes, ready) -> None:
    global _RS
    _RS = cloudpickle.loads(pickled)
    warm = make_batch(64, 2, seed=-1)  # imports sympy, math_verify and their lazy parts here, outside the timing
    _RS.score(warm[0], warm[1])
    ready.wait()


def _score(chunk: tuple[list[str], list[dict]]) -> list[tuple[float, dict[str, str]]]:
    return [(s.reward, s.failures) for s in _RS.score(*chunk)]


def make_batch(n: int, group: int, seed: int) -> tuple[list[str], list[dict], list[float]]:
    """n completions, `group` per gold, and the reward each should get."""
    rng = random.Random(seed)
    completions, rows, expected = [], [], []
    for _ in range(n // group):
        a, b, c = rng.randint(2, 500), rng.randint(2, 500), rng.randint(2, 9)
        fraction = rng.random() < 0.2
        gold = Fraction(a + b, c) if fraction else Fraction((a + b) * c)
        gold_text = f"\\frac{{{gold.numerator}}}{{{gold.denominator}}}" if fraction else f"{int(gold):,}"
        solution = f"She has {a} + {b} = {a + b} apples.\n{'Split' if fraction else 'Times'} {c}.\n#### {gold_text}"
        row = {"prompt": f"{a} and {b} apples, {c} ...?", "answer": solution}
        for _ in range(group):
            right = rng.random() < 0.67
            value = gold if right else gold + rng.choice([1, -1, Fraction(1, 2)])
            shown = f"{float(value):g}" if value.denominator in (2, 4, 5) and rng.random() < 0.5 else None
            shown = shown or (f"{value.numerator}/{value.denominator}" if value.denominator != 1 else str(value))
            work = f"First, {a} + {b} = {a + b}.\nThen {'divide' if fraction else 'multiply'} by {c}.\n"
            end = rng.choice([f"#### {shown}", f"So the answer is \\boxed{{{shown}}}.", f"The answer is {shown}."])
            completions.append(work + end)
            rows.append(row)
            expected.append(1.0 if value == gold else 0.0)
    return completions, rows, expected


def run_config(threads: int, procs: int, batches: list) -> dict:
    from meshrl.rewards import Rubric, ScoringConfig

    pickled = cloudpickle.dumps(Rubric({"math_verify": 1.0}, ScoringConfig(num_threads=threads)))
    times = []
    ctx = mp.get_context("spawn")
    ready = ctx.Barrier(procs + 1)  # Pool() returns before its workers have started: time none of that
    with ctx.Pool(procs, initializer=_init_worker, initargs=(pickled, ready)) as pool:
        ready.wait(timeout=300)
        for completions, rows, expected in batches:
            step = -(-len(completions) // procs)
            chunks = [(completions[i : i + step], rows[i : i + step]) for i in range(0, len(completions), step)]
            t0 = time.perf_counter()
            got = [x for part in pool.map(_score, chunks, chunksize=1) for x in part]
            times.append(time.perf_counter() - t0)
            bad = [(c, f) for (r, f), e, c in zip(got, expected, completions, strict=True) if r != e]
            if bad:
                raise AssertionError(
                    f"threads={threads} procs={procs}: {len(bad)} rewards differ from the known answers, e.g. "
                    f"{bad[0][0]!r} (failures: {bad[0][1]})"
                )
    n = len(batches[0][0])
    return {"threads": threads, "procs": procs, "seconds": times, "samples_per_s": n / statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=512, help="completions per scored batch")
    ap.add_argument("--group", type=int, default=8, help="completions per gold answer (GRPO group size)")
    ap.add_argument("--threads", default="1,4,8", help="num_threads values")
    ap.add_argument("--procs", default="1,2", help="reward process counts")
    ap.add_argument("--repeats", type=int, default=3, help="batches per configuration (median reported)")
    ap.add_argument("--out", default="bench/results/scoring.json")
    args = ap.parse_args()

    load_before = os.getloadavg()[0]  # other jobs on the machine skew every row: keep it beside the numbers
    results = []
    for procs in map(int, args.procs.split(",")):
        for threads in map(int, args.threads.split(",")):
            # Fresh golds per configuration and repeat (seeded), so no run rides on another's parse cache.
            seed = 1000 * procs + 100 * threads
            batches = [make_batch(args.samples, args.group, seed + r) for r in range(args.repeats)]
            res = run_config(threads, procs, batches)
            results.append(res)
            print(f"procs={procs} threads={threads}: {res['samples_per_s']:.0f} samples/s", flush=True)

    base = next(r for r in results if r["threads"] == 1 and r["procs"] == 1)["samples_per_s"]
    for r in results:
        r["ratio_vs_1t1p"] = r["samples_per_s"] / base
    out = {
        "bench": "scoring",
        "reward": "math_verify=1.0",
        "samples": args.samples,
        "group": args.group,
        "repeats": args.repeats,
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "load_avg_1m_before_after": [load_before, os.getloadavg()[0]],
        },
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")

    print(
        f"\nmath_verify scoring, {args.samples} samples, {args.group} per gold, median of {args.repeats}, "
        f"{os.cpu_count()} CPUs, load {load_before:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    print(f"{'procs':>5} {'threads':>7} {'samples/s':>10} {'vs 1t/1p':>9}")
    for r in results:
        print(f"{r['procs']:>5} {r['threads']:>7} {r['samples_per_s']:>10.0f} {r['ratio_vs_1t1p']:>8.2f}x")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
