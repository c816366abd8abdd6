"""The trainer ranks' last collectives side by side, from the flight-recorder files bench/stall_probe.sh collects
(torch writes one pickle per rank when its NCCL watchdog times a collective out): which rank stopped at which
collective, and where the ranks' sequences part.

    python3 bench/stall_probe.py /tmp/out/fr/gpus4-x4work
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path


def entries(path: Path) -> list[dict]:
    with path.open("rb") as f:
        return pickle.load(f).get("entries", [])


def describe(e: dict) -> str:
    frames = e.get("frames") or []
    where = next((f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in frames
                  if "meshrl" in f.get("filename", "")), "")  # fmt: skip
    return (f"seq {e.get('collective_seq_id')} {e.get('profiling_name')} {e.get('state')} "
            f"in {e.get('input_sizes')} {where}")  # fmt: skip


def main(directory: str) -> None:
    ranks = {p.name: entries(p) for p in sorted(Path(directory).glob("trace_*"))}
    if not ranks:
        print(f"no flight-recorder files in {directory}")
        return
    for name, es in ranks.items():
        print(f"== {name}: {len(es)} collectives recorded; the last 12:")
        for e in es[-12:]:
            print("  ", describe(e))
    seqs = [[(e.get("collective_seq_id"), e.get("profiling_name")) for e in es] for es in ranks.values()]
    for i, column in enumerate(zip(*seqs, strict=False)):
        if len(set(column)) > 1:
            print(f"the ranks part at entry {i}: {column}")
            break


if __name__ == "__main__":
    main(sys.argv[1])
