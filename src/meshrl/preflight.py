"""What can be known wrong about a run before any process starts: the checks that read files or devices, made first
thing in each program's main and refused with a ConfigError naming the flag, the file and the numbers. (Checks of
the command line alone are the configs' own `__post_init__`.)

    check_run_inputs(cfg)                          # checkpoint dir, process counts, lengths vs the model's context
    check_model_dir(path, backend="hf")            # one checkpoint directory (tokenizer files too), headers only
    check_tokenizer_fits(renderer, model_dir)      # a tokenizer of another model (vocabulary, eos / bos / pad ids)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshrl.config import EvalRunConfig, GeneratorConfig, GRPORunConfig, ModelConfig, SFTRunConfig, TrainerConfig
from meshrl.errors import ConfigError

if TYPE_CHECKING:
    from meshrl.rollout.render import Renderer

AnyRunConfig = GRPORunConfig | SFTRunConfig | EvalRunConfig


def check_run_inputs(cfg: AnyRunConfig, *, generator: bool = True) -> None:
    """What can be known wrong about a run before any process starts, refused first thing in each program's main
    with a ConfigError naming the flag, the file and the numbers: the checkpoint directory (`check_model_dir`) and
    its tokenizer (`check_tokenizer_fits`), trainer / reference process counts this machine cannot run
    (`check_process_counts`), and lengths past the model's context (`check_context`; `generator`: whether the run
    starts generators, whose max_model_len counts)."""
    trainer = None if isinstance(cfg, EvalRunConfig) else cfg.trainer
    if cfg.model.path is not None:
        check_model_dir(cfg.model.path, cfg.model.backend if trainer is not None else None)
        check_tokenizer_fits(None, cfg.model.path)
    reference_procs = cfg.grpo.reference_procs if isinstance(cfg, GRPORunConfig) and cfg.grpo.needs_reference else None
    if isinstance(cfg, GRPORunConfig) and cfg.placement.gpus is not None:
        check_gpu_count(cfg.placement.gpus)
    check_process_counts(trainer, cfg.generator, reference_procs=reference_procs)
    check_context(cfg, generator=generator)


def check_model_dir(path: str | Path, backend: str | None = None) -> None:
    """`--model.path` names a whole HF checkpoint directory that `backend` (if given) can train; else ConfigError
    naming the file and what is wrong: config.json parses and has its model_type and vocab_size, every weight
    file is there and no safetensors file is shorter than its header says (headers only: no tensor is read)."""
    if not Path(path).is_dir():
        raise ConfigError(
            f"--model.path {path}: {'not a directory' if Path(path).exists() else 'no such directory'}; give an HF "
            "checkpoint directory (config.json, weights, tokenizer files)"
        )
    if not Path(path, "config.json").is_file():
        raise ConfigError(
            f"--model.path {path}: no config.json there; give an HF checkpoint directory (config.json, weights, "
            "tokenizer files)"
        )
    from meshrl.models.hf_config import check_config_fields, check_weights

    check_config_fields(path)
    check_weights(path)
    check_tokenizer_files(path)
    if backend is not None:
        from meshrl.models.hf_config import check_backend_supports

        check_backend_supports(str(path), backend)


# The files a transformers tokenizer is read from (fast, sentencepiece, byte-level BPE, WordPiece, tiktoken, tekken).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "tekken.json",
    "tokenizer.tiktoken",
)


def check_tokenizer_files(path: str | Path) -> None:
    """The checkpoint directory holds a tokenizer: without one, transformers makes an empty tokenizer of the
    config's model type, and every prompt renders to no tokens."""
    path = Path(path)
    if any((path / name).is_file() for name in TOKENIZER_FILES) or any(path.glob("*.tiktoken")):
        return
    from meshrl.models.hf_config import read_json

    config = path / "tokenizer_config.json"
    tok_cfg = read_json(config, "the tokenizer's config") if config.is_file() else {}
    if isinstance(tok_cfg, dict) and "AutoTokenizer" in str(tok_cfg.get("auto_map", "")):
        return  # the model's own tokenizer code (trust_remote_code) says where its vocabulary is
    raise ConfigError(
        f"--model.path {path}: no tokenizer files there (none of {', '.join(TOKENIZER_FILES)}), so its prompts would "
        "render to no tokens; put the model's own tokenizer next to its weights, e.g. "
        f"AutoTokenizer.from_pretrained(ORIGINAL_CHECKPOINT).save_pretrained('{path}')"
    )


