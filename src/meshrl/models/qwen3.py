"""torchtitan's Qwen3 family with HF checkpoints in and out.

The HF `config.json` is the source of truth for the architecture: we build the torchtitan config from it, so
any Qwen3 checkpoint a transformers or vLLM user has loads here, and what we save (through torchtitan's
`Qwen3StateDictAdapter`) loads there. A model without a checkpoint is first initialised at random and saved
in HF format, so every run starts from a directory the generator can load too.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from meshrl.models.hf_config import max_positions
from meshrl.models.hf_config import read_config as read_hf_config  # noqa: F401 - public here too
from meshrl.models.titan_import import import_torchtitan_qwen3

# The HF config of the 'tiny' CPU flavor; vocab_size comes from the task's tokenizer.
TINY_HF_CONFIG: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
# 'small': ~63M parameters (16 layers of 512, GQA 8/4, tied embeddings), a Qwen3 shape between 'tiny' and 0.6B that a
# GPU trains in minutes (the gpu-math preset) and that learns multi-digit arithmetic, which 'tiny' cannot.
SMALL_HF_CONFIG: dict[str, Any] = dict(
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=16,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=512,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
CODE_FLAVORS = {"tiny": TINY_HF_CONFIG, "small": SMALL_HF_CONFIG}  # shapes defined here (no torchtitan needed)
TITAN_FLAVORS = {"0.6B", "1.7B", "4B", "8B", "14B", "32B"}


def hf_config_dict(flavor: str, vocab_size: int) -> dict[str, Any]:
    """A transformers Qwen3Config (as a dict) for a named flavor."""
    if flavor in CODE_FLAVORS:
        fields = dict(CODE_FLAVORS[flavor])
    elif flavor in TITAN_FLAVORS:
        import_torchtitan_qwen3()
        from torchtitan.models.qwen3 import qwen3_configs

        tc = qwen3_configs[flavor]("flex")
        attn = tc.layers[0].attention
        fields = dict(
            hidden_size=tc.dim,
            intermediate_size=tc.layers[0].feed_forward.w1.out_features,
            num_hidden_layers=len(tc.layers),
            num_attention_heads=attn.n_heads,
            num_key_value_heads=attn.n_kv_heads,
            head_dim=attn.head_dim,
            max_position_embeddings=attn.rope.max_seq_len,
            rope_theta=attn.rope.theta,
            rms_norm_eps=1e-6,
            tie_word_embeddings=tc.enable_weight_tying,
        )
    else:
        raise ValueError(f"unknown Qwen3 flavor {flavor!r}; use one of {sorted(CODE_FLAVORS) + sorted(TITAN_FLAVORS)}")
    from transformers import Qwen3Config

    rope_theta = fields.pop("rope_theta")
    cfg = Qwen3Config(
        vocab_size=vocab_size,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        architectures=["Qwen3ForCausalLM"],
        **fields,
    )
    return cfg.to_dict()


def _rope_theta(hf: dict[str, Any]) -> float:
    rp = hf.get("rope_parameters") or {}
    if rp.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rp.get('rope_type')!r} is not supported by the torchtitan Qwen3 backend")
    return float(rp.get("rope_theta", hf.get("rope_theta", 1_000_000.0)))


def titan_config_from_hf(hf: dict[str, Any], *, attn_backend: str = "sdpa"):
    """torchtitan Qwen3Model.Config matching an HF Qwen3 config dict."""
    import_torchtitan_qwen3()
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import (
        _EMBEDDING_SKIP_INIT,
        _LINEAR_INIT,
        Qwen3Model,
        _build_qwen3_layers,
        _qwen3_norm,
    )

    if hf.get("model_type") not in (None, "qwen3"):
        from meshrl.errors import ConfigError

        raise ConfigError(
            f"model.backend='torchtitan' loads Qwen3 checkpoints only; this is a {hf.get('model_type')!r} model: "
            "use --model.backend hf"
        )
    dim, vocab = hf["hidden_size"], hf["vocab_size"]
    head_dim = hf.get("head_dim") or dim // hf["num_attention_heads"]
    cfg = Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=_qwen3_norm(dim),
        enable_weight_tying=bool(hf.get("tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_SKIP_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=_build_qwen3_layers(
            n_layers=hf["num_hidden_layers"],
            dim=dim,
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=head_dim,
            hidden_dim=hf["intermediate_size"],
            attn_backend="flex",
            # Separate wq/wk/wv: DCP's full-state-dict loading cannot copy into the fused wqkv parameter
            # (its state-dict hooks split it, so the names do not match a parameter).
            fuse_qkv=False,
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=max_positions(hf), theta=_rope_theta(hf)),
        ),
    )
    if attn_backend == "sdpa":
        # On CPU flex attention has no backward and varlen needs CUDA; SDPA with a causal mask is exact for
        # right-padded rows (padding only follows the real tokens and is masked out of every loss).
        for layer in cfg.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    elif attn_backend != "flex":
        raise ValueError(f"attn_backend={attn_backend!r}; use 'sdpa' or 'flex'")
    return cfg


def load_hf_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint dir (single file or sharded safetensors)."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def titan_to_hf(state_dict: dict[str, torch.Tensor], titan_cfg) -> dict[str, torch.Tensor]:
    import_torchtitan_qwen3()
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter

    return Qwen3StateDictAdapter(titan_cfg, None).to_hf(state_dict)


def hf_to_titan(hf_state_dict: dict[str, torch.Tensor], titan_cfg) -> dict[str, torch.Tensor]:
    import_torchtitan_qwen3()
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter

    return Qwen3StateDictAdapter(titan_cfg, None).from_hf(dict(hf_state_dict))


# Tokenizer-side files of a checkpoint: copied verbatim into exports (the chat template included: transformers 5
# writes it to chat_template.jinja, older versions to chat_template.json or inside tokenizer_config.json).
TOKENIZER_FILES = (
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)


def is_tokenizer_file(name: str) -> bool:
    """tokenizer.json, tokenizer_config.json, tokenizer.model (sentencepiece), the BPE vocab/merges, special tokens
    and chat templates."""
    return name.startswith("tokenizer") or name in TOKENIZER_FILES or name.endswith(".tiktoken")


def _umask() -> int:
    """The process umask, read without changing it (os.umask would, for a moment, for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def make_readable(root: str | os.PathLike) -> None:
    """Give a freshly written checkpoint tree the modes of an ordinary `mkdir` / `open`: `mkdtemp` makes its
    directory 0700 and some writers leave 0600 files, which other users (and a serving process running as another
    user) cannot read. Directories 0777 & ~umask, files 0666 & ~umask: 0755 / 0644 under the default umask 022."""
    mask = _umask()
    root = Path(root)
    os.chmod(root, 0o777 & ~mask)
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o777 & ~mask)
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), 0o666 & ~mask)


