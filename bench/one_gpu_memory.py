"""One GPU used fully: the trainer's token-budget micro-batches, packed RL batches and the generator's memory
hand-off, against the fixed micro-batches of before, in one run on one GPU (issue "One GPU used fully").

    python bench/one_gpu_memory.py            # Qwen3-0.6B shape (vocab 151,936), random weights, 1 GPU
    python bench/one_gpu_memory.py --tiny     # CPU smoke test of the script (not a result)

Two Controllers on the same GPU (trainer 'hf' backend, FSDP2 on one rank, fp32 masters, bf16 compute; generator
meshrl's 'transformers' engine, bf16, the same KV cache `--kv-gib` in both):
- before: what bench/grpo_step_gpu.py ran — a fixed `--micro-batch` of sequences per forward_backward call, rows padded
  to the longest, chunked logprobs (4096), the generator's KV cache held during training.
- after: the trainer's defaults (token budget from the free memory, packed rows, full logits) and the hand-off of
  controller/memory.py (the generator sleeps while the trainer trains); 'after+chunk' adds --trainer.logprob-chunk-size.

Part 1 ("fits"): one optimiser step on synthetic sequences of each shape (sequences x tokens), no generation: does
it run, how long, peak memory, calls made. Part 2 ("rl"): GRPO steps end to end (generate -> score -> train -> sync)
on the two jobs of the issue, 16 x 8 x 2048 and 64 x 8 x 512 new tokens. The random model emits no EOS, so every
completion runs to max_tokens (equal lengths: packing has no padding to remove there); `--stop-ids K` makes K token
ids end a completion, giving geometric lengths (mean ~151936 / K) for a variable-length job. Part "standalone": the
config's engine alone in this process (built as the Generator actor builds it) on the rl jobs' prompts, before the
Controller starts; the table gives in-loop generation tok/s over it.

More configs: 'after+fast' (after + compiled blocks, chunked logprobs, pure-bf16 weights with Kahan-compensated
AdamW), 'after+fp8kv' / 'after+fast+fp8kv' (the generator's KV cache in fp8:
`--generator.transformers.kv-cache-dtype fp8`, which changes the sampler's numerics), 'vllm' and 'vllm+fast' (the
same trainers with vLLM as the generator, its GPU defaults: CUDA graphs, sleep mode; needs the vLLM stack,
bench/gpu_run.sh vllm-loop).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import tempfile
import time
import traceback

from common import ensure_meshrl_layout, environment, make_model_dir, print_table, write_json

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--tiny", action="store_true")
ap.add_argument("--parts", default="fits,rl", help="fits, rl, standalone (the engine alone on the rl jobs)")
ap.add_argument("--configs", default="before,after,after+chunk")
ap.add_argument("--micro-batch", type=int, default=16, help="'before': sequences per forward_backward call")
ap.add_argument("--kv-gib", type=float, default=30.0)
ap.add_argument("--fits", default="128x2048,512x512,128x4096,256x4096,64x8192,128x8192")
ap.add_argument("--jobs", default="16x8x2048,64x8x512", help="prompts x group x new tokens")
ap.add_argument("--stop-ids", type=int, default=0, help="token ids that end a completion (0: none, no EOS)")
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--warmup", type=int, default=1)
ap.add_argument("--call-timeout", type=float, default=300.0)


def configs(args, on_gpu: bool, max_model_len: int) -> dict:
    from meshrl.config import GeneratorConfig, ModelConfig, TrainerConfig

    device, dtype = ("cuda", "bfloat16") if on_gpu else ("cpu", "float32")
    model = ModelConfig(backend="hf", dtype=dtype, attn_backend="sdpa")
    gen = GeneratorConfig(
        engine="transformers", dtype=dtype, max_model_len=max_model_len, max_num_seqs=1024,
        kv_cache_memory_bytes=int(args.kv_gib * 2**30), max_tokens=max_model_len // 2, temperature=1.0,
    )  # fmt: skip
    before = TrainerConfig(
        num_procs=1, device=device, micro_batch_size=args.micro_batch, max_tokens_per_micro_batch=2**40,
        pack_sequences=False, logprob_chunk_size=0 if args.tiny else 4096,
    )  # fmt: skip
    after = TrainerConfig(num_procs=1, device=device, micro_batch_size=1024)
    # the trainer's speed levers (trainer_speed.py's best safe configuration): compiled blocks, chunked logprobs,
    # pure-bf16 weights with Kahan-compensated AdamW (tracks the fp32-master update; tests/test_optim_bf16.py)
    fast = dataclasses.replace(
        after, logprob_chunk_size=4096, compile=on_gpu, master_dtype=dtype, bf16_rounding="kahan"
    )
    fp8kv = dataclasses.replace(gen, transformers=dataclasses.replace(gen.transformers, kv_cache_dtype="fp8"))
    vllm = dataclasses.replace(gen, engine="vllm")  # vLLM with its GPU defaults: CUDA graphs, sleep mode
    return {
        "before": (model, before, dataclasses.replace(gen, sleep_level=0)),
        # before, tuned by hand the way the issue got the 2048-token job to run: activation checkpointing on
        "before+ac": (
            model,
            dataclasses.replace(before, activation_checkpointing=True),
            dataclasses.replace(gen, sleep_level=0),
        ),
        "after": (model, after, gen),
        "after+chunk": (model, dataclasses.replace(after, logprob_chunk_size=4096), gen),
        "after+fast": (model, fast, gen),
        # the generator's KV cache in fp8 (half the bytes decode attention reads; changes the sampler's numerics)
        "after+fp8kv": (model, after, fp8kv),
        "after+fast+fp8kv": (model, fast, fp8kv),
        "vllm": (model, after, vllm),
        "vllm+fast": (model, fast, vllm),
        # fast without compile (the vLLM stack's cuDNN rejects the compiled SDPA backward at these lengths)
        "vllm+kahan": (model, dataclasses.replace(fast, compile=False), vllm),
    }


def synthetic(n: int, length: int, vocab: int, rng: random.Random):
    from meshrl.types import Datum

    prompt = 16
    out = []
    for _ in range(n):
        toks = [rng.randrange(vocab) for _ in range(length)]
        out.append(Datum.from_completion(toks[:prompt], toks[prompt:], [-12.0] * (length - prompt), rng.gauss(0, 1)))
    return out


def fits(ctl, handoff, shapes, vocab: int) -> list[dict]:
    from meshrl.algorithms import step_loss_spec
    from meshrl.config import GRPOConfig
    from meshrl.controller.training import train_step
    from meshrl.types import OptimParams

    rows = []
    rng = random.Random(0)
    for n, length in shapes:
        data = synthetic(n, length, vocab, rng)
        loss = step_loss_spec(GRPOConfig(), data, temperature=1.0, max_tokens=length)
        handoff.to_trainer()
        ctl.trainer_memory()  # resets the peak
        t0 = time.perf_counter()
        try:
            results, _, _ = train_step(ctl, data, loss, ctl.trainer_cfg.micro_batch_size, OptimParams(lr=1e-6))
            row = {"ok": True, "train_s": time.perf_counter() - t0, "calls": len(results)}
        except Exception as e:  # noqa: BLE001 - an OOM is a result here
            row = {"ok": False, "error": str(e).splitlines()[-1][:300], "train_s": time.perf_counter() - t0}
        row.update(shape=f"{n}x{length}", tokens=n * length, peak_gib=ctl.trainer_memory()[0]["peak_gib"])
        handoff.to_generator()
        print(f"  fits {row}", flush=True)
        rows.append(row)
    return rows


def standalone(gen, model_dir: str, task, jobs, args) -> list[dict]:
    """The generator's engine alone in this process, built as the Generator actor builds it (the same config, whole),
    on each RL job's first prompts: the figure the in-loop generation is compared with (bench/generation.py's
    measurement, at the loop's shape and settings). Timed on the second call (the first warms up)."""
    import gc

    import torch

    from meshrl.types import SamplingParams

    shared = dict(dtype=gen.dtype, max_model_len=gen.max_model_len, max_num_seqs=gen.max_num_seqs,
                  kv_cache_memory_bytes=gen.kv_cache_memory_bytes, seed=0)  # fmt: skip
    t0 = time.perf_counter()
    if gen.engine == "vllm":
        from meshrl.generation.vllm_engine import VLLMEngine

        engine = VLLMEngine(model_dir, gen.vllm, **shared)
    else:
        from meshrl.generation.transformers_engine import TransformersEngine

        engine = TransformersEngine(model_dir, gen.transformers, **shared)
    rows = [{"start_s": time.perf_counter() - t0}]
    print(f"  standalone {gen.engine}: started in {rows[0]['start_s']:.0f}s", flush=True)
    tok = task.tokenizer
    try:
        for prompts, group, max_tokens in jobs:
            stop = [tok.eos_id] + list(range(1000, 1000 + args.stop_ids))
            sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0, n=group, stop_token_ids=stop)
            ids = [tok.encode(r.prompt) for r in random.Random(0).sample(task.train, prompts)]
            times = []
            for _ in range(2):
                t0 = time.perf_counter()
                groups = engine.generate(ids, sampling, 0)
                times.append(time.perf_counter() - t0)
            made = sum(len(c.token_ids) for g in groups for c in g)
            rows.append({"job": f"{prompts}x{group}x{max_tokens}", "generate_s": times[1], "first_s": times[0],
                         "generated_tokens": made, "generate_tok_per_s": made / times[1]})  # fmt: skip
            print(f"  standalone {rows[-1]}", flush=True)
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def rl_job(ctl, handoff, task, prompts: int, group: int, max_tokens: int, args) -> dict:
    from meshrl.advantages import compute_advantages
    from meshrl.algorithms import step_loss_spec
    from meshrl.config import GRPOConfig
    from meshrl.controller.training import train_step
    from meshrl.types import Datum, OptimParams, SamplingParams

    tok = task.tokenizer
    stop = [tok.eos_id] + list(range(1000, 1000 + args.stop_ids))
    sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0, n=group, stop_token_ids=stop)
    grpo = GRPOConfig(prompts_per_step=prompts, group_size=group)
    rng = random.Random(0)
    steps = []
    ctl.sync_weights()  # the fits' steps moved the trainer on
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        examples = rng.sample(task.train, prompts)
        groups = ctl.generate([tok.encode(r.prompt) for r in examples], sampling).result()
        completions = [c for g in groups for c in g]
        t1 = time.perf_counter()
        texts = [tok.decode(c.token_ids) for c in completions]
        rewards = [s.reward for s in ctl.score(texts, [r.verifier_view() for r in examples], group_size=group).result()]
        data = [Datum.from_completion(c.prompt_ids, c.token_ids, c.logprobs) for c in completions]
        for d, a in zip(data, compute_advantages(grpo.advantage, rewards, group), strict=True):
            d.advantage = a
        memory = handoff.record("generate")
        handoff.to_trainer()
        t2 = time.perf_counter()
        loss = step_loss_spec(grpo, data, temperature=1.0, max_tokens=max_tokens)
        results, opt, mismatch = train_step(ctl, data, loss, ctl.trainer_cfg.micro_batch_size, OptimParams(lr=1e-6))
        memory |= handoff.record("train")
        handoff.to_generator()
        t3 = time.perf_counter()
        sync = ctl.sync_weights()
        t4 = time.perf_counter()
        gen_tokens = sum(len(c.token_ids) for c in completions)
        train_tokens = sum(len(d.tokens) for d in data)
        rec = {
            "step": step, "generate_s": t1 - t0, "score_s": t2 - t1, "train_s": t3 - t2, "sync_s": t4 - t3,
            "total_s": t4 - t0, "sync_pull_s": sync.pull_s, "generated_tokens": gen_tokens,
            "train_tokens": train_tokens, "calls": float(len(results)),
            "generate_tok_per_s": gen_tokens / (t1 - t0), "train_tok_per_s": train_tokens / (t3 - t2),
            "logprob_diff_mean": mismatch[0], "grad_norm": opt.grad_norm, **memory,
        }  # fmt: skip
        print(f"  step {step}: " + " ".join(f"{k}={v:.3g}" for k, v in rec.items() if k.endswith("_s")), flush=True)
        steps.append(rec)
    timed = steps[args.warmup :] or steps
    med = {k: statistics.median(s[k] for s in timed) for k in steps[0] if isinstance(steps[0][k], float)}
    return {"job": f"{prompts}x{group}x{max_tokens}", "steps": steps, "median": med}


