"""GPU-aware defaults (`--run.gpu-defaults`, on unless turned off): on a machine whose GPUs this process sees, the
programs' command line (grpo, sft, eval) fills in the GPU settings a user did not give, instead of the dataclasses'
defaults, which are CPU's. Without GPUs the config comes back as it went in.

    given = given_fields(args, preset_cfg=PRESETS[name](), default_cfg=GRPORunConfig())
    cfg, lines = resolve_gpu_defaults(cfg, given, detect_machine(cfg, given))   # lines: what was resolved, and why

`resolve_gpu_defaults` is a pure function of the parsed config, the fields the user gave and a `Machine` (a plain
description: GPUs, whether vLLM and torchtitan import, the checkpoint's architecture), so tests describe machines
they do not have; `detect_machine` is the only part that looks at this one. It runs on the command line's path
(controller/cli.py), never in a config's `__post_init__`: a config built in Python stays as written. No Monarch here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from collections.abc import Iterable, Set
from dataclasses import dataclass
from typing import Any, TypeVar

from meshrl.errors import ConfigError

C = TypeVar("C")

LOGPROB_CHUNK_SIZE = 4096
"""Tokens per chunk of the logprob head: the same values as full logits to float32 rounding, and measured faster on
one H100 (bench/NOTES.md, 'after+chunk': the training phase 9.2 -> 8.4 s and 7.5 -> 6.9 s, logprob gap unchanged)."""

# Fields `--placement.gpus` fills in when they are at their defaults. Given explicitly at exactly the default value,
# the layout cannot tell them from unset and would overwrite them: then the placement is left to the user.
_LAYOUT_FIELDS = (
    "trainer.num_procs",
    "trainer.devices",
    "trainer.micro_batch_size",
    "generator.num_replicas",
    "generator.devices",
    "grpo.max_staleness",
)

# What each probe imports: what the torchtitan backend and the vLLM engine import when they start. In a child
# process, because a vLLM built against another torch can crash the interpreter on import (its compiled `_C`), and
# the controller should not carry either library only to learn whether it loads.
_PROBES = {
    "torchtitan": "from torchtitan.models.qwen3 import parallelize_qwen3\n"
    "from torchtitan.distributed import ParallelDims",
    "vllm": "from vllm import LLM\nimport vllm._C\nfrom vllm.platforms import current_platform\n"
    "assert current_platform.is_cuda(), 'vLLM without CUDA'",
}
# vLLM's vision-language models import torchvision too (a torchvision built for another torch fails there).
_PROBES["vllm_vision"] = _PROBES["vllm"] + "\nimport torchvision"
_PROBE_PACKAGE = {"vllm": "vllm", "vllm_vision": "vllm", "torchtitan": "torchtitan"}  # not installed: no probe
_PROBE_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Machine:
    """What the resolution needs to know about the machine the run starts on."""

    gpus: int
    """GPUs this process sees (torch.cuda.device_count(): CUDA_VISIBLE_DEVICES applies)."""
    vllm_cuda: bool = False
    """vLLM imports here, built with CUDA (for a vision-language model: and torchvision with it)."""
    vision: bool = False
    """The model is a vision-language model (its checkpoint has a vision tower, or a VLM flavor)."""
    torchtitan: bool = False
    """torchtitan imports here (it does not on every torch: ../shared/GPU.md)."""
    model_type: str | None = None
    """config.json's model_type of --model.path ('qwen3', 'llama', ...); None: no path, or unreadable."""


