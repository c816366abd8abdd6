"""Weight sync time against the number of trainer ranks, through the real Controller (issue 19, item 4).

    python bench/weight_sync_ranks.py                 # CPU: Qwen3-shaped ~60M-param model, 1 / 2 / 4 trainer ranks
    python bench/weight_sync_ranks.py --gpu           # GPU: Qwen3-0.6B shape, one rank: torchstore beside CUDA IPC
    python bench/weight_sync_ranks.py --tiny          # smoke test of the script (not a result)

Each configuration runs in a process of its own with its own Controller: a PolicyTrainer mesh of N ranks (FSDP2, fp32
master weights), one Generator (transformers engine) and the run's torchstore. Per version, `WeightSync.sync(v)`
publishes the trainer's weights (cast to bf16) and waits until the generator has loaded them: push = the trainer
ranks' publish, pull = the generator's fetch + load; end to end = both. Modes, in the same run:
- sharded (the default): each rank puts its own shards into its own storage volume (`weight_sync/shards.py`),
  through shared memory where client and volume share a host (`weight_sync/torchstore_shm.py`);
- sharded-msg: the same, every byte inside Monarch messages (MESHRL_TORCHSTORE_SHM=0, as across hosts);
- gather (the baseline): the whole model gathered to rank 0, which alone puts it, inside Monarch messages (the
  layout before this change, with the same chunked transfer; `set_weight_sync(..., gather=True)`);
- cuda_ipc (GPU only): the same-GPU shared buffer, for reference.
The first version (allocations, connections) is not in the medians. After the last version the generator's
logprobs are compared with the trainer's (same weights: the difference is rounding).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import ensure_meshrl_layout, environment, print_table, write_json

CPU_SHAPE = dict(
    vocab_size=32768, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True,
)  # fmt: skip


def make_model(path: Path, shape: dict) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if not (path / "config.json").exists():
        cfg = Qwen3Config(
            **shape, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, architectures=["Qwen3ForCausalLM"]
        )
        torch.manual_seed(0)
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        with torch.device(dev):
            Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return str(path)


def run(model_dir: str, ranks: int, mode: str, versions: int, on_gpu: bool, backend: str) -> dict:
    from meshrl.config import GeneratorConfig, ModelConfig, TrainerConfig
    from meshrl.controller.api import Controller

    model_cfg = ModelConfig(path=model_dir, backend=backend, dtype="bfloat16" if on_gpu else "float32")
    trainer_cfg = TrainerConfig(num_procs=ranks, device="cuda" if on_gpu else "cpu")
    gen_cfg = GeneratorConfig(
        engine="transformers", dtype="bfloat16", max_model_len=64, max_num_seqs=4, max_tokens=4,
        weight_sync="cuda_ipc" if mode == "cuda_ipc" else "torchstore",
        **({"kv_cache_memory_bytes": 2**30} if on_gpu else {}),
    )  # fmt: skip
    t0 = time.perf_counter()
    with Controller(
        model_dir=model_dir, model_cfg=model_cfg, trainer_cfg=trainer_cfg, generator_cfg=gen_cfg,
        reward_weights={"char_match": 1.0}, call_timeout_s=600,
    ) as ctl:  # fmt: skip
        start_s = time.perf_counter() - t0
        if mode == "gather":
            ctl.trainer.mesh.set_weight_sync.call(ctl.weights.transport, ctl.store_name, True).get(timeout=120)
        timings = [ctl.weights.sync(v) for v in range(1, versions + 1)]
        from meshrl.types import Datum

        probe = [list(range(1 + i, 33 + i)) for i in range(4)]  # 4: splits evenly over 1, 2 or 4 ranks
        gen_lp = ctl.prompt_logprobs(probe).result()
        trainer_lp = ctl.forward([Datum(tokens=p, loss_mask=[1.0] * 31) for p in probe]).result()
        diff = max(abs(a - b) for g, t in zip(gen_lp, trainer_lp, strict=True) for a, b in zip(g, t, strict=True))
    measured = timings[1:] or timings
    push = statistics.median(t.push_s for t in measured)
    pull = statistics.median(t.pull_s for t in measured)
    return {
        "ranks": ranks, "mode": mode, "sync_s": push + pull, "push_s": push, "pull_s": pull,
        "bytes": timings[-1].bytes, "versions": versions, "max_logprob_diff": diff, "controller_start_s": start_s,
    }  # fmt: skip


def one(spec: str) -> None:
    """Child process: one configuration; prints its result as the last line (JSON)."""
    model_dir, ranks, mode, versions, on_gpu, backend = json.loads(spec)
    ensure_meshrl_layout()
    print("RESULT " + json.dumps(run(model_dir, ranks, mode, versions, on_gpu, backend)), flush=True)


def run_in_child(model_dir: str, ranks: int, mode: str, args) -> dict:
    env = dict(os.environ, MESHRL_TORCHSTORE_SHM="0" if mode in ("sharded-msg", "gather") else "1")
    spec = json.dumps([model_dir, ranks, mode, args.versions, args.gpu, args.backend])
    proc = subprocess.run(
        [sys.executable, __file__, "--one", spec], env=env, capture_output=True, text=True, timeout=args.timeout
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        return {"ranks": ranks, "mode": mode, "error": f"exit {proc.returncode}: {tail}"}
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="store_true", help="Qwen3-0.6B shape on the GPU, one trainer rank")
    ap.add_argument("--tiny", action="store_true", help="a tiny model, 1 and 2 ranks: checks the script runs")
    ap.add_argument("--ranks", default=None, help="comma-separated trainer rank counts (default 1,2,4; GPU: 1)")
    ap.add_argument("--modes", default=None, help="comma-separated: sharded, sharded-msg, gather, cuda_ipc (GPU)")
    ap.add_argument("--versions", type=int, default=4, help="versions synced per configuration (first not counted)")
    ap.add_argument("--backend", default="hf", help="trainer backend: hf or titan (titan needs torch 2.13 on GPU)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per configuration")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        return one(args.one)
    from common import QWEN3_06B, TINY

    shape = TINY if args.tiny else (QWEN3_06B if args.gpu else CPU_SHAPE)
    ranks = [int(r) for r in (args.ranks or ("1" if args.gpu else "1,2" if args.tiny else "1,2,4")).split(",")]
    default_modes = "sharded,sharded-msg,gather" + (",cuda_ipc" if args.gpu else "")
    modes = (args.modes or default_modes).split(",")
    tmp = Path(tempfile.mkdtemp(prefix="meshrl-sync-"))
    model_dir = make_model(tmp / "model", shape)
    results = []
    for n in ranks:
        for mode in modes:
            if mode == "cuda_ipc" and n > 1:
                continue
            results.append(run_in_child(model_dir, n, mode, args))
            print(results[-1], flush=True)
    ok = [r for r in results if "error" not in r]
    base = {r["ranks"]: r["sync_s"] for r in ok if r["mode"] == "gather"}
    rows = [
        [
            r["ranks"], r["mode"], f"{r['sync_s'] * 1e3:.0f}", f"{r['push_s'] * 1e3:.0f}", f"{r['pull_s'] * 1e3:.0f}",
            f"{base[r['ranks']] / r['sync_s']:.2f}x" if r["ranks"] in base else "-",
            f"{r['bytes'] / 2**20:.0f}", f"{r['max_logprob_diff']:.1e}",
        ]
        for r in ok
    ]  # fmt: skip
    print_table(
        "weight sync vs trainer ranks (median of versions 2..N)",
        ["ranks", "mode", "sync ms", "push ms", "pull ms", "vs gather", "MiB", "max |dlogprob|"],
        rows,
    )
    for r in results:
        if "error" in r:
            print(f"FAILED ranks={r['ranks']} mode={r['mode']}: {r['error']}")
    name = "weight_sync_ranks_gpu" if args.gpu else "weight_sync_ranks_tiny" if args.tiny else "weight_sync_ranks_cpu"
    print(write_json(name, {"env": environment(), "shape": shape, "results": results}))


if __name__ == "__main__":
    main()
