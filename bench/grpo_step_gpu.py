"""GRPO steps end to end on one GPU through the real Controller and actors, with the time split.

    python bench/grpo_step_gpu.py            # Qwen3-0.6B shape (vocab 151,936), random weights, 1 GPU
    python bench/grpo_step_gpu.py --tiny     # CPU smoke test of the script (not a result)

One trainer process (PolicyTrainer, 'hf' backend: FSDP2 on one rank, fp32 master weights, bf16 compute, fused
AdamW, chunked logprobs), one generator process (Generator, engine 'transformers' = TransformersEngine, bf16, CUDA
graphs) and one reward process, all on the same GPU / host, spawned by `meshrl.controller.api.Controller` over Monarch.
The task is the built-in string reversal (character tokenizer); the random model never emits EOS, so every
completion runs to max_tokens (rewards are ~0: this measures speed, not learning).

Per step, exactly as `meshrl.controller.grpo` does it: generate (prompts x group) -> score (RewardActor) ->
advantages + GRPO loss spec -> forward_backward per micro-batch (queued at once; each returns reduced numbers, the
logprob mismatch included, not per-token rows) -> optim_step -> sync_weights (trainer -> generator). Each weight
transport the Controller offers is measured with its own Controller (`generator.weight_sync` when that config field
exists: 'cuda_ipc' and 'torchstore'; else torchstore only).
The first `--warmup` steps (CUDA-graph capture, allocator warm-up, compile) are reported but not in the medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from common import ensure_meshrl_layout, environment, make_model_dir, print_table, write_json


def run_transport(args, transport: str | None, model_dir: str, task, on_gpu: bool, staleness: int = 0) -> dict:
    """`staleness` 1: the asynchronous schedule of `--grpo.max-staleness 1` (controller/rollouts.py, AheadSchedule):
    step t+1's generation is sent before step t trains, and the new weights are published without waiting for the
    generator (its load is queued behind that generation)."""
    from meshrl.advantages import compute_advantages
    from meshrl.algorithms import step_loss_spec
    from meshrl.config import GeneratorConfig, GRPOConfig, ModelConfig, TrainerConfig
    from meshrl.controller.api import Controller
    from meshrl.rewards import parse_reward_spec
    from meshrl.types import Datum, OptimParams, SamplingParams

    P, G = args.prompts, args.group
    tok = task.tokenizer
    longest_prompt = max(len(tok.encode(r.prompt)) for r in task.train)
    max_model_len = longest_prompt + args.max_tokens
    model_cfg = ModelConfig(
        path=model_dir, backend="hf", dtype="bfloat16" if on_gpu else "float32", attn_backend="sdpa"
    )
    trainer_cfg = TrainerConfig(
        num_procs=1, device="cuda" if on_gpu else "cpu", micro_batch_size=args.micro_batch,
        logprob_chunk_size=args.chunk, compile=args.compile,
    )  # fmt: skip
    gen_kwargs = dict(
        engine="transformers", dtype="bfloat16" if on_gpu else "float32", max_model_len=max_model_len,
        max_num_seqs=P * G, kv_cache_memory_bytes=args.kv_gib * 2**30, max_tokens=args.max_tokens, temperature=1.0,
    )  # fmt: skip
    if transport is not None:
        gen_kwargs["weight_sync"] = transport
    gen_cfg = GeneratorConfig(**gen_kwargs)
    grpo = GRPOConfig(steps=args.steps, prompts_per_step=P, group_size=G)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, n=G, stop_token_ids=[tok.eos_id])
    rng = random.Random(0)
    steps: list[dict] = []
    t_start = time.perf_counter()
    with Controller(
        model_dir=model_dir, model_cfg=model_cfg, trainer_cfg=trainer_cfg, generator_cfg=gen_cfg,
        tokenizer=tok, rewards=parse_reward_spec(task.reward), seed=0, call_timeout_s=args.call_timeout,
    ) as ctl:  # fmt: skip
        start_s = time.perf_counter() - t_start
        used = getattr(ctl, "weight_transport", None) or "torchstore"
        print(f"[{used}] controller up in {start_s:.1f}s", flush=True)
        ctl.sync_weights()  # version 0 into the generator (opens the shared buffer for cuda_ipc)
        ctl.timeline()  # start the timeline here

        def send() -> tuple[list, Any]:
            examples = rng.sample(task.train, P)
            return examples, ctl.generate([tok.encode(r.prompt) for r in examples], sampling)

        ahead = send() if staleness else None
        for step in range(args.steps):
            t0 = time.perf_counter()
            examples, pending_groups = ahead if staleness else send()
            groups = pending_groups.result()
            if staleness and step + 1 < args.steps:
                ahead = send()  # the next step's generation runs while this one scores and trains
            completions = [c for g in groups for c in g]
            t1 = time.perf_counter()
            texts = [tok.decode(c.token_ids) for c in completions]
            views = [r.verifier_view() for r in examples]
            rewards = [s.reward for s in ctl.score(texts, views, group_size=G).result()]
            data = [Datum.from_completion(c.prompt_ids, c.token_ids, c.logprobs) for c in completions]
            for d, a in zip(data, compute_advantages(grpo.advantage, rewards, G), strict=True):
                d.advantage = a
            t2 = time.perf_counter()
            loss = step_loss_spec(grpo, data, temperature=1.0, max_tokens=args.max_tokens)
            mb = args.micro_batch
            pending = [ctl.forward_backward(data[i : i + mb], loss) for i in range(0, len(data), mb)]
            results = [p.result() for p in pending]
            opt = ctl.optim_step(OptimParams(lr=1e-6, grad_clip=1.0)).result()
            t3 = time.perf_counter()
            sync = ctl.sync_weights(wait=not staleness)
            t4 = time.perf_counter()
            # Trainer vs generator logprobs, reduced on the trainer (no per-token rows come back since issue 30).
            n_diff = sum(r.logprob_diff_count for r in results)
            gen_tokens = sum(len(c.token_ids) for c in completions)
            rec = {
                "step": step,
                "generate_s": t1 - t0,
                "score_s": t2 - t1,
                "train_s": t3 - t2,
                "sync_s": t4 - t3,
                "total_s": t4 - t0,
                "sync_push_s": sync.push_s,
                "sync_pull_s": sync.pull_s,
                "sync_bytes": sync.bytes,
                "generated_tokens": gen_tokens,
                "train_tokens": sum(len(d.tokens) for d in data),
                "generate_tok_per_s": gen_tokens / (t1 - t0),
                "reward_mean": statistics.fmean(rewards),
                "grad_norm": opt.grad_norm,
                "policy_version": opt.policy_version,
                "trainer_vs_generator_logprob_diff_mean": sum(r.logprob_diff_sum for r in results) / n_diff,
                "trainer_vs_generator_logprob_diff_max": max(r.logprob_diff_max for r in results),
            }
            rec["staleness"] = opt.policy_version - 1 - completions[0].policy_version
            steps.append(rec)
            print(
                f"[{used} K={staleness}] step {step}: generate {rec['generate_s']:.2f}s score {rec['score_s']:.2f}s "
                f"train {rec['train_s']:.2f}s sync {rec['sync_s']:.3f}s total {rec['total_s']:.2f}s "
                f"(|lp diff| mean {rec['trainer_vs_generator_logprob_diff_mean']:.2e})",
                flush=True,
            )
        intervals = ctl.timeline()
    if os.environ.get("OUT") or args.tiny:
        from meshrl.timeline import plot_timeline

        out_dir = Path(os.environ.get("OUT") or tempfile.mkdtemp())
        (out_dir / f"timeline_{used}_k{staleness}.json").write_text(json.dumps(intervals))
        plot_timeline(intervals, out_dir / f"timeline_{used}_k{staleness}.png", title=f"{used}, K={staleness}")
    timed = steps[args.warmup :] or steps
    med = {k: statistics.median(s[k] for s in timed) for k in steps[0] if k.endswith("_s") or k.endswith("_per_s")}
    return {
        "staleness": staleness,
        "transport_requested": transport,
        "transport": used,
        "controller_start_s": start_s,
        "config": {"prompts": P, "group": G, "max_tokens": args.max_tokens, "micro_batch": args.micro_batch,
                   "logprob_chunk_size": args.chunk, "compile": args.compile, "max_model_len": max_model_len},
        "steps": steps,
        "median": med,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=4096, help="trainer logprob_chunk_size")
    ap.add_argument("--compile", action="store_true", help="trainer compile lever (first step compiles)")
    ap.add_argument("--kv-gib", type=float, default=12.0, help="generator KV cache")
    ap.add_argument("--transports", default="torchstore,cuda_ipc", help="tried in order where the config has them")
    ap.add_argument("--call-timeout", type=float, default=180.0, help="Controller call timeout (s)")
    ap.add_argument("--staleness", default="0", help="comma list: 0 = synchronous loop, 1 = asynchronous (K=1)")
    args = ap.parse_args()
    if args.tiny:
        args.steps, args.warmup, args.prompts, args.group, args.max_tokens = 2, 1, 4, 4, 8
        args.micro_batch, args.chunk, args.kv_gib = 8, 0, 0.05

    ensure_meshrl_layout()
    import torch

    from meshrl.config import GeneratorConfig
    from meshrl.tasks.reverse import ReverseTaskConfig, build_reverse_task

    on_gpu = torch.cuda.is_available() and not args.tiny
    task_cfg = ReverseTaskConfig(min_len=2, max_len=8, alphabet="abcdefgh")
    task = build_reverse_task(task_cfg)
    task.tokenizer = task_cfg.tokenizer()  # this bench tokenizes by hand (the GRPO program renders with the model's)
    model_dir = make_model_dir(tempfile.mkdtemp() + "/model", tiny=args.tiny)
    task.tokenizer.save_pretrained(model_dir)
    has_choice = "weight_sync" in {f.name for f in dataclasses.fields(GeneratorConfig)}
    wanted = [t for t in args.transports.split(",") if t]
    if not on_gpu:
        wanted = [t for t in wanted if t != "cuda_ipc"]
    transports = wanted if has_choice else [None]
    results: dict[str, dict] = {}
    payload = {"env": environment(), "weight_sync_field": has_choice, "results": results}
    for t in transports:
        for k in [int(x) for x in args.staleness.split(",")]:
            try:
                r = run_transport(args, t, model_dir, task, on_gpu, staleness=k)
                results[r["transport"] + (f"/K={k}" if k else "")] = r
            except Exception:  # noqa: BLE001 - keep the other configurations' results
                results[f"{t}/K={k}_error"] = {"error": traceback.format_exc()[-4000:]}
                print(results[f"{t}/K={k}_error"]["error"], flush=True)
            write_json("grpo_step", payload)

    rows = []
    for name, r in results.items():
        if "median" not in r:
            continue
        m = r["median"]
        rows.append(
            [name, m["total_s"], m["generate_s"], m["score_s"], m["train_s"], m["sync_s"],
             m["generate_tok_per_s"], r["steps"][-1]["trainer_vs_generator_logprob_diff_mean"]]
        )  # fmt: skip
    cfg = next((r["config"] for r in results.values() if "config" in r), {})
    print_table(
        f"GRPO step end to end{' (TINY)' if args.tiny else ''}, {payload['env']['device']}: "
        f"{cfg.get('prompts')} prompts x {cfg.get('group')}, {cfg.get('max_tokens')} new tokens, "
        f"median of steps >= {args.warmup}",
        ["weight sync", "step s", "waiting for generation s", "score s", "train s", "sync s", "gen tok/s", "|lp diff|"],
        rows,
    )


if __name__ == "__main__":
    main()
