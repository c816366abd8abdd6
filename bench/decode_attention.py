"""The transformers engine's decode attention kernel alone (meshrl.generation.transformers_engine.kernels), one GPU:
its launch tuning swept against the current default and against torch's SDPA on the same cache, at the long-
context decode of the 16 x 8 x 2048 GRPO job (128 rows, Qwen3-0.6B's 16 query / 8 kv heads of 128, bf16).

    python bench/decode_attention.py            # on the GPU
    python bench/decode_attention.py --tiny     # smoke test of the script (Triton's interpreter on CPU: not a result)

Each row: median time of one layer's decode attention over `--iters` launches, the bytes of K and V it must read
(rows x kv heads x context x head dim x 2 tensors x 2 bytes) over that time, and the ratio to the default launch at
that context. The default is what `decode_attention_triton` uses without keyword arguments. Rows 'fp8 ...': the same
cache quantized to fp8 with a scale per (token, kv head) (`--generator.transformers.kv_cache_dtype fp8`), the default
launch and the best of a small sweep (fp8 tiles take half the shared memory), bytes counted as fp8 + scales, 'max
err' against the bf16 cache's output.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys

import torch

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

from common import environment, median, print_table, write_json  # noqa: E402

from meshrl.generation.transformers_engine.kernels import (  # noqa: E402
    decode_attention_triton,
    fp8_decode_launch,
    quantize_kv,
)


def time_ms(fn, iters: int, dev: torch.device) -> float:
    fn()
    if dev.type != "cuda":
        return float("nan")
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="small shapes, Triton's interpreter on CPU (a smoke test)")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--contexts", default="512,1024,2048", help="comma-separated context lengths")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    rows, heads, kv_heads, dim = (args.rows, 16, 8, 128) if not args.tiny else (2, 4, 2, 16)
    contexts = [int(c) for c in args.contexts.split(",")] if not args.tiny else [40]
    max_len = max(contexts) + 32
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = torch.Generator(dev).manual_seed(0)
    k_cache = torch.randn(rows, kv_heads, max_len, dim, generator=gen, device=dev, dtype=dtype)
    v_cache = torch.randn(rows, kv_heads, max_len, dim, generator=gen, device=dev, dtype=dtype)
    q = torch.randn(rows, heads, dim, generator=gen, device=dev, dtype=dtype)
    scale = dim**-0.5
    grid = (
        [dict(block_n=bn, num_warps=w, num_stages=st, min_programs=mp)
         for bn, w, st, mp in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (1024, 4096))]
        if not args.tiny else [dict(block_n=16, num_warps=1, num_stages=1, min_programs=1)]
    )  # fmt: skip
    fp8_grid = (
        [dict(block_n=bn, num_warps=w, num_stages=st)
         for bn, w, st in itertools.product((64, 128, 256), (4, 8), (2, 3, 4))]
        if not args.tiny else []
    )  # fmt: skip
    (k8, k_scale), (v8, v_scale) = quantize_kv(k_cache), quantize_kv(v_cache)
    table = []
    for context in contexts:
        pos = torch.full((rows,), context - 1, dtype=torch.int64, device=dev)
        bytes_read = rows * kv_heads * context * dim * 2 * k_cache.element_size()
        attend = functools.partial(decode_attention_triton, q, k_cache, v_cache, pos, context, scale)
        ref = attend()
        default_ms = time_ms(attend, args.iters, dev)
        sdpa = functools.partial(
            torch.nn.functional.scaled_dot_product_attention,
            q.view(rows, kv_heads, heads // kv_heads, dim), k_cache[:, :, :context], v_cache[:, :, :context],
            scale=scale,
        )  # fmt: skip
        here = [
            dict(launch="default", ms=default_ms, max_err=0.0),
            dict(launch="torch sdpa", ms=time_ms(sdpa, args.iters, dev), max_err=None),
        ]
        for cfg in grid:
            launch = functools.partial(attend, **cfg)
            err = float((launch().float() - ref.float()).abs().max())
            here.append(dict(launch=cfg, ms=time_ms(launch, args.iters, dev), max_err=err, sweep="bf16"))
        for r in here:
            r["bytes"] = bytes_read
        attend8 = functools.partial(
            decode_attention_triton, q, k8, v8, pos, context, scale, k_scale=k_scale, v_scale=v_scale
        )
        fp8_bytes = rows * kv_heads * context * (dim + 4) * 2
        engine_launch = fp8_decode_launch(dim)
        named = [("fp8 default", {}), (f"fp8 engine {engine_launch}", engine_launch)]
        for name, cfg, sweep in [(n, c, None) for n, c in named] + [(f"fp8 {c}", c, "fp8") for c in fp8_grid]:
            launch = functools.partial(attend8, **cfg)
            err = float((launch().float() - ref.float()).abs().max())
            ms = time_ms(launch, args.iters, dev)
            here.append(dict(launch=name, ms=ms, max_err=err, bytes=fp8_bytes, sweep=sweep))
        for r in here:
            r["context"] = context
            r["GB/s"] = r["bytes"] / (r["ms"] / 1e3) / 1e9 if r["ms"] == r["ms"] else None
            r["x default"] = default_ms / r["ms"] if r["ms"] == r["ms"] else None
        table += here
    best = {}  # (sweep, context) -> its fastest launch
    for r in table:
        key = (r.get("sweep"), r["context"])
        if r.get("sweep") and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    shown = [r for r in table if not r.get("sweep")] + list(best.values())
    shown.sort(key=lambda r: r["context"])
    print_table(
        f"Decode attention, {rows} rows, {heads}/{kv_heads} x {dim}, {environment()['device']}, best of the sweep",
        ["context", "launch", "ms", "GB/s", "x default", "max err"],
        [[r["context"], str(r["launch"]), r["ms"], r["GB/s"], r["x default"], r["max_err"]] for r in shown],
    )
    print(f"\nwrote {write_json('decode_attention', {'env': environment(), 'args': vars(args), 'rows': table})}")


if __name__ == "__main__":
    main()
