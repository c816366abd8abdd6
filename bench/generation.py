"""Generation throughput: our 'transformers' engine (HFEngine: static KV cache, continuous batching, CUDA-graph
decode steps) beside transformers `generate`, in one run on one GPU.

    python bench/generation.py           # Qwen3-0.6B shape, random weights, bf16, 128-token prompts, 256 new
    python bench/generation.py --tiny    # CPU smoke test of the script (not a result)

Both sample at temperature 1 (no top-k/top-p) and return per-token logprobs (`generate`: output_scores +
compute_transition_scores); the model has no EOS, so every row makes exactly 256 tokens. tokens/s counts new
tokens. HFEngine is timed on its second call of each batch size (the first one captures the CUDA graphs; its
time is reported too). Bandwidth bound: per decode step the weights (tied embedding counted once) plus the KV
of every running row up to its current length must be read; the bound is those bytes over the copy bandwidth
measured in the same run (bytes read + written), and "% of bound" is bound time / measured time.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time

import torch
from common import copy_bandwidth, environment, make_model_dir, peak_gib, print_table, reset_peak, sync, write_json


def hf_generate(model, prompts: torch.Tensor, new_tokens: int) -> tuple[float, int]:
    dev = prompts.device
    sync(dev)
    t0 = time.perf_counter()
    out = model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    # Per-token logprobs of the sampled tokens, step by step (compute_transition_scores stacks all steps'
    # [B, V] float32 scores at once: 37 GiB more at batch 256).
    n_prompt = prompts.shape[1]
    logprobs = torch.stack(
        [torch.log_softmax(s.float(), -1).gather(1, out.sequences[:, n_prompt + i, None])[:, 0] for i, s in
         enumerate(out.scores)], dim=1,
    )  # fmt: skip
    sync(dev)
    dt = time.perf_counter() - t0
    made = out.sequences.shape[1] - n_prompt
    assert logprobs.shape == (prompts.shape[0], made)
    del out
    return dt, prompts.shape[0] * made


def engine_generate(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    from meshrl.types import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=0)
    sync(engine.device)
    t0 = time.perf_counter()
    out = engine.generate(prompts, params, policy_version=0)
    sync(engine.device)
    dt = time.perf_counter() - t0
    made = sum(len(c.token_ids) for group in out for c in group)
    assert all(len(c.logprobs) == len(c.token_ids) for group in out for c in group)
    return dt, made


def bound_seconds(cfg, weight_bytes: int, batch: int, prompt: int, new: int, bw: float) -> float:
    """Bytes that must be read over the generation (one prefill + new-1 decode steps) / bandwidth."""
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2  # bf16 K and V
    steps = new - 1  # the first new token comes from the prefill
    kv = batch * kv_per_token * sum(prompt + i for i in range(1, steps + 1))
    return ((steps + 1) * weight_bytes + kv) / bw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--skip-generate", action="store_true", help="engine only (no transformers generate baseline)")
    ap.add_argument("--len-bucket-steps", default="256,64", help="HFEngine length-bucket steps to measure")
    args = ap.parse_args()
    if args.tiny:
        args.batches, args.prompt, args.new = "4,8", 8, 16
    batches = [int(b) for b in args.batches.split(",")]

    from transformers import AutoConfig, AutoModelForCausalLM

    from meshrl.generation.hf_engine import HFEngine

    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    model_dir = make_model_dir(tempfile.mkdtemp() + "/model", tiny=args.tiny)
    cfg = AutoConfig.from_pretrained(model_dir)
    bw = copy_bandwidth(dev)
    g = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(1, cfg.vocab_size, (b, args.prompt), generator=g) for b in batches}
    results: dict[str, dict] = {}
    payload = {"env": environment(), "prompt": args.prompt, "new": args.new, "copy_bw_Bps": bw, "results": results}

    steps = [int(x) for x in args.len_bucket_steps.split(",")]
    for step in steps:
        reset_peak(dev)
        engine = HFEngine(
            model_dir, dtype="bfloat16", max_model_len=args.prompt + args.new, max_num_seqs=max(batches), device=dev,
            max_prefill_tokens=max(batches) * args.prompt, len_bucket_step=step,
        )  # fmt: skip
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())  # tied: counted once
        for b in batches:
            rows = prompts[b].tolist()
            cold_s, _ = engine_generate(engine, rows, args.new)
            dt, made = engine_generate(engine, rows, args.new)
            bound = bound_seconds(cfg, weight_bytes, b, args.prompt, args.new, bw)
            results[f"engine_b{b}_lb{step}"] = {
                "batch": b, "len_bucket_step": step, "seconds": dt, "first_call_s": cold_s, "new_tokens": made,
                "tokens_per_s": made / dt, "bound_s": bound, "frac_of_bound": bound / dt, "peak_gib": peak_gib(dev),
                "graph_failures": list(engine.graph_failures), "graphs": len(engine._graphs),
            }  # fmt: skip
            print(f"engine lb{step} b={b}: {made / dt:,.0f} tok/s ({bound / dt:.0%} of bound), first {cold_s:.1f}s")
            write_json("generation", payload)
        engine.shutdown()
        del engine
        gc.collect()

    if not args.skip_generate:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
        model = model.to(dev).eval()
        hf_generate(model, prompts[batches[0]][:2].to(dev), 4)  # warm-up (cuBLAS handles, kernels)
        for b in batches:
            reset_peak(dev)
            dt, made = hf_generate(model, prompts[b].to(dev), args.new)
            bound = bound_seconds(cfg, weight_bytes, b, args.prompt, args.new, bw)
            results[f"generate_b{b}"] = {
                "batch": b, "seconds": dt, "new_tokens": made, "tokens_per_s": made / dt, "bound_s": bound,
                "frac_of_bound": bound / dt, "peak_gib": peak_gib(dev),
            }  # fmt: skip
            print(f"generate b={b}: {made / dt:,.0f} tok/s", flush=True)
            write_json("generation", payload)
        del model

    rows = []
    for b in batches:
        h = results.get(f"generate_b{b}")
        for key, r in results.items():
            if r.get("batch") != b:
                continue
            name = (
                "transformers generate"
                if key.startswith("generate")
                else f"HFEngine (len bucket {r['len_bucket_step']})"
            )
            ratio = r["tokens_per_s"] / h["tokens_per_s"] if (h and r is not h) else None
            rows.append([name, b, r["tokens_per_s"], r["seconds"], f"{r['frac_of_bound']:.1%}", r["peak_gib"], ratio])
    write_json("generation", payload)
    print_table(
        f"generation, Qwen3-0.6B shape{' (TINY)' if args.tiny else ''}, bf16, prompt {args.prompt}, {args.new} new "
        f"tokens, sampling + logprobs, {payload['env']['device']}, copy bw {bw / 1e12:.2f} TB/s",
        ["engine", "batch", "new tok/s", "seconds", "% of bw bound", "peak GiB", "x generate"],
        rows,
    )


if __name__ == "__main__":
    main()
