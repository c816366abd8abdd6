"""Facts about an HF checkpoint directory that the launcher, trainers and engines all need, read one way.

Architectures name the same things differently in `config.json` (GPT-2: `n_positions`, `n_ctx`; Llama/Qwen:
`max_position_embeddings`; some remote-code models: `max_seq_len`, `seq_length`), keep their text fields under
`text_config` (multimodal models), and spread their stop tokens over `config.json`, `generation_config.json` and
the tokenizer. These helpers read plain files only (json; the tokenizer files without building a tokenizer), so
the controller can call them at launch, before any process starts, without torch or transformers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshrl.errors import ConfigError

# Context-length fields, in the order they are trusted. GPT-2's `n_positions` is the size of its learned position
# table (`n_ctx` is an old alias of it); ChatGLM/Baichuan-style configs use `seq_length` / `max_seq_len`.
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length", "seq_length")

# Which `model_type`s each trainer backend loads (None: any transformers causal LM).
BACKEND_MODEL_TYPES: dict[str, frozenset[str] | None] = {"torchtitan": frozenset({"qwen3"}), "hf": None}
_DISPLAY = {"qwen3": "Qwen3"}


def _as_dict(cfg: Any) -> dict[str, Any]:
    if isinstance(cfg, Mapping):
        return dict(cfg)
    if hasattr(cfg, "to_dict"):  # a transformers PretrainedConfig
        return cfg.to_dict()
    raise TypeError(f"expected a config dict or a transformers config, got {type(cfg).__name__}")


def text_config(cfg: Mapping[str, Any] | Any) -> dict[str, Any]:
    """The language model's part of a config (multimodal configs keep it under `text_config`)."""
    d = _as_dict(cfg)
    inner = d.get("text_config")
    return {**d, **inner} if isinstance(inner, Mapping) else d


def max_positions(cfg: Mapping[str, Any] | Any, default: int | None = None) -> int:
    """The model's context length (positions it has embeddings / was trained for), from a `config.json` dict or a
    transformers config object, whatever the architecture calls it. No such field: `default`, or a ValueError."""
    found = context_length(cfg)
    if found is not None:
        return found[1]
    d = text_config(cfg)
    if default is not None:
        return int(default)
    raise ValueError(
        f"the model config ({d.get('model_type', 'unknown model_type')!r}) gives no context length: none of "
        f"{list(POSITION_KEYS)} is set"
    )


class NotACheckpointError(ConfigError, FileNotFoundError):
    """A model path without config.json: a config error for the user, a missing file for file-handling code."""


def read_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """config.json of an HF checkpoint directory (the one reader: meshrl.models.qwen3.read_hf_config is this)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise NotACheckpointError(
            f"{path} not found: model.path must be an HF-format checkpoint directory "
            "(config.json, *.safetensors, tokenizer files)"
        )
    return read_json(path, "the checkpoint's config")


def read_json(path: str | os.PathLike, what: str) -> dict[str, Any]:
    """A JSON object file of a checkpoint, or a ConfigError naming the file and what is wrong with it."""
    try:
        data = json.loads(Path(path).read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path} ({what}) is not UTF-8 text: byte 0x{e.object[e.start]:02x} at offset {e.start}; the file is "
            "damaged or not a JSON file: restore it from the original checkpoint"
        ) from None
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{path} ({what}) is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}; the file is damaged "
            "(an interrupted copy or edit?): restore it from the original checkpoint"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path} ({what}) holds a JSON {type(data).__name__}, not an object of fields; restore it from the "
            "original checkpoint"
        )
    return data


def context_length(cfg: Mapping[str, Any] | Any) -> tuple[str, int] | None:
    """(field name, value) of the model's context length as `max_positions` reads it; None when no field gives it."""
    d = text_config(cfg)
    for key in POSITION_KEYS:
        value = d.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return key, value
    return None


def check_config_fields(model_dir: str | os.PathLike) -> dict[str, Any]:
    """config.json, with the fields every loader reads (`model_type`, `vocab_size`) present and well-typed;
    else a ConfigError naming the file and the field. Reads the one file only."""
    path = Path(model_dir) / "config.json"
    cfg = read_config(model_dir)
    mt = cfg.get("model_type")
    if not isinstance(mt, str) or not mt:
        got = "no 'model_type'" if mt is None else f"model_type={mt!r}"
        raise ConfigError(
            f"{path} has {got}: transformers cannot tell the architecture; it is not a transformers config "
            "(or is damaged): restore it from the original checkpoint"
        )
    vocab = text_config(cfg).get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        got = "no 'vocab_size'" if vocab is None else f"vocab_size={vocab!r}"
        raise ConfigError(
            f"{path} has {got} (a positive integer: the rows of the embedding); restore it from the original checkpoint"
        )
    return cfg


# A safetensors header is at most 100 MB (the format's own limit): a larger length means a damaged file.
_MAX_SAFETENSORS_HEADER = 100 * 2**20


def check_safetensors(path: str | os.PathLike) -> None:
    """A safetensors file whole, judged from its header only (8-byte little-endian length, then JSON naming each
    tensor's byte range): a file shorter than its header says is truncated. Reads no tensor data."""
    path = Path(path)
    size = path.stat().st_size
    hint = "copy or download it again (an interrupted transfer leaves such files)"
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConfigError(f"{path} is {size} bytes, too short for a safetensors file (8-byte length): {hint}")
        n = int.from_bytes(head, "little")
        if n > _MAX_SAFETENSORS_HEADER or 8 + n > size:
            raise ConfigError(
                f"{path}: its first 8 bytes give a {n}-byte header, but the file has {size} bytes: it is truncated "
                f"or not a safetensors file; {hint}"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: the safetensors header is not JSON ({e}); the file is damaged: {hint}") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: the safetensors header is a JSON {type(header).__name__}, not an object: {hint}")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, Mapping) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise ConfigError(f"{path}: tensor {name!r} has no [begin, end] data_offsets in the header: {hint}")
        end = max(end, offsets[1])
    data = size - 8 - n
    if end > data:
        raise ConfigError(
            f"{path} is truncated: its header places tensor data up to byte {end} after the header, but the file "
            f"holds {data} bytes there ({size} bytes in all, {end - data} missing); {hint}"
        )