def given_fields(args: Iterable[str], *, preset_cfg: Any = None, default_cfg: Any = None) -> set[str]:
    """Dotted field names ('trainer.device') the user gave: each `--section.field[=value]` flag of `args` (tyro
    spells fields with hyphens; a boolean's `--section.no-field` names `field`), and every field where the preset
    differs from the dataclasses' defaults (a preset's choice counts as given)."""
    given: set[str] = set()
    for a in args:
        if not a.startswith("--") or a == "--":
            continue
        name = a[2:].split("=", 1)[0].replace("-", "_")
        given.add(name)
        head, _, last = name.rpartition(".")
        if last.startswith("no_"):
            given.add(f"{head}.{last[3:]}" if head else last[3:])
    if preset_cfg is not None and default_cfg is not None:
        preset, default = _flat(dataclasses.asdict(preset_cfg)), _flat(dataclasses.asdict(default_cfg))
        given |= {k for k, v in preset.items() if default.get(k) != v}
    return given


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _is_given(given: Set[str], name: str) -> bool:
    return name in given or any(g.startswith(name + ".") for g in given)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def resolve_gpu_defaults(cfg: C, given: Set[str], machine: Machine) -> tuple[C, list[str]]:
    """`cfg` with the GPU settings the user did not give (`given`, from `given_fields`) resolved for `machine`, and
    one line per resolved setting saying why. 0 GPUs: `cfg` itself, no lines. Any number of GPUs:

    - --trainer.device cuda; --model.dtype and --generator.dtype bfloat16 (bf16 compute; the master weights and the
      AdamW state stay --trainer.master-dtype's, float32 by default);
    - --model.backend torchtitan for a Qwen3 model (a new one, or a checkpoint whose config.json says qwen3) when
      torchtitan imports, else hf (any transformers causal LM; LoRA needs it);
    - --generator.engine vllm when vLLM imports with CUDA (for a vision-language model: with torchvision), else
      transformers;
    - --trainer.logprob-chunk-size 4096 (same values to float32 rounding, measured faster);
    - grpo: --placement.gpus N, every GPU seen, in the layout measured fastest (config.GRPORunConfig._lay_out_gpus);
      sft: --trainer.num-procs, one rank per GPU (a power of two that splits the batch).

    Nothing that changes numerics (bf16 master weights, an fp8 KV cache) or torch.compile. Not applied, `cfg`
    returned with a line saying why: --run.no-gpu-defaults, --placement on other hosts, --trainer.device cpu given,
    or a resolved config that the checks refuse (e.g. a preset's --generator.weight-sync shm, a CPU transport)."""
    n = machine.gpus
    if n < 1:
        return cfg, []
    run = cfg.run  # type: ignore[attr-defined]
    if not run.gpu_defaults:
        return cfg, [f"off (--run.no-gpu-defaults): {n} GPU(s) seen, the config as given"]
    placement = cfg.placement  # type: ignore[attr-defined]
    if placement.kind != "local":
        return cfg, [
            f"not applied: --placement {placement.kind} starts the processes on other hosts, whose GPUs this one "
            "does not see; give --trainer.device cuda and the rest yourself"
        ]
    trainer = getattr(cfg, "trainer", None)  # evaluation has no trainer
    if trainer is not None and trainer.device == "cpu" and _is_given(given, "trainer.device"):
        return cfg, [f"not applied: --trainer.device cpu given ({n} GPU(s) seen)"]

    changes: dict[str, dict[str, Any]] = {}
    lines: list[str] = []

    def resolve(name: str, value: Any, why: str) -> None:
        if _is_given(given, name):
            return
        section, field = name.split(".", 1)
        changes.setdefault(section, {})[field] = value
        lines.append(f"{_flag(name)} {value} ({why})")

    if trainer is not None:
        model = cfg.model  # type: ignore[attr-defined]
        resolve("trainer.device", "cuda", f"{n} GPU(s) seen")
        resolve("model.dtype", "bfloat16", f"bf16 compute; master weights and AdamW state {trainer.master_dtype}")
        backend, why = _backend(model, machine)
        resolve("model.backend", backend, why)
        resolve("trainer.logprob_chunk_size", LOGPROB_CHUNK_SIZE, "chunked logprob head: same values to float32 "
                "rounding, no [B, T, V] float32 logits; measured faster on one H100")  # fmt: skip
    resolve(
        "generator.dtype",
        "bfloat16",
        "the engine computes in bf16" + (", the weights cross in it" if trainer is not None else ""),
    )
    if machine.vllm_cuda:
        engine = ("vllm", "vLLM imports with CUDA" + (" (and torchvision: a vision model)" if machine.vision else ""))
    else:
        missing = "vLLM (with torchvision, which its vision-language models import)" if machine.vision else "vLLM"
        engine = ("transformers", f"{missing} does not import with CUDA here: meshrl's engine, CUDA-graph decode")
    resolve("generator.engine", *engine)

    from meshrl.config import GRPORunConfig, SFTRunConfig

    if isinstance(cfg, GRPORunConfig) and not _is_given(given, "placement.gpus"):
        fixed = [f for f in _LAYOUT_FIELDS if f in given and _value(cfg, f) == _value(type(cfg)(), f)]
        if fixed:
            lines.append(
                f"--placement.gpus left unset: {', '.join(_flag(f) for f in fixed)} given at the default value, "
                "which the GPU layout would overwrite; place the processes with --trainer.devices / "
                "--generator.devices"
            )
        else:
            resolve("placement.gpus", n, "every GPU seen, in the measured layout printed below")
    if isinstance(cfg, SFTRunConfig) and not _is_given(given, "trainer.devices"):
        ranks = _sft_ranks(n, cfg.sft.batch_size, trainer.micro_batch_size)
        resolve("trainer.num_procs", ranks, f"an FSDP rank per GPU on {ranks} of {n}: a power of two that splits "
                f"--sft.batch-size {cfg.sft.batch_size}")  # fmt: skip

    if not changes:
        return cfg, lines
    try:
        sections = {name: dataclasses.replace(getattr(cfg, name), **fields) for name, fields in changes.items()}
        # replace() runs __post_init__ again: the run config's cross-section checks, and _lay_out_gpus for grpo.
        return dataclasses.replace(cfg, **sections), lines
    except ConfigError as e:
        return cfg, [
            f"not applied ({n} GPU(s) seen): with them the config is refused: {e}; the run goes on as given (CPU "
            "defaults): give the GPU flags yourself, or silence this with --run.no-gpu-defaults"
        ]