def check_tokenizer_fits(renderer: Renderer | Any | None, model_dir: str | Path) -> None:
    """The tokenizer in `model_dir` is the model's own: refuse at launch one of another model, whose ids would mean
    other tokens to the weights (prompts read as other words, generation that never stops). `renderer`: a Renderer
    or a transformers tokenizer already loaded; None loads the directory's. Compared with config.json (and
    generation_config.json): the vocabulary (more tokens than the model's rows, or fewer than half of them: models
    pad their vocabulary a little, never by half) and the eos / bos / pad ids where both name one (the tokenizer's
    eos must be one the model stops at; a pad that is an eos id is the usual stand-in)."""
    from meshrl.models.hf_config import _ids, read_config, read_json, text_config

    if renderer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    else:
        tokenizer = getattr(renderer, "tokenizer", renderer)
    hf = read_config(model_dir)
    gen_path = Path(model_dir) / "generation_config.json"
    gen = read_json(gen_path, "the generation config") if gen_path.is_file() else {}
    wrong = []
    vocab, n = text_config(hf).get("vocab_size"), len(tokenizer)
    if isinstance(vocab, int) and not isinstance(vocab, bool) and not vocab / 2 <= n <= vocab:
        wrong.append(f"the tokenizer has {n} tokens, the model's vocabulary {vocab} (config.json vocab_size)")
    eos_ids = set()
    for key in ("eos", "bos", "pad"):
        configured = {
            i for d in (hf, text_config(hf), gen) if isinstance(d, dict) for i in _ids(d.get(f"{key}_token_id"))
        }
        eos_ids |= configured if key == "eos" else set()
        token, token_id = getattr(tokenizer, f"{key}_token", None), getattr(tokenizer, f"{key}_token_id", None)
        if token_id is None or not configured or token_id in configured or (key == "pad" and token_id in eos_ids):
            continue
        said = f"config.json / generation_config.json say {key}_token_id {', '.join(map(str, sorted(configured)))}"
        wrong.append(f"its {key} token {token!r} is id {token_id}, {said}")
    if wrong:
        raise ConfigError(
            f"the tokenizer in {model_dir} and the model's config belong to different models: {'; '.join(wrong)}. "
            "Put the model's own tokenizer files next to its weights (or, if this tokenizer is the model's own, "
            "correct config.json / generation_config.json)"
        )


def model_context(model_cfg: ModelConfig) -> tuple[int, str] | None:
    """(the model's context length in positions, where that is written) for `--model.path` or, without one, the new
    model of `--model.flavor`; None when the config gives no context length (nothing to check against)."""
    if model_cfg.path is not None:
        return model_dir_context(model_cfg.path)
    from meshrl.models.config import VLM_FLAVORS
    from meshrl.models.qwen3 import CODE_FLAVORS, hf_config_dict

    if model_cfg.flavor in VLM_FLAVORS:
        import inspect

        from meshrl.models.tiny_vlm import tiny_vlm_config

        n = inspect.signature(tiny_vlm_config).parameters["max_position_embeddings"].default
        return n, f"max_position_embeddings={n} of the new --model.flavor {model_cfg.flavor} model"
    hf = CODE_FLAVORS.get(model_cfg.flavor) or hf_config_dict(model_cfg.flavor, vocab_size=1)
    n = hf["max_position_embeddings"]
    return n, f"max_position_embeddings={n} of the new --model.flavor {model_cfg.flavor} model"


def model_dir_context(model_dir: str | Path) -> tuple[int, str] | None:
    """(the context length in positions, where it is written) of the checkpoint in `model_dir`, from its
    config.json; None when no field gives it."""
    from meshrl.models.hf_config import context_length, read_config

    found = context_length(read_config(model_dir))
    if found is None:
        return None
    return found[1], f"{found[0]}={found[1]} in {Path(model_dir) / 'config.json'}"


