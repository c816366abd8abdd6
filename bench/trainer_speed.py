"""Trainer throughput: our Policy on the 'hf' backend (FSDP2, fp32 master weights, bf16 compute, fused AdamW) with
the speed levers, beside the plain transformers loop, in one run on one GPU.

    python bench/trainer_speed.py            # Qwen3-0.6B shape, random weights, batch 8 x 2048, bf16
    python bench/trainer_speed.py --tiny     # CPU smoke test of the script (not a result)

Baseline ("plain transformers loop", GPU.md): the model in pure bf16, SDPA, `model(ids).logits`, full-vocab
float32 cross-entropy, fused AdamW. Ours: `Policy.forward_backward` (cross-entropy LossSpec over every target
token, per-datum logprobs returned to the caller as the endpoint does) + `Policy.optim_step`, one rank of
FSDP2 (a 1-process NCCL group). Each configuration gets `--warmup` untimed steps (the compile happens there),
then `--steps` timed ones. tokens/s counts every token of the batch. Peak memory is torch's max allocated.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import environment, make_model_dir, median, peak_gib, print_table, reset_peak, sync, write_json

CONFIGS = {
    "policy": {},
    "policy+chunked": {"logprob_chunk_size": 4096},
    "policy+compile": {"compile": True},
    "policy+chunked+compile": {"logprob_chunk_size": 4096, "compile": True},
    "policy+chunked+compile+ac": {"logprob_chunk_size": 4096, "compile": True, "activation_checkpointing": True},
}


def plain_loop(model_dir: str, tokens: torch.Tensor, warmup: int, steps: int) -> tuple[list[float], dict]:
    from transformers import AutoModelForCausalLM

    dev = tokens.device
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").to(dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
    times, first_loss = [], None
    for i in range(warmup + steps):
        sync(dev)
        t0 = time.perf_counter()
        logits = model(input_ids=tokens, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(dev)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        if first_loss is None:
            first_loss = float(loss)
        del logits, loss
    del model, opt
    gc.collect()
    return times, {"first_step_loss": first_loss}


def policy_loop(
    model_dir: str, tokens: torch.Tensor, warmup: int, steps: int, levers: dict
) -> tuple[list[float], dict]:
    from meshrl.policy import Policy
    from meshrl.types import Datum, LossSpec, OptimParams

    dev = tokens.device
    policy = Policy(model_dir, backend="hf", param_dtype="bfloat16", device=dev.type, attn_backend="sdpa", **levers)
    rows = tokens.tolist()
    data = [Datum.from_completion(r[:1], r[1:]) for r in rows]
    spec = LossSpec("cross_entropy", num_loss_tokens=sum(d.num_loss_tokens for d in data))
    times, fb_times, first_loss = [], [], None
    for i in range(warmup + steps):
        sync(dev)
        t0 = time.perf_counter()
        fb = policy.forward_backward(data, spec)
        sync(dev)
        t1 = time.perf_counter()
        policy.optim_step(OptimParams(lr=1e-5))
        sync(dev)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            fb_times.append(t1 - t0)
        if first_loss is None:  # same weights and data in every config: the levers must not change it
            first_loss = fb.loss
    del policy
    gc.collect()
    return times, {"first_step_loss": first_loss, "forward_backward_s": median(fb_times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--configs", default=",".join(["plain", *CONFIGS]), help="comma-separated; 'plain' = baseline")
    args = ap.parse_args()
    if args.tiny:
        args.batch, args.seq, args.warmup, args.steps = 2, 64, 1, 2

    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = True
    dist.init_process_group(
        "nccl" if dev.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1,
        **({"device_id": dev} if dev.type == "cuda" else {}),
    )  # fmt: skip
    model_dir = make_model_dir(tempfile.mkdtemp() + "/model", tiny=args.tiny)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(dev)
    n_tok = args.batch * args.seq
    results: dict[str, dict] = {}
    payload = {"env": environment(), "batch": args.batch, "seq": args.seq, "results": results}
    for name in args.configs.split(","):
        reset_peak(dev)
        t0 = time.perf_counter()
        try:
            if name == "plain":
                times, extra = plain_loop(model_dir, tokens, args.warmup, args.steps)
            else:
                times, extra = policy_loop(model_dir, tokens, args.warmup, args.steps, CONFIGS[name])
        except torch.OutOfMemoryError as e:
            results[name] = {"error": f"OOM: {str(e)[:200]}"}
            gc.collect()
            continue
        step = median(times)
        results[name] = {
            "levers": CONFIGS.get(name, {}),
            "step_s": step,
            "step_times_s": times,
            "tokens_per_s": n_tok / step,
            "peak_gib": peak_gib(dev),
            "wall_incl_build_and_warmup_s": time.perf_counter() - t0,
            **extra,
        }
        print(f"{name}: {n_tok / step:,.0f} tok/s, step {step:.3f}s, peak {peak_gib(dev)} GiB", flush=True)
        write_json("trainer_speed", payload)  # after every config: a later failure keeps what was measured
    base = results.get("plain", {}).get("tokens_per_s")
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, None, None, None, None, r["error"][:60]])
            continue
        ratio = r["tokens_per_s"] / base if base else None
        rows.append([name, r["tokens_per_s"], r["step_s"], r["peak_gib"], ratio, r["first_step_loss"]])
    write_json("trainer_speed", payload)
    print_table(
        f"trainer, Qwen3-0.6B shape{' (TINY)' if args.tiny else ''}, batch {args.batch} x {args.seq}, "
        f"{payload['env']['device']}",
        ["config", "tokens/s", "step s", "peak GiB", "x plain", "step-1 loss"],
        rows,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