def _value(cfg: Any, name: str) -> Any:
    for part in name.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _backend(model: Any, machine: Machine) -> tuple[str, str]:
    """The trainer backend for this model, and why."""
    from meshrl.models.hf_config import BACKEND_MODEL_TYPES

    if model.lora_rank:
        return "hf", "LoRA adapters train through peft on transformers models"
    # Without --model.path the run makes a new Qwen3 (with torchtitan's initialisation).
    arch = "qwen3" if model.path is None else machine.model_type
    titan = BACKEND_MODEL_TYPES["torchtitan"] or frozenset()
    if arch not in titan:
        what = f"a {arch!r} model" if arch else "the model's config.json gives no model_type"
        return "hf", f"torchtitan takes {'/'.join(sorted(titan))} only; {what}"
    if not machine.torchtitan:
        return "hf", f"a {arch} model, but torchtitan does not import here"
    return "torchtitan", f"a {arch} model, and torchtitan imports"


def _sft_ranks(gpus: int, batch_size: int, micro_batch_size: int) -> int:
    """The most trainer ranks, a power of two and at most `gpus`, that split SFT's batch and micro-batch cap evenly
    (validate_batch_arithmetic refuses the others)."""
    ranks = 1
    while ranks * 2 <= gpus and batch_size % (ranks * 2) == 0 and micro_batch_size % (ranks * 2) == 0:
        ranks *= 2
    return ranks


def detect_machine(cfg: Any, given: Set[str]) -> Machine:
    """This machine, as far as the resolution of `cfg` needs it: the GPUs first (without initialising CUDA: NVML),
    then, only with GPUs and only where a flag left the choice open, whether vLLM and torchtitan import (a child
    process each, seconds) and the checkpoint's architecture (config.json)."""
    gpus = visible_gpus()
    if gpus < 1 or not cfg.run.gpu_defaults:
        return Machine(gpus)
    model = cfg.model
    model_type = None
    if model.path is not None:
        from meshrl.models.hf_config import read_config

        try:
            model_type = read_config(model.path).get("model_type")
        except (ConfigError, OSError):
            model_type = None  # preflight names the problem at launch
    from meshrl.models.config import VLM_FLAVORS
    from meshrl.models.vision import is_vision_checkpoint

    vision = is_vision_checkpoint(model.path) if model.path is not None else model.flavor in VLM_FLAVORS
    trains = getattr(cfg, "trainer", None) is not None
    wants_titan = trains and not _is_given(given, "model.backend") and (model.path is None or model_type == "qwen3")
    return Machine(
        gpus=gpus,
        vllm_cuda=not _is_given(given, "generator.engine") and imports("vllm_vision" if vision else "vllm"),
        vision=vision,
        torchtitan=wants_titan and not model.lora_rank and imports("torchtitan"),
        model_type=model_type,
    )


def visible_gpus() -> int:
    """GPUs this process sees; 0 on a CPU build of torch. NVML first, so CUDA is not initialised here (the actors,
    pinned to their GPUs, must be the first to touch it)."""
    import torch

    return torch.cuda.device_count()


def imports(what: str) -> bool:
    """Whether `what` ('vllm': with CUDA; 'vllm_vision': that and torchvision; 'torchtitan') imports in a child
    process of this interpreter."""
    if importlib.util.find_spec(_PROBE_PACKAGE[what]) is None:
        return False
    try:
        done = subprocess.run([sys.executable, "-c", _PROBES[what]], capture_output=True, timeout=_PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0