def check_context(cfg: AnyRunConfig, *, generator: bool = True) -> None:
    """No sequence length a run is configured for may pass the model's context: positions past it have no embedding
    (learned tables index out of range; RoPE models run but were never trained there), and the failure would come
    mid-run, at the first long batch, and again on resume."""
    known = model_context(cfg.model)
    if known is None:
        return
    context, where = known
    lengths = []
    if generator:
        lengths.append(("--generator.max-model-len", cfg.generator.max_model_len))
    if isinstance(cfg, SFTRunConfig):  # only SFT's data section sets sequence lengths of its own
        for flag, value in (("--data.max-seq-len", cfg.data.max_seq_len), ("--data.pack-len", cfg.data.pack_len)):
            if value is not None:
                lengths.append((flag, value))
    for flag, value in lengths:
        if value > context:
            raise ConfigError(
                f"{flag} {value} is longer than the model's context of {context} positions ({where}); use "
                f"{flag} {context} or less"
            )


def visible_gpus() -> int | None:
    """GPUs this process may use, without initialising CUDA (the actors must be the first to touch it): the
    entries of CUDA_VISIBLE_DEVICES (up to the first invalid one, as CUDA reads it), else the driver's list of
    GPUs. None when neither says (no NVIDIA driver here): nothing to check against."""
    driver = Path("/proc/driver/nvidia/gpus")
    installed = len(list(driver.iterdir())) if driver.is_dir() else None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return installed
    count = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        count += 1
    return count if installed is None else min(count, installed)


def check_gpu_count(gpus: int) -> None:
    """--placement.gpus N needs N GPUs that this process sees."""
    seen = visible_gpus() or 0
    if seen < gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = "the driver's list" if visible is None else f"CUDA_VISIBLE_DEVICES={visible!r}"
        if seen == 0 and visible is None:
            do = "leave --placement.gpus out to run on the CPU, or run where the GPUs are"
        else:
            do = f"use --placement.gpus {max(seen, 1)}{' or make the GPUs visible' if visible is not None else ''}"
        raise ConfigError(
            f"--placement.gpus {gpus}, but this process sees {seen} GPU{'s' if seen != 1 else ''} ({where}); {do}"
        )


def check_process_counts(
    trainer: TrainerConfig | None, generator: GeneratorConfig, *, reference_procs: int | None = None
) -> None:
    """Refuse trainer (and reference-model: `reference_procs`, None when the run has none) process counts this
    machine cannot run. A CPU trainer needs a core per rank: the ranks meet in a collective every step, so a rank
    waiting for a core stalls all of them, and each rank is a process holding torch and its own shard (64 ranks on 2
    cores exhaust the memory before the first step). Generator and reward processes are not counted: they wait while
    the trainer computes. On cuda, rank r takes GPU r unless --trainer.devices places the ranks, and every GPU index
    must be one this process can see. `trainer` None: a run without one (evaluation)."""
    meshes = [("--trainer.num-procs", trainer.num_procs)] if trainer is not None else []
    if reference_procs is not None:
        meshes.append(("--grpo.reference-procs", reference_procs))
    gpus = visible_gpus()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = "the driver's list" if visible is None else f"CUDA_VISIBLE_DEVICES={visible!r}"
    sees = f"this process sees {gpus} GPU{'s' if gpus != 1 else ''} ({where})"
    for flag, devices in (
        ("--trainer.devices", trainer.devices if trainer is not None else None),
        ("--generator.devices", generator.devices),
    ):
        bad = [d for d in devices or () if gpus is not None and d >= gpus]
        if bad:
            raise ConfigError(f"{flag} {list(devices)} names GPU {bad[0]}, but {sees}; use indices below {gpus}")
    if trainer is None:
        return
    if trainer.device == "cpu":
        cores = len(os.sched_getaffinity(0))
        for flag, n in meshes:
            if n > cores:
                raise ConfigError(
                    f"{flag} {n} with --trainer.device cpu: this machine gives the run {cores} CPU core"
                    f"{'s' if cores != 1 else ''}, and a CPU trainer needs a core per rank (they meet in a collective "
                    f"every step; each rank is a process of its own); use {flag} {cores} or fewer"
                )
        return
    for flag, n in meshes:
        if gpus is not None and n > gpus and (flag != "--trainer.num-procs" or trainer.devices is None):
            hint = ", or place the ranks with --trainer.devices" if flag == "--trainer.num-procs" else ""
            raise ConfigError(
                f"{flag} {n} with --trainer.device cuda puts one rank on each GPU, but {sees}; use {flag} {gpus} or "
                f"fewer{hint}"
            )
