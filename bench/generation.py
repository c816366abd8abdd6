"""Generation throughput: our 'transformers' engine (TransformersEngine: static KV cache, continuous batching,
CUDA-graph decode steps with sampling on the device) beside transformers `generate` and, with `--vllm`, vLLM, in one
run on one GPU.

    python bench/generation.py           # Qwen3-0.6B shape, random weights, bf16, 128-token prompts, 256 new
    python bench/generation.py --vllm --ipc-check   # + vLLM (VLLMEngine: compiled, CUDA graphs) + its IPC load
    python bench/generation.py --tiny    # CPU smoke test of the script (not a result)

vLLM runs last (after the other engines freed the GPU), through the project's VLLMEngine (enforce_eager=False,
gpu_memory_utilization 0.6, token ids in and out, logprobs of the sampled token, seeded per prompt); its first
call per batch size is untimed like TransformersEngine's. `--ipc-check` then exercises vLLM's same-GPU weight load
(worker extension `meshrl_update_weights_ipc`): this process plays the trainer (a SharedBufferSender over the
weights), greedy output before / after loading other weights / after loading the original weights again
(must equal "before" exactly), and the time of each load beside `VLLMEngine.load_weights` (host path).
`--breakdown` times single decode-graph replays at the largest batch (forward alone, and forward + sampling),
beside the per-step bandwidth bound.

Both sample at temperature 1 (no top-k/top-p) and return per-token logprobs (`generate`: output_scores +
compute_transition_scores); the model has no EOS, so every row makes exactly 256 tokens. tokens/s counts new
tokens. TransformersEngine is timed on its second call of each batch size (the first one captures the CUDA graphs; its
time is reported too). Bandwidth bound: per decode step the weights (tied embedding counted once) plus the KV
of every running row up to its current length must be read; the bound is those bytes over the copy bandwidth
measured in the same run (bytes read + written), and "% of bound" is bound time / measured time.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import pickle
import tempfile
import time
import traceback

import torch
from common import (
    copy_bandwidth,
    environment,
    make_model_dir,
    median,
    peak_gib,
    print_table,
    reset_peak,
    sync,
    write_json,
)


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


def engine_generate(engine, prompts: list[list[int]], new_tokens: int, dev: torch.device) -> tuple[float, int]:
    from meshrl.types import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=0)
    sync(dev)
    t0 = time.perf_counter()
    out = engine.generate(prompts, params, policy_version=0)
    sync(dev)
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


def step_bound_s(cfg, weight_bytes: int, batch: int, length: int, bw: float) -> float:
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    return (weight_bytes + batch * length * kv_per_token) / bw


def breakdown(engine, cfg, weight_bytes: int, bw: float, batch: int, dev: torch.device) -> list[dict]:
    """Replay single decode graphs of `batch` rows: forward only vs forward + device-side sampling."""
    out = []
    if not engine.use_graphs:
        return out
    runner = engine.runner  # the transformers engine's model runner (KV cache, graphs, decode buffers)
    lengths = sorted({L for (B, L, loop) in runner._graphs if B == batch and loop})
    runner.n_buf.fill_(0)  # no row advances: replays leave positions alone
    for L in lengths:
        runner.pos_buf[:batch] = L - 1  # every row attends over the whole bucket
        row = {"batch": batch, "length_bucket": L, "bound_ms": 1e3 * step_bound_s(cfg, weight_bytes, batch, L, bw)}
        for name, loop in (("forward_ms", False), ("forward_sample_ms", True)):
            with runner._mode("decode"):
                g = runner._graphs.get((batch, L, loop)) or runner._capture(batch, L, loop)
            if g is None:
                continue
            for i in range(25):
                if i == 5:
                    sync(dev)
                    t0 = time.perf_counter()
                runner.k_buf.zero_()
                g.replay()
            sync(dev)
            row[name] = 1e3 * (time.perf_counter() - t0) / 20
        out.append(row)
        print(f"breakdown b={batch} L={L}: {row}", flush=True)
    return out


def _ipc_load_in_worker(worker, blob: bytes, version: int):
    """Runs inside the vLLM worker (collective_rpc with a callable): the handle travels pickled, as bytes."""
    return worker.meshrl_update_weights_ipc(pickle.loads(blob), version)


def _checksums_in_worker(worker) -> list[float]:
    """Runs inside the vLLM worker: one float64 sum per parameter of the running model (equal lists = the same
    weights, whatever the kernels do with near-tied logits)."""
    return [float(p.detach().double().sum()) for _, p in sorted(worker.model_runner.get_model().named_parameters())]


def ipc_check(engine, model_dir: str, dev: torch.device, prompts: list[list[int]]) -> dict:
    """vLLM's same-GPU weight load (worker extension meshrl_update_weights_ipc) on the GPU: correctness + time."""
    from safetensors.torch import load_file

    from meshrl.types import SamplingParams
    from meshrl.weight_sync.shared_buffer import SharedBufferSender

    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    sd_a = {}
    for f in files:
        sd_a.update(load_file(os.path.join(model_dir, f), device=str(dev)))
    sd_a = {k: v.to(torch.bfloat16) for k, v in sd_a.items() if k != "lm_head.weight"}
    sd_a = {k: sd_a[k] for k in sorted(sd_a)}  # tied: trainer sends no head
    g = torch.Generator(device=dev).manual_seed(1)
    sd_b = {k: v + 0.02 * torch.randn(v.shape, generator=g, device=dev, dtype=v.dtype) for k, v in sd_a.items()}
    sender = SharedBufferSender.for_state_dict(sd_a, dev, dtype=torch.bfloat16)
    handle = sender.handle()
    greedy = SamplingParams(max_tokens=min(32, engine.max_model_len - len(prompts[0])), temperature=0.0)
    res: dict = {
        "tensors": len(sd_a),
        "bytes": sender.layout.payload_nbytes if hasattr(sender.layout, "payload_nbytes") else None,
    }

    def run() -> tuple[list[list[int]], list[list[float]]]:
        out = engine.generate(prompts, greedy, 0)
        return [c[0].token_ids for c in out], [c[0].logprobs for c in out]

    def stage(name: str, fn) -> None:  # one failing stage must not lose the others' results
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            res[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:600]}"
        print(f"ipc check after {name}: {res}", flush=True)

    def load(version: int) -> float:
        t0 = time.perf_counter()
        r = engine.llm.collective_rpc(_ipc_load_in_worker, args=(pickle.dumps(handle), version))
        engine.llm.reset_prefix_cache()
        dt = time.perf_counter() - t0
        got = [x[0] if isinstance(x, (list, tuple)) else None for x in r]
        assert all(v in (None, version) for v in got), (got, version)
        return dt

    def checksums() -> list[float]:
        return engine.llm.collective_rpc(_checksums_in_worker)[0]

    # The timing runs left these prompts' KV (from a batch-64 prefill) in the prefix cache; every later run starts
    # from an empty cache, so the baseline must too. Run it twice: a random model's top logits are near-ties, so
    # greedy equality is only meaningful if the baseline repeats itself.
    engine.llm.reset_prefix_cache()
    before_tok, before_lp = run()
    engine.llm.reset_prefix_cache()
    res["baseline_repeats"] = run()[0] == before_tok
    before_sums = checksums()

    def ipc() -> None:  # 1) the worker extension's IPC load, the handle pickled to bytes
        sender.publish(sd_b, 1)
        res["first_load_s"] = load(1)  # opens the IPC handle
        res["b_differs"] = run()[0] != before_tok
        times = []
        for v in range(2, 8):
            sender.publish(sd_a, v)
            times.append(load(v))
        res["load_s_median"] = median(times)
        res["load_s_all"] = times
        res["a_again_weights_equal"] = checksums() == before_sums
        a_tok, a_lp = run()
        res["a_again_tokens_equal"] = a_tok == before_tok
        res["a_again_logprob_max_abs_diff"] = max(
            abs(x - y) for r1, r2 in zip(a_lp, before_lp, strict=True) for x, y in zip(r1, r2, strict=True)
        )

    def as_is() -> None:  # 2) the project's entry point as it is (the handle object through collective_rpc)
        sender.publish(sd_b, 8)
        t0 = time.perf_counter()
        engine.load_weights_ipc(handle, 8)
        res["load_weights_ipc_as_is_s"] = time.perf_counter() - t0
        res["as_is_b_differs"] = run()[0] != before_tok

    def host() -> None:  # 3) the host path (VLLMEngine.load_weights: tensors to CPU, through the RPC)
        t0 = time.perf_counter()
        engine.load_weights(sd_a)
        res["host_load_weights_s"] = time.perf_counter() - t0
        res["host_a_weights_equal"] = checksums() == before_sums
        res["host_a_tokens_equal"] = run()[0] == before_tok

    stage("ipc", ipc)
    stage("as_is", as_is)
    stage("host", host)
    sender.close()
    print(f"ipc check: {res}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--skip-generate", action="store_true", help="engine only (no transformers generate baseline)")
    ap.add_argument(
        "--variants", default="auto+norm,matmul",
        help="TransformersEngine variants, comma-separated: attn_impl (auto|triton|sdpa|matmul), '+norm' for "
        "fused RMSNorm",
    )  # fmt: skip
    ap.add_argument("--len-bucket-step", type=int, default=64, help="TransformersEngine length-bucket step")
    ap.add_argument("--sync-every", type=int, default=16, help="TransformersEngine decode steps between host reads")
    ap.add_argument("--breakdown", action="store_true", help="time single decode-graph replays (largest batch)")
    ap.add_argument("--vllm", action="store_true", help="also vLLM (VLLMEngine), last, in the same run")
    ap.add_argument("--vllm-gpu-mem", type=float, default=0.6)
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM without compile/CUDA graphs (fast start)")
    ap.add_argument("--ipc-check", action="store_true", help="with --vllm: vLLM's CUDA-IPC weight load")
    args = ap.parse_args()
    if args.tiny:
        args.batches, args.prompt, args.new = "4,8", 8, 16
    batches = [int(b) for b in args.batches.split(",")]

    from transformers import AutoConfig, AutoModelForCausalLM

    from meshrl.generation.transformers_engine import TransformersEngine

    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    model_dir = make_model_dir(tempfile.mkdtemp() + "/model", tiny=args.tiny)
    cfg = AutoConfig.from_pretrained(model_dir)
    bw = copy_bandwidth(dev)
    g = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(1, cfg.vocab_size, (b, args.prompt), generator=g) for b in batches}
    results: dict[str, dict] = {}
    payload = {"env": environment(), "prompt": args.prompt, "new": args.new, "copy_bw_Bps": bw, "results": results}

    variants = [v for v in args.variants.split(",") if v]
    from safetensors import safe_open

    weight_bytes = 0  # what a decode step reads (tied embedding counted once)
    for f in os.listdir(model_dir):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, f), "pt") as sf:
                weight_bytes += sum(
                    2 * math.prod(sf.get_slice(k).get_shape()) for k in sf.keys() if k != "lm_head.weight"
                )
    step = args.len_bucket_step
    for variant in variants:
        attn, _, norm = variant.partition("+")
        reset_peak(dev)
        engine = TransformersEngine(
            model_dir, dtype="bfloat16", max_model_len=args.prompt + args.new, max_num_seqs=max(batches), device=dev,
            max_prefill_tokens=max(batches) * args.prompt, len_bucket_step=step, sync_every=args.sync_every,
            attn_impl=attn, fused_norm=norm == "norm",
        )  # fmt: skip
        print(
            f"TransformersEngine {variant}: attention {engine.attn_impl} (fallback: {engine.attn_fallback}), "
            f"fused norm {engine.fused_norm} (fallback: {engine.norm_fallback})",
            flush=True,
        )
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())  # tied: counted once
        for b in batches:
            rows = prompts[b].tolist()
            cold_s, _ = engine_generate(engine, rows, args.new, dev)
            stats0 = dict(engine.stats)
            dt, made = engine_generate(engine, rows, args.new, dev)
            bound = bound_seconds(cfg, weight_bytes, b, args.prompt, args.new, bw)
            results[f"engine_b{b}_{variant}"] = {
                "batch": b, "variant": variant, "attn_impl": engine.attn_impl, "attn_fallback": engine.attn_fallback,
                "fused_norm": engine.fused_norm, "norm_fallback": engine.norm_fallback,
                "len_bucket_step": step, "seconds": dt, "first_call_s": cold_s, "new_tokens": made,
                "tokens_per_s": made / dt, "bound_s": bound, "frac_of_bound": bound / dt, "peak_gib": peak_gib(dev),
                "graph_failures": list(engine.graph_failures), "graphs": len(engine.runner._graphs),
                "sync_every": args.sync_every, "stats": {k: v - stats0.get(k, 0) for k, v in engine.stats.items()},
            }  # fmt: skip
            print(f"engine {variant} b={b}: {made / dt:,.0f} tok/s ({bound / dt:.0%} of bound), first {cold_s:.1f}s")
            write_json("generation", payload)
        if args.breakdown:
            payload.setdefault("breakdown", {})[variant] = breakdown(engine, cfg, weight_bytes, bw, max(batches), dev)
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
        gc.collect()

    if args.vllm:
        reset_peak(dev)
        try:
            run_vllm(args, model_dir, prompts, batches, cfg, weight_bytes, bw, dev, results, payload)
        except Exception:  # noqa: BLE001 - keep the other engines' results; say what broke
            payload["vllm_error"] = traceback.format_exc()[-3000:]
            print(payload["vllm_error"], flush=True)
        write_json("generation", payload)

    rows = []
    for b in batches:
        h = results.get(f"generate_b{b}")
        for key, r in results.items():
            if r.get("batch") != b:
                continue
            if key.startswith("generate"):
                name = "transformers generate"
            elif key.startswith("vllm"):
                name = "vLLM (VLLMEngine)"
            else:
                name = f"TransformersEngine ({r['attn_impl']} attention{', fused norm' if r['fused_norm'] else ''})"
            ratio = r["tokens_per_s"] / h["tokens_per_s"] if (h and r is not h) else None
            v = results.get(f"vllm_b{b}")
            vratio = r["tokens_per_s"] / v["tokens_per_s"] if (v and r is not v) else None
            rows.append(
                [name, b, r["tokens_per_s"], r["seconds"], f"{r['frac_of_bound']:.1%}", r["peak_gib"], ratio, vratio]
            )
    write_json("generation", payload)
    print_table(
        f"generation, Qwen3-0.6B shape{' (TINY)' if args.tiny else ''}, bf16, prompt {args.prompt}, {args.new} new "
        f"tokens, sampling + logprobs, {payload['env']['device']}, copy bw {bw / 1e12:.2f} TB/s",
        ["engine", "batch", "new tok/s", "seconds", "% of bw bound", "peak GiB", "x generate", "x vLLM"],
        rows,
    )


