"""SFT throughput with and without sequence packing, on examples of varied length.

    .venv/bin/python bench/sft_packing.py [--backend torchtitan|hf] [--out bench/results/sft_packing.json]

One trainer rank in this process (torch.distributed with gloo on CPU, NCCL on GPU), the real Policy
(`forward_backward` + `optim_step`, torchtitan Qwen3 or the same checkpoint through transformers). The same
examples go through both paths; throughput counts only real tokens (prompt + response), so padding is pure
cost. Prints a table last and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="default: bench/results/sft_packing[_hf].json")
    ap.add_argument("--backend", default="torchtitan", choices=["torchtitan", "hf"])
    ap.add_argument("--examples", type=int, default=64, help="examples per optimiser step")
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--pack-len", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=8, help="rows per forward_backward call")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    args.out = args.out or f"bench/results/sft_packing{'' if args.backend == 'torchtitan' else '_' + args.backend}.json"

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29717")
    from meshrl.config import ModelConfig, TrainerConfig
    from meshrl.data.sft import SFTExample, pack_examples
    from meshrl.models.qwen3 import create_random_checkpoint
    from meshrl.policy import policy_from_env
    from meshrl.tokenizer import CharTokenizer
    from meshrl.types import Datum, LossSpec, OptimParams

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = CharTokenizer("abcdefghijklmnopqrstuvwxyz=")
    model_dir = create_random_checkpoint(Path(tempfile.mkdtemp()) / "m", flavor="tiny", tokenizer=tok, seed=0)
    hf_cfg = json.loads((model_dir / "config.json").read_text())
    hf_cfg["max_position_embeddings"] = max(args.pack_len, args.max_len)
    (model_dir / "config.json").write_text(json.dumps(hf_cfg))
    trainer_cfg = TrainerConfig(num_procs=1, device=device, pack_sequences=False)  # rows packed by hand below
    policy = policy_from_env(str(model_dir), ModelConfig(backend=args.backend), trainer_cfg)
    rng = random.Random(0)

    def batch() -> list[SFTExample]:
        out = []
        for _ in range(args.examples):
            n = rng.randint(args.min_len, args.max_len)
            p = max(1, n // 4)
            out.append(
                SFTExample(
                    [rng.randrange(4, tok.vocab_size) for _ in range(p)],
                    [rng.randrange(4, tok.vocab_size) for _ in range(n - p - 1)] + [tok.eos_id],
                )
            )
        return out

    def step(rows: list[Datum]) -> None:
        spec = LossSpec("cross_entropy", num_loss_tokens=sum(d.num_loss_tokens for d in rows))
        for i in range(0, len(rows), args.micro_batch):
            policy.forward_backward(rows[i : i + args.micro_batch], spec)
        policy.optim_step(OptimParams(lr=1e-4))

    results = {}
    for mode in ("padded", "packed"):
        step([Datum.from_completion(e.prompt_ids, e.response_ids) for e in batch()])  # warm-up
        real_tokens, computed_tokens, t = 0, 0, 0.0
        for _ in range(args.steps):
            examples = batch()
            if mode == "packed":
                rows = pack_examples(examples, args.pack_len)
            else:
                rows = [Datum.from_completion(e.prompt_ids, e.response_ids) for e in examples]
            real_tokens += sum(len(e) for e in examples)
            chunks = [rows[i : i + args.micro_batch] for i in range(0, len(rows), args.micro_batch)]
            computed_tokens += sum(len(c) * max(len(r.tokens) for r in c) for c in chunks)  # incl. padding
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(rows)
            if device == "cuda":
                torch.cuda.synchronize()
            t += time.perf_counter() - t0
        results[mode] = {
            "real_tokens_per_s": real_tokens / t,
            "padding_fraction": 1 - real_tokens / computed_tokens,
            "seconds": t,
        }

    speedup = results["packed"]["real_tokens_per_s"] / results["padded"]["real_tokens_per_s"]
    report = {
        "device": device,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "args": vars(args),
        "results": results,
        "packed_over_padded": speedup,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    lengths = f"{args.min_len}-{args.max_len} tokens"
    print(f"\nSFT packing, tiny Qwen3 ({args.backend} backend), {args.examples} examples/step of {lengths}, {device}")
    print(f"{'mode':<8} {'real tok/s':>12} {'padding':>9}")
    for mode, r in results.items():
        print(f"{mode:<8} {r['real_tokens_per_s']:>12.0f} {r['padding_fraction']:>8.1%}")
    print(f"packed / padded: {speedup:.2f}x   (JSON: {args.out})")


if __name__ == "__main__":
    main()