def main() -> None:
    args = ap.parse_args()
    if args.tiny:
        args.fits, args.jobs, args.kv_gib, args.steps, args.warmup = "8x32,16x48", "4x4x16", 0.05, 1, 1
    ensure_meshrl_layout()
    import torch

    from meshrl.controller.api import Controller
    from meshrl.controller.memory import MemoryHandoff
    from meshrl.rewards import parse_reward_spec
    from meshrl.tasks.reverse import ReverseTaskConfig, build_reverse_task

    on_gpu = torch.cuda.is_available() and not args.tiny
    task_cfg = ReverseTaskConfig(min_len=2, max_len=8, alphabet="abcdefgh")
    task = build_reverse_task(task_cfg)
    task.tokenizer = task_cfg.tokenizer()
    model_dir = make_model_dir(tempfile.mkdtemp() + "/model", tiny=args.tiny)
    task.tokenizer.save_pretrained(model_dir)
    vocab = 151936 if on_gpu else 512
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.fits.split(",") if s]
    jobs = [tuple(int(x) for x in s.split("x")) for s in args.jobs.split(",") if s]
    # The generator serves the RL jobs only (the fits train on synthetic sequences): a longer max_model_len would
    # cut its KV cache into fewer, longer slots.
    max_model_len = max([m + 32 for *_, m in jobs] or [64])
    payload = {"env": environment(), "args": vars(args), "results": {}}
    for name in [c for c in args.configs.split(",") if c]:
        model, trainer, gen = configs(args, on_gpu, max_model_len)[name]
        out = payload["results"][name] = {"trainer": dataclasses.asdict(trainer)}
        if "standalone" in args.parts:
            try:
                out["standalone"] = standalone(gen, model_dir, task, jobs, args)
            except Exception:  # noqa: BLE001
                out["standalone"] = [{"error": traceback.format_exc()[-3000:]}]
                print(out["standalone"][0]["error"], flush=True)
            write_json("one_gpu_memory", payload)
        try:
            with Controller(
                model_dir=model_dir, model_cfg=model, trainer_cfg=trainer, generator_cfg=gen, tokenizer=task.tokenizer,
                rewards=parse_reward_spec(task.reward), call_timeout_s=args.call_timeout,
            ) as ctl:  # fmt: skip
                level = 0 if gen.sleep_level == 0 else 1
                handoff = MemoryHandoff(ctl, sleep_level=level if on_gpu else 0)
                ctl.sync_weights()
                out["token_budget_at_start"] = ctl.token_budget()
                print(f"[{name}] token budget {out['token_budget_at_start']}", flush=True)
                if "fits" in args.parts:
                    out["fits"] = fits(ctl, handoff, shapes, vocab)
                    write_json("one_gpu_memory", payload)
                if "rl" in args.parts:
                    out["rl"] = []
                    for p, g, m in jobs:
                        try:
                            out["rl"].append(rl_job(ctl, handoff, task, p, g, m, args))
                        except Exception:  # noqa: BLE001 - keep the other jobs' results
                            out["rl"].append({"job": f"{p}x{g}x{m}", "error": traceback.format_exc()[-3000:]})
                            print(out["rl"][-1]["error"], flush=True)
                        write_json("one_gpu_memory", payload)
        except Exception:  # noqa: BLE001
            out["error"] = traceback.format_exc()[-3000:]
            print(out["error"], flush=True)
        write_json("one_gpu_memory", payload)

    names = list(payload["results"])
    fit_rows = []
    for i, (n, length) in enumerate(shapes):
        row = [f"{n}x{length}"]
        for name in names:
            f = payload["results"][name].get("fits", [])
            r = f[i] if i < len(f) else None
            row.append("-" if r is None else (f"{r['train_s']:.1f}s {r['peak_gib']:.0f}G" if r["ok"] else "OOM"))
        fit_rows.append(row)
    print_table("one optimiser step per shape (train only): time, trainer peak", ["shape", *names], fit_rows)
    rl_rows = []
    for name in names:
        alone = {r["job"]: r for r in payload["results"][name].get("standalone", []) if "job" in r}
        for job in payload["results"][name].get("rl", []):
            m = job.get("median")
            ref = alone.get(job["job"])
            ratio = m["generate_tok_per_s"] / ref["generate_tok_per_s"] if m and ref else float("nan")
            rl_rows.append(
                [name, job["job"]] + ([m["total_s"], m["generate_s"], m["train_s"], m["sync_s"], m["calls"],
                                       m["generate_tok_per_s"], ratio, m["train_tok_per_s"], m["logprob_diff_mean"]]
                                      if m else ["error"] * 9)
            )  # fmt: skip
    print_table(
        "GRPO steps (median)", ["config", "job", "step s", "generate s", "train s", "sync s", "calls", "gen tok/s",
                                "gen / alone", "train tok/s", "|lp diff|"], rl_rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()