def run_vllm(args, model_dir, prompts, batches, cfg, weight_bytes, bw, dev, results, payload) -> None:
    if args.ipc_check:  # the IPC load check passes a function to collective_rpc (cloudpickled into the worker)
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from meshrl.generation.vllm_engine import VLLMEngine

    t0 = time.perf_counter()
    engine = VLLMEngine(
        model_dir, dtype="bfloat16", max_model_len=args.prompt + args.new,
        kv_cache_memory_bytes=None if dev.type == "cuda" else 64 * 2**20,
        gpu_memory_utilization=args.vllm_gpu_mem, enforce_eager=dev.type != "cuda" or args.vllm_eager, seed=0,
    )  # fmt: skip
    import vllm

    payload["vllm"] = {"version": vllm.__version__, "start_s": time.perf_counter() - t0}
    print(f"vLLM {vllm.__version__} started in {payload['vllm']['start_s']:.0f}s", flush=True)
    for b in batches:
        rows = prompts[b].tolist()
        cold_s, _ = engine_generate(engine, rows, args.new, dev)
        dt, made = engine_generate(engine, rows, args.new, dev)
        bound = bound_seconds(cfg, weight_bytes, b, args.prompt, args.new, bw)
        results[f"vllm_b{b}"] = {
            "batch": b, "seconds": dt, "first_call_s": cold_s, "new_tokens": made, "tokens_per_s": made / dt,
            "bound_s": bound, "frac_of_bound": bound / dt, "peak_gib": None,
        }  # fmt: skip
        print(f"vllm b={b}: {made / dt:,.0f} tok/s ({bound / dt:.0%} of bound), first {cold_s:.1f}s", flush=True)
        write_json("generation", payload)
    if args.ipc_check:
        try:
            payload["vllm_ipc"] = ipc_check(engine, model_dir, dev, prompts[batches[0]][:8].tolist())
        except Exception:  # noqa: BLE001
            payload["vllm_ipc"] = {"error": traceback.format_exc()[-3000:]}
            print(payload["vllm_ipc"]["error"], flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
