"""Trainer throughput: our Policy on the 'hf' backend (FSDP2, fp32 master weights, bf16 compute, fused AdamW) with
the speed levers, beside the plain transformers loop, in one run on one GPU.

    python bench/trainer_speed.py            # Qwen3-0.6B shape, random weights, batch 8 x 2048, bf16
    python bench/trainer_speed.py --tiny     # CPU smoke test of the script (not a result)
    python bench/trainer_speed.py --backend torchtitan   # torchtitan backend vs the bare torchtitan loop
                                                         # (needs torchtitan 0.3 + torch >= 2.13: GPU.md step 3)

With `--backend torchtitan` the baseline is the bare torchtitan loop ("plain-titan": torchtitan's Qwen3 built
on the meta device, materialised on the GPU in pure bf16, flex attention (torchtitan's compiled flex), each
block torch.compile'd, full-vocab float32 cross-entropy, fused AdamW; no FSDP, no actors; 'plain-titan-sdpa': the
same with torchtitan's SDPA) and ours is `Policy.from_options` with the config's levers: flex attention
unless the config says `attn_backend: sdpa` (cuDNN first), `logprob_keep_logits` (`+keep`), etc. `actor:` configs
drive the PolicyTrainer actor from this process through the Controller, the optimiser step carried by the
`forward_backward` call as the GRPO loop sends it (`actor-wait:` calls `optim_step` after reading the result of
`forward_backward`). `Policy` configs take the step the same way.
MFU = (6 N + 12 L H Q T) FLOPs per token (N all parameters, the tied head counted once; L layers, H heads,
Q head dim, T sequence length: the attention term as torchtitan counts it) x tokens/s, over the H100's
989 TFLOP/s dense bf16 (and over the 779 TFLOP/s matmul measured on this machine, GPU.md).

Numerics: '+bf16' configs train pure bf16 weights and AdamW state with each update rounded to nearest (as the bare
loops do; at lr ~1e-6 most updates round away), '+kahan' ones the same with compensated summation
(meshrl.optim.FusedAdamW, bf16_rounding='kahan': safe; on CUDA one fused Triton kernel, ~0.7 ms more than nearest
at 0.6B, bench/kahan_kernel.py), the rest
float32 masters (the default). `--configs plain-titan,titan+chunked+compile+sdpa+keep,titan+chunked+compile+bf16+
sdpa+keep,titan+chunked+compile+bf16+sdpa+keep+kahan` sets the three beside the bare loop.

Baseline ("plain transformers loop", GPU.md): the model in pure bf16, SDPA, `model(ids).logits`, full-vocab
float32 cross-entropy, fused AdamW. Ours: `Policy.forward_backward` (cross-entropy LossSpec over every target
token, the reduced result returned as the endpoint does; no per-datum logprobs since issue 30) +
`Policy.optim_step`, one rank of FSDP2 (a 1-process NCCL group). Each configuration gets `--warmup` untimed steps
(the compile happens there), then `--steps` timed ones. tokens/s counts every token of the batch. Peak memory is
torch's max allocated.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import (
    ensure_meshrl_layout,
    environment,
    make_model_dir,
    median,
    peak_gib,
    print_table,
    reset_peak,
    sync,
    write_json,
)
from torch.profiler import record_function

# Pure bf16 weights and AdamW state: "+bf16" stores each update rounded to nearest (bf16_rounding='nearest', the
# recipe the bare loops use, and what these configs measured before the option existed: at lr ~1e-6 most updates
# round away), "+kahan" adds the compensation buffer that keeps them (meshrl.optim.FusedAdamW; the Policy default).
# Without "+bf16" the weights are float32 masters (the trainer's default).
BF16 = {"master_dtype": "bfloat16", "bf16_rounding": "nearest"}
KAHAN = {"master_dtype": "bfloat16", "bf16_rounding": "kahan"}
TITAN_CONFIGS = {
    "titan": {},
    "titan+chunked+compile": {"logprob_chunk_size": 4096, "compile": True},
    "titan+compile": {"compile": True},
    # The bare loop's recipe: bf16 weights and AdamW state, no gradient clipping (the `noclip` suffix).
    "titan+compile+bf16": {"compile": True, **BF16},
    "titan+chunked+compile+bf16": {"logprob_chunk_size": 4096, "compile": True, **BF16},
    # Flex attention with the Kahan step (the torch 2.14 stack's cuDNN fails the SDPA backward: CUDNN_STATUS_BAD_PARAM)
    "titan+chunked+compile+bf16+kahan": {"logprob_chunk_size": 4096, "compile": True, **KAHAN},
    "titan+chunked+compile+bf16+kahan+graphopt": {
        "logprob_chunk_size": 4096, "compile": True, "optimizer_cuda_graph": True, **KAHAN,
    },
    # SDPA instead of flex for unpacked rows (cuDNN's fused attention first: DocumentMaskedSDPA).
    "titan+chunked+compile+bf16+sdpa": {"logprob_chunk_size": 4096, "compile": True, "attn_backend": "sdpa", **BF16},
    "titan+chunked8k+compile+bf16+sdpa+keep": {
        "logprob_chunk_size": 8192, "compile": True, "attn_backend": "sdpa", "logprob_keep_logits": True, **BF16,
    },
    # ... and the chunked head's bf16 logits kept for backward instead of recomputed (+5 GB).
    "titan+chunked+compile+bf16+sdpa+keep": {
        "logprob_chunk_size": 4096, "compile": True, "attn_backend": "sdpa", "logprob_keep_logits": True, **BF16,
    },
    # The same levers three ways, to set beside the bare loop: float32 masters (the default numerics), plain bf16
    # (above) and bf16 with compensated summation (safe at RL learning rates).
    "titan+chunked+compile+sdpa+keep": {
        "logprob_chunk_size": 4096, "compile": True, "attn_backend": "sdpa", "logprob_keep_logits": True,
    },
    "titan+chunked+compile+bf16+sdpa+keep+kahan": {
        "logprob_chunk_size": 4096, "compile": True, "attn_backend": "sdpa", "logprob_keep_logits": True, **KAHAN,
    },
    # ... with the optimiser step replayed as CUDA graphs (trainer.optimizer_cuda_graph; off by default).
    "titan+chunked+compile+bf16+sdpa+keep+graphopt": {
        "logprob_chunk_size": 4096, "compile": True, "attn_backend": "sdpa", "logprob_keep_logits": True,
        "optimizer_cuda_graph": True, **BF16,
    },
    "titan+chunked+compile+bf16+sdpa+keep+kahan+graphopt": {
        "logprob_chunk_size": 4096, "compile": True, "attn_backend": "sdpa", "logprob_keep_logits": True,
        "optimizer_cuda_graph": True, **KAHAN,
    },
}  # fmt: skip
CONFIGS = {
    "policy": {},
    "policy+chunked+compile+bf16": {"logprob_chunk_size": 4096, "compile": True, **BF16},
    "policy+chunked+compile+bf16+kahan": {"logprob_chunk_size": 4096, "compile": True, **KAHAN},
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


def titan_plain_loop(
    model_dir: str, tokens: torch.Tensor, warmup: int, steps: int, profile: bool = False, attn: str | None = None
) -> tuple[list[float], dict]:
    """`attn=None`: flex on a GPU (the baseline the issue names); 'sdpa': torchtitan's own SDPA (cuDNN first)."""
    from meshrl.models import qwen3

    dev = tokens.device
    attn = attn or ("flex" if dev.type == "cuda" else "sdpa")
    cfg = qwen3.titan_config_from_hf(qwen3.read_hf_config(model_dir), attn_backend=attn)
    model = qwen3.build_model_on_meta(cfg)
    model.to_empty(device=dev)
    with torch.no_grad():
        model.init_states(buffer_device=dev)
    model.load_state_dict(qwen3.hf_to_titan(qwen3.load_hf_state_dict(model_dir), cfg))
    model = model.to(torch.bfloat16)
    if dev.type == "cuda":
        for block in model.layers.values():
            block.compile()
    model.train()
    masks = None
    if attn == "flex":  # torchtitan's FlexAttention takes a BlockMask on every call: causal, one per row
        masks = model.get_attention_masks(torch.arange(tokens.shape[1], device=dev).expand(tokens.shape[0], -1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")

    def step() -> torch.Tensor:
        logits = model(tokens, attention_masks=masks) if masks is not None else model(tokens)
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    times, first_loss = [], None
    for i in range(warmup + steps):
        sync(dev)
        t0 = time.perf_counter()
        loss = step()
        sync(dev)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        if first_loss is None:
            first_loss = float(loss)
    extra = {"first_step_loss": first_loss}
    if profile:
        extra["profile"] = _profile(step, dev)
    return times, extra  # the model and optimiser are freed with this frame (main collects)


def policy_loop(
    model_dir: str,
    tokens: torch.Tensor,
    warmup: int,
    steps: int,
    levers: dict,
    backend: str = "hf",
    grad_clip: float = 1.0,
    profile: bool = False,
) -> tuple[list[float], dict]:
    from meshrl.policy import Policy
    from meshrl.types import Datum, LossSpec, OptimParams

    dev = tokens.device
    levers = dict(levers)
    attn = levers.pop("attn_backend", "flex" if (backend == "torchtitan" and dev.type == "cuda") else "sdpa")
    policy = Policy.from_options(
        model_dir, backend=backend, dtype="bfloat16", device=dev.type, attn_backend=attn, **levers
    )
    rows = tokens.tolist()
    data = [Datum.from_completion(r[:1], r[1:]) for r in rows]
    spec = LossSpec("cross_entropy", num_loss_tokens=sum(d.num_loss_tokens for d in data))
    times, fb_times, first_loss = [], [], None
    for i in range(warmup + steps):
        sync(dev)
        t0 = time.perf_counter()
        fb = policy.forward_backward(data, spec, step=OptimParams(lr=1e-5, grad_clip=grad_clip))  # as GRPO sends it
        t1 = time.perf_counter()  # forward_backward returns host values: the GPU is done with the backward
        sync(dev)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            fb_times.append(t1 - t0)
        if first_loss is None:  # same weights and data in every config: the levers must not change it
            first_loss = fb.loss
    extra = {"first_step_loss": first_loss, "forward_backward_s": median(fb_times)}
    if profile:

        def step() -> None:  # the outer range charges idle time outside Policy's own phases to the endpoint
            with record_function("meshrl.endpoint.forward_backward"):
                policy.forward_backward(data, spec, step=OptimParams(lr=1e-5, grad_clip=grad_clip))

        extra["profile"] = _profile(step, dev)
    return times, extra  # the policy is freed with this frame (main collects)


class GcPauses:
    """Time spent in Python's garbage collector while active (a host pause the GPU may wait for)."""

    def __init__(self) -> None:
        self.total_s, self.max_s, self.count, self._t0 = 0.0, 0.0, 0, 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            pause = time.perf_counter() - self._t0
            self.total_s, self.max_s, self.count = self.total_s + pause, max(self.max_s, pause), self.count + 1

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)


def _profile(step, dev: torch.device, n: int = 2) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof, GcPauses() as pauses:
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        sync(dev)
        wall = time.perf_counter() - t0
    try:
        summary = profile_summary(prof, n, wall)
    except Exception as e:  # noqa: BLE001 - a report bug must not cost the measured config
        summary = {"wall_per_step_s": wall / n, "gpu_busy_per_step_s": 0.0, "gpu_idle_fraction": 1.0, "error": repr(e)}
    summary["gc_ms_per_step"], summary["gc_max_pause_ms"] = pauses.total_s * 1e3 / n, pauses.max_s * 1e3
    return summary


def parse_config(name: str) -> tuple[dict, str | None, float]:
    """`[actor:|actor-wait:]<config>[+noclip]` -> (levers, how the PolicyTrainer actor is driven (None: `Policy`
    directly), grad_clip)."""
    prefix, _, rest = name.partition(":")
    via_actor = prefix if rest and prefix in ("actor", "actor-wait") else None
    base = rest if via_actor else name
    grad_clip = 0.0 if base.endswith("+noclip") else 1.0
    base = base.removesuffix("+noclip")
    levers = {**CONFIGS, **TITAN_CONFIGS}.get(base)
    if levers is None:
        known = ", ".join(["plain", "plain-titan", *CONFIGS, *TITAN_CONFIGS])
        raise SystemExit(f"unknown config {name!r}; known: {known} (prefix actor: or actor-wait:, suffix +noclip)")
    return levers, via_actor, grad_clip


def actor_loop(
    model_dir: str,
    tokens: torch.Tensor,
    warmup: int,
    steps: int,
    levers: dict,
    backend: str,
    grad_clip: float,
    wait_for_results: bool = False,
) -> tuple[list[float], dict]:
    """The same steps driven from this process through the PolicyTrainer actor (Monarch, one GPU process):
    the endpoints' cost (Datum pickling, actor calls, returned results) included. As the GRPO loop does it
    (`controller.training.train_step`), the `forward_backward` call carries the optimiser step; with
    `wait_for_results` (config prefix `actor-wait:`) it is a separate `optim_step` call after the result of
    `forward_backward` was read."""
    ensure_meshrl_layout()
    from meshrl.config import ModelConfig, TrainerConfig
    from meshrl.controller.api import Controller
    from meshrl.controller.training import train_step
    from meshrl.types import Datum, LossSpec, OptimParams

    on_gpu = tokens.device.type == "cuda"
    levers = dict(levers)
    attn = levers.pop("attn_backend", "flex" if (backend == "torchtitan" and on_gpu) else "sdpa")
    model_cfg = ModelConfig(path=model_dir, backend=backend, dtype="bfloat16", attn_backend=attn)
    trainer_cfg = TrainerConfig(
        num_procs=1, device="cuda" if on_gpu else "cpu", micro_batch_size=tokens.shape[0], **levers
    )
    data = [Datum.from_completion(r[:1], r[1:]) for r in tokens.tolist()]
    spec = LossSpec("cross_entropy", num_loss_tokens=sum(d.num_loss_tokens for d in data))
    pad = type("Tok", (), {"pad_id": 0})()
    times, first_loss = [], None
    with Controller(
        model_dir=model_dir, model_cfg=model_cfg, trainer_cfg=trainer_cfg, generator_cfg=None, tokenizer=pad,
        reward_weights=None, call_timeout_s=1800.0,
    ) as ctl:  # fmt: skip
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            params = OptimParams(lr=1e-5, grad_clip=grad_clip)
            if wait_for_results:
                fb = ctl.forward_backward(data, spec).result()
                ctl.optim_step(params).result()
            else:
                (fb,), _, _ = train_step(ctl, data, spec, len(data), params)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            first_loss = fb.loss if first_loss is None else first_loss
        peak = ctl.trainer_peak_memory_gib()  # the trainer's process, not this one
    return times, {"first_step_loss": first_loss, "peak_gib": peak}


# Kernel name fragments -> what the time went to (first match wins; lower-cased names).
KERNEL_KINDS = [
    ("attention", ("flex_attention", "fmha", "flash", "cudnn", "sdpa", "attention")),
    ("matmul", ("nvjet", "gemm", "xmma", "cutlass", "triton_tem_fused_mm", "triton_tem_fused_addmm")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("softmax", ("softmax",)),
    ("copy / fill", ("memcpy", "memset", "copy_kernel", "direct_copy", "fillfunctor")),
    ("fused elementwise (triton)", ("triton_",)),
    ("embedding", ("embedding", "index", "scatter", "sort", "radix")),
]


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def _device_kernels(events) -> list:
    """Kernel (and memcpy) events on the GPU, without the user-annotation ranges the profiler also puts there."""
    from torch.autograd import DeviceType

    return [
        e for e in events
        if getattr(e, "device_type", None) == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]  # fmt: skip


def profile_summary(prof, n_steps: int, wall_s: float) -> dict:  # noqa: C901 - one report
    """GPU busy time per step (sum of the kernels' own times; CPU-side ops that launched them are not counted
    again) against the wall time, the time by kind of kernel, the top kernels, and the largest idle gaps between
    consecutive kernels (with the kernels either side: where the GPU waited for the host)."""
    from torch.autograd import DeviceType

    kernels = [e for e in _device_kernels(prof.key_averages()) if e.self_device_time_total > 0]
    busy_us = sum(e.self_device_time_total for e in kernels)
    by_kind: dict[str, float] = {}
    for e in kernels:
        kind = kernel_kind(e.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + e.self_device_time_total / 1e3 / n_steps
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:20]
    timeline = sorted(_device_kernels(prof.events()), key=lambda e: e.time_range.start)
    # Host-side ranges a gap can be charged to: the Policy's named phases, the optimiser, aten ops.
    host = [
        e for e in prof.events()
        if getattr(e, "device_type", None) == DeviceType.CPU and e.name.startswith(("meshrl.", "Optimizer.", "aten::"))
    ]  # fmt: skip

    def charged_to(start: float, end: float) -> str:
        """The named host ranges covering most of [start, end]: the Policy's phase and the innermost op."""
        covering = [
            e for e in host
            if min(end, e.time_range.end) - max(start, e.time_range.start) > 0.5 * (end - start)
        ]  # fmt: skip
        phase = min((e for e in covering if e.name.startswith("meshrl.")), key=lambda e: e.cpu_time_total, default=None)
        op = min(covering, key=lambda e: e.time_range.end - e.time_range.start, default=None)
        names = [x.name for x in (phase, op) if x is not None]
        return " / ".join(dict.fromkeys(names)) or "(no profiled op: Python)"

    gaps, last_end, last_name = [], None, ""
    for e in timeline:  # a gap: no kernel running on any stream
        if last_end is not None and e.time_range.start - last_end > 20:  # µs
            gaps.append((e.time_range.start - last_end, last_name[:50], e.name[:50], last_end, e.time_range.start))
        if last_end is None or e.time_range.end >= last_end:
            last_end, last_name = e.time_range.end, e.name
    gaps.sort(reverse=True)
    by_phase: dict[str, float] = {}
    for g, *_, t0, t1 in gaps:
        phase = charged_to(t0, t1).split(" / ")[0]
        by_phase[phase] = by_phase.get(phase, 0.0) + g / 1e3 / n_steps
    return {
        "idle_ms_per_step_by_phase": dict(sorted(by_phase.items(), key=lambda kv: -kv[1])),
        "wall_per_step_s": wall_s / n_steps,
        "gpu_busy_per_step_s": busy_us / 1e6 / n_steps,
        "gpu_idle_fraction": 1 - busy_us / 1e6 / wall_s,
        "ms_per_step_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top_kernels_ms_per_step": [[e.key[:90], e.self_device_time_total / 1e3 / n_steps, e.count] for e in top],
        "gaps_over_20us_ms_per_step": sum(g[0] for g in gaps) / 1e3 / n_steps,
        "largest_gaps_ms": [[g / 1e3, before, after, charged_to(t0, t1)] for g, before, after, t0, t1 in gaps[:12]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--configs", default=None, help="comma-separated; 'plain' / 'plain-titan' = the baseline")
    ap.add_argument("--backend", default="hf", choices=["hf", "torchtitan"])
    ap.add_argument("--model-dir", default=None, help="reuse this random model dir (made here if missing)")
    ap.add_argument("--profile", action="store_true", help="also profile 2 steps: GPU busy vs wall, top kernels")
    ap.add_argument(
        "--flex-no-autotune", action="store_true",
        help="compile torchtitan's flex attention without max-autotune (it stalled on torch 2.14, GPU.md)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.flex_no_autotune:
        from torch.nn.attention.flex_attention import flex_attention
        from torchtitan.models.common.attention import FlexAttention

        FlexAttention.inductor_configs.update(max_autotune=False, coordinate_descent_tuning=False)
        FlexAttention._compiled_flex_attn = torch.compile(flex_attention, options=FlexAttention.inductor_configs)
    if args.configs is None:
        args.configs = ",".join(["plain", *CONFIGS] if args.backend == "hf" else ["plain-titan", *TITAN_CONFIGS])
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
    model_dir = make_model_dir(args.model_dir or tempfile.mkdtemp() + "/model", tiny=args.tiny)
    from transformers import AutoConfig

    hf_cfg = AutoConfig.from_pretrained(model_dir)
    vocab = hf_cfg.vocab_size
    n_params = sum(
        v.numel() for k, v in __import__("safetensors.torch", fromlist=["x"]).load_file(
            f"{model_dir}/model.safetensors").items() if k != "lm_head.weight"
    )  # fmt: skip
    flops_per_token = (
        6 * n_params + 12 * hf_cfg.num_hidden_layers * hf_cfg.num_attention_heads * hf_cfg.head_dim * args.seq
    )
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(dev)
    n_tok = args.batch * args.seq
    results: dict[str, dict] = {}
    payload = {
        "env": environment(), "batch": args.batch, "seq": args.seq, "backend": args.backend, "results": results,
        "flex_no_autotune": args.flex_no_autotune,
        "n_params": n_params, "flops_per_token": flops_per_token,
    }  # fmt: skip
    for name in args.configs.split(","):
        reset_peak(dev)
        t0 = time.perf_counter()
        try:
            if name == "plain":
                times, extra = plain_loop(model_dir, tokens, args.warmup, args.steps)
            elif name in ("plain-titan", "plain-titan-sdpa"):
                attn = "sdpa" if name.endswith("-sdpa") else None
                times, extra = titan_plain_loop(model_dir, tokens, args.warmup, args.steps, args.profile, attn)
            else:
                levers, via_actor, grad_clip = parse_config(name)
                if via_actor:
                    times, extra = actor_loop(
                        model_dir, tokens, args.warmup, args.steps, levers, args.backend, grad_clip,
                        wait_for_results=via_actor == "actor-wait",
                    )  # fmt: skip
                else:
                    times, extra = policy_loop(
                        model_dir, tokens, args.warmup, args.steps, levers, args.backend, grad_clip, args.profile
                    )
        except Exception as e:  # noqa: BLE001 - OOM or a backend failure: keep the other configs
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{name}: {results[name]['error']}", flush=True)
            gc.collect()
            continue
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        step = median(times)
        results[name] = {
            "levers": parse_config(name)[0] if not name.startswith("plain") else {},
            "mfu_989": flops_per_token * n_tok / step / 989e12,
            "mfu_779": flops_per_token * n_tok / step / 779e12,
            "mfu_6n_779": 6 * n_params * n_tok / step / 779e12,  # the count the issue quotes
            "step_s": step,
            "step_times_s": times,
            "tokens_per_s": n_tok / step,
            "peak_gib": peak_gib(dev),
            "wall_incl_build_and_warmup_s": time.perf_counter() - t0,
            **extra,
        }
        print(f"{name}: {n_tok / step:,.0f} tok/s, step {step:.3f}s, peak {results[name]['peak_gib']} GiB", flush=True)
        if "profile" in extra:
            prof = extra["profile"]
            print(
                f"  profile: wall {prof['wall_per_step_s']:.3f}s/step, GPU busy {prof['gpu_busy_per_step_s']:.3f}s "
                f"({1 - prof['gpu_idle_fraction']:.0%})",
                flush=True,
            )
            if "error" in prof:
                print(f"    profile report failed: {prof['error']}")
                prof = {**prof, "ms_per_step_by_kind": {}, "gaps_over_20us_ms_per_step": 0.0, "largest_gaps_ms": []}
                prof["top_kernels_ms_per_step"] = []
            print("    by kind: " + ", ".join(f"{k} {ms:.1f} ms" for k, ms in prof["ms_per_step_by_kind"].items()))
            print(
                f"    idle gaps > 20 us: {prof['gaps_over_20us_ms_per_step']:.1f} ms/step; Python GC "
                f"{prof['gc_ms_per_step']:.1f} ms/step (max pause {prof['gc_max_pause_ms']:.1f} ms); largest gaps:"
            )
            print("    idle by host phase: " + ", ".join(
                f"{k} {ms:.1f} ms" for k, ms in prof.get("idle_ms_per_step_by_phase", {}).items()))  # fmt: skip
            for ms, before, after, where in prof["largest_gaps_ms"]:
                print(f"      {ms:6.2f} ms in {where}: after {before} | before {after}")
            for key, ms, count in prof["top_kernels_ms_per_step"]:
                print(f"    {ms:8.2f} ms x{count:<5} {key}", flush=True)
        write_json("trainer_speed", payload)  # after every config: a later failure keeps what was measured
    base = (results.get("plain") or results.get("plain-titan") or {}).get("tokens_per_s")
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, None, None, None, None, None, r["error"][:60]])
            continue
        ratio = r["tokens_per_s"] / base if base else None
        rows.append(
            [
                name,
                r["tokens_per_s"],
                r["step_s"],
                f"{r['mfu_989']:.1%}",
                f"{r['mfu_6n_779']:.1%}",
                r["peak_gib"],
                ratio,
                r["first_step_loss"],
            ]
        )
    write_json("trainer_speed", payload)
    print_table(
        f"trainer, Qwen3-0.6B shape{' (TINY)' if args.tiny else ''}, batch {args.batch} x {args.seq}, "
        f"{payload['env']['device']}",
        ["config", "tokens/s", "step s", "MFU (989)", "MFU 6N (779)", "peak GiB", "x plain", "step-1 loss"],
        rows,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