def check_weights(model_dir: str | os.PathLike) -> None:
    """The checkpoint's weight files exist and (safetensors) are whole: every shard a `*.safetensors.index.json`
    names, and every `*.safetensors` file by its header. Raises ConfigError naming the file."""
    d = Path(model_dir)
    for index in sorted(d.glob("*.safetensors.index.json")):
        weight_map = read_json(index, "the index of the weight shards").get("weight_map")
        if not isinstance(weight_map, Mapping):
            raise ConfigError(f"{index} has no 'weight_map' object: restore it from the original checkpoint")
        missing = sorted({str(f) for f in weight_map.values()} - {p.name for p in d.iterdir()})
        if missing:
            raise ConfigError(
                f"{index} names weight shards that are not in {d}: {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
                "copy the whole checkpoint directory"
            )
    shards = sorted(d.glob("*.safetensors"))
    if not shards and not any(d.glob("pytorch_model*.bin")):
        raise ConfigError(
            f"{d} has a config.json but no weights (*.safetensors or pytorch_model*.bin): give the whole HF "
            "checkpoint directory"
        )
    for shard in shards:
        check_safetensors(shard)


def model_type(model_dir: str | os.PathLike) -> str:
    """`config.json`'s `model_type` ('qwen3', 'llama', 'gpt2', ...)."""
    cfg = read_config(model_dir)
    mt = cfg.get("model_type")
    if not mt:
        raise ConfigError(f"{Path(model_dir) / 'config.json'} has no model_type: not a transformers checkpoint")
    return str(mt)


def check_backend_supports(model_dir: str | os.PathLike, backend: str) -> None:
    """Refuse, with what to do instead, a trainer backend that cannot load this checkpoint's architecture.
    Call it at launch: it only reads config.json."""
    if backend not in BACKEND_MODEL_TYPES:
        raise ConfigError(f"model.backend={backend!r}; use one of {sorted(BACKEND_MODEL_TYPES)}")
    allowed = BACKEND_MODEL_TYPES[backend]
    mt = model_type(model_dir)
    if allowed is not None and mt not in allowed:
        kinds = "/".join(sorted(_DISPLAY.get(a, a) for a in allowed))
        raise ConfigError(
            f"model.backend={backend!r} loads {kinds} checkpoints only; {model_dir} is a {mt!r} model: "
            "use --model.backend hf"
        )


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _token_content(tok: Any) -> str | None:
    if isinstance(tok, str):
        return tok
    if isinstance(tok, Mapping):  # an AddedToken saved as a dict
        content = tok.get("content")
        return content if isinstance(content, str) else None
    return None


def tokenizer_eos_token_id(model_dir: str | os.PathLike) -> int | None:
    """The tokenizer's eos token id, read from `tokenizer_config.json` / `special_tokens_map.json` (its name) and
    `tokenizer.json` (its id: added tokens, then the model's vocabulary). None when the files do not say."""
    d = Path(model_dir)
    name = None
    for fname in ("tokenizer_config.json", "special_tokens_map.json"):
        f = d / fname
        if f.is_file():
            name = _token_content(json.loads(f.read_text()).get("eos_token"))
            if name:
                break
    if not name:
        return None
    tok_json = d / "tokenizer.json"
    if tok_json.is_file():
        data = json.loads(tok_json.read_text())
        for added in data.get("added_tokens") or []:
            if added.get("content") == name:
                return int(added["id"])
        vocab = (data.get("model") or {}).get("vocab")
        if isinstance(vocab, Mapping) and name in vocab:
            return int(vocab[name])
    vocab_json = d / "vocab.json"
    if vocab_json.is_file():
        vocab = json.loads(vocab_json.read_text())
        if name in vocab:
            return int(vocab[name])
    added_json = d / "added_tokens.json"
    if added_json.is_file():
        added = json.loads(added_json.read_text())
        if name in added:
            return int(added[name])
    return None


def stop_token_ids(model_dir: str | os.PathLike) -> list[int]:
    """Every token id that ends a generation for this checkpoint, sorted: the union of `generation_config.json`'s
    `eos_token_id` (an int or a list: Qwen instruct models list both `<|im_end|>` and `<|endoftext|>`),
    `config.json`'s (and its `text_config`'s), and the tokenizer's eos token. Pass them to the engines as
    `SamplingParams.stop_token_ids` (the engines add them themselves, too)."""
    d = Path(model_dir)
    ids: set[int] = set()
    gen = d / "generation_config.json"
    if gen.is_file():
        ids.update(_ids(json.loads(gen.read_text()).get("eos_token_id")))
    cfg = read_config(d)
    ids.update(_ids(cfg.get("eos_token_id")))
    if isinstance(cfg.get("text_config"), Mapping):
        ids.update(_ids(cfg["text_config"].get("eos_token_id")))
    tok = tokenizer_eos_token_id(d)
    if tok is not None:
        ids.add(tok)
    return sorted(ids)


__all__ = [
    "BACKEND_MODEL_TYPES",
    "POSITION_KEYS",
    "check_backend_supports",
    "check_config_fields",
    "check_safetensors",
    "check_weights",
    "context_length",
    "max_positions",
    "model_type",
    "read_config",
    "read_json",
    "stop_token_ids",
    "text_config",
    "tokenizer_eos_token_id",
]
