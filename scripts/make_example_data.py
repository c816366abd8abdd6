"""Write GSM8K-style prompt files (JSONL, or Parquet with --format parquet) for trying meshrl's GRPO and eval
programs on a local model, with no download: word problems with a worked answer ending in '#### <number>'.

    python scripts/make_example_data.py --out data/           # data/train.jsonl, data/test.jsonl
    python -m meshrl.controller.grpo --model.path ckpt/qwen3-tiny --data.train data/train.jsonl \\
        --data.eval data/test.jsonl --data.prompt-field question --data.answer-field answer --reward math_verify=1.0

Rows: {"question": "...", "answer": "3 + 4 = 7\\n#### 7", "difficulty": 1}. Held-out questions never occur in the
training file.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ITEMS = ["apples", "marbles", "books", "stamps", "coins", "shells", "pencils", "cards"]
NAMES = ["Tom", "Ana", "Li", "Sam", "Maya", "Omar", "Ivy", "Ben"]


def make_row(rng: random.Random) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    if rng.random() < 0.5:
        question = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        work, result = f"{a} + {b} = {a + b}", a + b
    else:
        a, b = max(a, b), min(a, b)
        question = f"{name} has {a} {item} and gives away {b}. How many {item} are left?"
        work, result = f"{a} - {b} = {a - b}", a - b
    return {"question": question, "answer": f"{work}\n#### {result}", "difficulty": 1 + (result > 20)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for train.* and test.*")
    p.add_argument("--num-train", type=int, default=2000)
    p.add_argument("--num-test", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    a = p.parse_args()
    rng, seen = random.Random(a.seed), set()
    splits: dict[str, list[dict]] = {"train": [], "test": []}
    for split, n in (("train", a.num_train), ("test", a.num_test)):
        for _ in range(50 * n):
            if len(splits[split]) == n:
                break
            row = make_row(rng)
            if row["question"] not in seen:
                seen.add(row["question"])
                splits[split].append(row)
    a.out.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        path = a.out / f"{split}.{a.format}"
        if a.format == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), path)
        else:
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
