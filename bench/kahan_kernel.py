"""The optimiser step alone, on Qwen3-0.6B-shaped bf16 tensors (random weights and gradients), one GPU: what the
fused kahan kernel (meshrl.optim_kernels) costs against the torch formulation of the same step and against
plain bf16 AdamW rounded to nearest, eager and in a CUDA graph, in one run.

    python bench/kahan_kernel.py            # on the GPU
    python bench/kahan_kernel.py --tiny     # CPU smoke test of the script (the kernel needs CUDA: not a result)

Configurations (all FusedAdamW's `clip_and_step(1.0)`: grad norm, clip, AdamW, gradients zeroed):
  nearest        bf16 weights and state, each update rounded to nearest (torch's fused kernel; unsafe at lr 1e-6)
  fp32           float32 weights and state (the fp32-master step; the bf16 copy the forward pass reads is not
                 counted: the hf backend's FSDP casts it in the forward)
  kahan-torch    bf16 + kahan, the torch formulation (MESHRL_FUSED_KAHAN=0: float32 scratch, torch's kernel)
  kahan-kernel   bf16 + kahan, the fused Triton kernel
each eager and `+graph` (cuda_graph=True). bytes/param: the memory traffic an ideal step needs, for the GB/s
column (nearest 2+2+2+2 read, 2+2+2 written, +2 for the gradient zeroing: 16; kahan: +4 for the comp; fp32: 32+2).
"""

from __future__ import annotations

import argparse
import time

import torch
from common import device, environment, median, print_table, sync, write_json

from meshrl.optim import FusedAdamW

# Qwen3-0.6B: vocab 151 936 x hidden 1024 (tied), 28 layers of q/k/v/o (16 x 128 heads, 8 kv heads),
# gate/up/down (3072), norms.
LAYER = [(2048, 1024), (1024, 1024), (1024, 1024), (1024, 2048), (3072, 1024), (3072, 1024), (1024, 3072)]
QWEN3_0_6B = [(151_936, 1024)] + 28 * (LAYER + [(1024,), (1024,), (128,), (128,)])
TINY = [(1000, 64)] + 2 * [(64, 64), (128, 64), (64, 128), (64,), (8,)]
CONFIGS = ["nearest", "fp32", "kahan-torch", "kahan-kernel"]
BYTES = {"nearest": 16, "fp32": 34, "kahan-torch": 20, "kahan-kernel": 20}


def run(config: str, graph: bool, shapes, dev: torch.device, steps: int, warmup: int) -> dict:
    dtype = torch.float32 if config == "fp32" else torch.bfloat16
    gen = torch.Generator(dev).manual_seed(0)
    params = [torch.nn.Parameter(0.02 * torch.randn(s, generator=gen, device=dev, dtype=dtype)) for s in shapes]
    opt = FusedAdamW(params, lr=1e-6, betas=(0.9, 0.95), weight_decay=0.01, cuda_graph=graph,
                     bf16_rounding="nearest" if config in ("nearest", "fp32") else "kahan")  # fmt: skip
    opt.fused_kahan = config == "kahan-kernel"
    grads = [1e-3 * torch.randn(s, generator=gen, device=dev, dtype=torch.bfloat16) for s in shapes]
    times = []
    for i in range(warmup + steps):
        for p, g in zip(params, grads, strict=True):
            if p.grad is None:
                p.grad = g.to(dtype)
            else:
                p.grad.copy_(g)
        sync(dev)
        t = time.perf_counter()
        opt.clip_and_step(1.0)
        sync(dev)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    numel = sum(p.numel() for p in params)
    kernel = any(k is not None for k in getattr(opt, "_kernels", {}).values())
    ms = median(times) * 1e3
    return {
        "config": config + ("+graph" if graph else ""),
        "ms": ms,
        "GB/s": BYTES[config] * numel / (ms / 1e3) / 1e9,
        "graphed": opt._graph is not None,
        "kernel": kernel,
        "params": numel,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny tensors, CPU allowed (a smoke test)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per configuration (median reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile, graph capture)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {CONFIGS}")
    args = ap.parse_args()
    dev = device()
    shapes = TINY if args.tiny else QWEN3_0_6B
    graphs = (False, True) if dev.type == "cuda" else (False,)
    rows = []
    for config in args.configs.split(","):
        if config not in CONFIGS:
            raise SystemExit(f"--configs: unknown {config!r}; expected some of {CONFIGS}")
        for graph in graphs:
            rows.append(run(config, graph, shapes, dev, args.steps, args.warmup))
            torch.cuda.empty_cache() if dev.type == "cuda" else None
    base = {r["config"]: r["ms"] for r in rows}
    for r in rows:
        plain = base.get("nearest+graph" if r["config"].endswith("+graph") else "nearest")
        r["vs nearest"] = r["ms"] / plain if plain else None
    print_table(
        f"Optimiser step, {rows[0]['params'] / 1e6:.0f}M parameters, {environment()['device']}",
        ["config", "ms", "vs nearest", "GB/s", "graphed", "kernel"],
        [[r["config"], r["ms"], r["vs nearest"], r["GB/s"], r["graphed"], r["kernel"]] for r in rows],
    )
    print(f"\nwrote {write_json('kahan_kernel', {'env': environment(), 'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