@contextmanager
def atomic_dir(path: str | os.PathLike):
    """Yield a temp dir beside `path` to write a checkpoint into; on success it gets ordinary modes
    (`make_readable`) and is renamed to `path` (replacing an existing one), on failure it is removed: a crash
    leaves either the old directory or none, never a partial one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        make_readable(tmp)
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _source_generation_eos(source_dir: str | os.PathLike | None) -> Any:
    """The source checkpoint's generation_config.json `eos_token_id` (an int or a list), or None."""
    if source_dir is None:
        return None
    f = Path(source_dir) / "generation_config.json"
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return None


def save_hf_checkpoint(
    path: str | os.PathLike,
    hf_state_dict: dict[str, torch.Tensor],
    hf_config: dict[str, Any],
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    tokenizer=None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write an HF checkpoint atomically: everything goes to a temp dir beside `path`, which is renamed into
    place only when complete — a crash leaves either the old checkpoint or none, never a partial one.

    `tokenizer_dir` (the checkpoint the weights came from): every tokenizer file of it is copied (tokenizer*.json,
    vocab/merges, special tokens, the chat template), so the export is a complete model for transformers, vLLM and
    chat use; its generation_config.json's `eos_token_id` (often a list: Qwen's `<|im_end|>` and `<|endoftext|>`) is
    kept in the fresh generation_config.json. `tokenizer`: an object with `save_pretrained` instead.
    Modes: 0755 directory, 0644 files (under umask 022)."""
    from safetensors.torch import save_file

    with atomic_dir(path) as tmp:
        tensors = {
            k: (v.to(dtype) if dtype is not None else v).detach().contiguous().cpu() for k, v in hf_state_dict.items()
        }
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = dict(hf_config)
        cfg["torch_dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        gen = {k: cfg[k] for k in ("eos_token_id", "pad_token_id", "bos_token_id") if cfg.get(k) is not None}
        src_eos = _source_generation_eos(tokenizer_dir)
        if src_eos is not None:
            gen["eos_token_id"] = src_eos
        write_generation_config(tmp, gen)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        elif tokenizer_dir is not None:
            for f in Path(tokenizer_dir).iterdir():
                if f.is_file() and is_tokenizer_file(f.name):
                    shutil.copyfile(f, tmp / f.name)  # contents only: the modes are set for the whole tree
    return Path(path)


def write_generation_config(directory: str | os.PathLike, token_ids: dict[str, Any]) -> None:
    """`generation_config.json` in `directory` for the special token ids `token_ids` (eos_token_id, pad_token_id,
    bos_token_id: ints, eos also a list), as `transformers.GenerationConfig(**token_ids).save_pretrained` writes it
    (tests/test_model_hf.py compares the bytes). Written here for non-negative ids: importing transformers for it
    cost a torchtitan trainer rank ~1.7 CPU-s at every export; anything else goes through transformers, which
    checks it (a negative pad id is refused there)."""

    def plain(v) -> bool:
        return type(v) is int and v >= 0 or isinstance(v, list) and all(type(i) is int and i >= 0 for i in v)

    if set(token_ids) <= {"eos_token_id", "pad_token_id", "bos_token_id"} and all(map(plain, token_ids.values())):
        from importlib.metadata import version

        body = {**token_ids, "transformers_version": version("transformers")}
        (Path(directory) / "generation_config.json").write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
        return
    from transformers import GenerationConfig

    GenerationConfig(**token_ids).save_pretrained(directory)


def build_model_on_meta(titan_cfg) -> torch.nn.Module:
    with torch.device("meta"):
        return titan_cfg.build()


def create_random_checkpoint(path: str | os.PathLike, *, flavor: str, tokenizer, seed: int) -> Path:
    """Initialise a Qwen3 `flavor` with torchtitan's init (seeded) and save it in HF format with `tokenizer`
    (meshrl's CharTokenizer, or a transformers tokenizer such as `meshrl.tokenizer.train_bpe_tokenizer`'s)."""
    if hasattr(tokenizer, "eos_id"):  # CharTokenizer
        vocab, eos, pad, bos = tokenizer.vocab_size, tokenizer.eos_id, tokenizer.pad_id, tokenizer.bos_id
    else:  # len() counts added tokens, which vocab_size does not
        vocab, eos, pad, bos = len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id
    hf = hf_config_dict(flavor, vocab)
    # transformers' generate and vLLM (without a tokenizer) read the special ids from the config.
    hf.update(eos_token_id=eos, pad_token_id=pad, bos_token_id=bos)
    try:
        import_torchtitan_qwen3()
    except ImportError:
        # torchtitan does not import on every torch (../shared/GPU.md: the GPU machine's 2.11), and the hf backend
        # does not need it: transformers' own initialisation then (normal, std initializer_range), same seed.
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(Qwen3Config(**hf))
        state = {
            k: v for k, v in model.state_dict().items() if not (hf["tie_word_embeddings"] and k == "lm_head.weight")
        }
        return save_hf_checkpoint(path, state, hf, tokenizer=tokenizer)
    titan_cfg = titan_config_from_hf(hf)
    model = build_model_on_meta(titan_cfg)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    return save_hf_checkpoint(path, titan_to_hf(model.state_dict(), titan_cfg), hf, tokenizer=tokenizer)
