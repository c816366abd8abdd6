"""Tiny random checkpoints of real transformers architectures, made in code (no downloads): Qwen3, Qwen2, Llama and
GPT-2, built by transformers itself and saved with `save_pretrained` beside a tokenizer (e.g. a byte-level BPE with a
ChatML chat template from `meshrl.tokenizer.train_bpe_tokenizer`). The directory is what a hub download would be, so
every loader (transformers, vLLM, both meshrl trainer backends that support the architecture, both engines) takes it.

    tok = train_bpe_tokenizer(default_corpus(), 512)
    create_tiny_checkpoint("ckpt/llama-tiny", arch="llama", tokenizer=tok)
    # or, the two in one call:
    create_tiny_chat_model("ckpt/llama-tiny", arch="llama", vocab_size=512)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

import torch

from meshrl.models.qwen3 import atomic_dir

Arch = Literal["qwen3", "qwen2", "llama", "gpt2"]
ARCHS: tuple[str, ...] = ("qwen3", "qwen2", "llama", "gpt2")


def tiny_config(
    arch: Arch,
    *,
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int | None = 1,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 256,
    tie_word_embeddings: bool | None = None,
    dropout: float = 0.0,
    initializer_range: float = 0.02,
    rope_theta: float = 10_000.0,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
):
    """The transformers config of a tiny `arch` model. `num_kv_heads` < `num_heads` is grouped-query attention
    (ignored by GPT-2, which has none); `dropout` goes to every dropout probability the architecture has (attention
    dropout; GPT-2 also residual and embedding dropout); `tie_word_embeddings` None keeps the architecture's
    default (GPT-2 tied, the others not). Default head size 64 / 2 = 32: vLLM's CPU attention needs >= 32."""
    import transformers

    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} is not a multiple of num_heads={num_heads}")
    kv = num_kv_heads or num_heads
    if num_heads % kv:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={kv}")
    head_dim = hidden_size // num_heads
    ffn = intermediate_size or 2 * hidden_size
    special = dict(eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=bos_token_id)
    tie = {} if tie_word_embeddings is None else {"tie_word_embeddings": bool(tie_word_embeddings)}
    if arch == "gpt2":
        return transformers.GPT2Config(
            vocab_size=vocab_size,
            n_embd=hidden_size,
            n_layer=num_layers,
            n_head=num_heads,
            n_inner=ffn,
            n_positions=max_position_embeddings,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            initializer_range=initializer_range,
            architectures=["GPT2LMHeadModel"],
            **special,
            **tie,
        )
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=ffn,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=kv,
        max_position_embeddings=max_position_embeddings,
        attention_dropout=dropout,
        initializer_range=initializer_range,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        **special,
        **tie,
    )
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=head_dim, architectures=["Qwen3ForCausalLM"], **common)
    if arch == "qwen2":
        return transformers.Qwen2Config(architectures=["Qwen2ForCausalLM"], **common)
    if arch == "llama":
        return transformers.LlamaConfig(head_dim=head_dim, architectures=["LlamaForCausalLM"], **common)
    raise ValueError(f"arch={arch!r}; use one of {list(ARCHS)}")


def special_token_ids(tokenizer) -> dict[str, Any]:
    """eos/pad/bos ids for config.json and generation_config.json from a transformers tokenizer. The generation
    config's `eos_token_id` lists `<|endoftext|>` too when the eos is another token (Qwen instruct models' layout:
    a turn ends at `<|im_end|>`, a document at `<|endoftext|>`; both stop generation)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos token: generation would never stop")
    gen_eos = [eos]
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>") if "<|endoftext|>" in tokenizer.get_vocab() else None
    if eot is not None and eot != eos:
        gen_eos.append(eot)
    pad = tokenizer.pad_token_id
    bos = tokenizer.bos_token_id
    return {"eos_token_id": eos, "pad_token_id": pad, "bos_token_id": bos, "generation_eos_token_id": gen_eos}


def create_tiny_checkpoint(
    path: str | os.PathLike,
    *,
    arch: Arch,
    tokenizer,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int | None = 1,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 256,
    tie_word_embeddings: bool | None = None,
    dropout: float = 0.0,
    initializer_range: float = 0.02,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Build a random `arch` model with transformers (seeded: the same arguments give the same weights) and save it
    in HF format with `tokenizer` (its files and chat template) at `path`, atomically (temp dir + rename: a crash
    leaves the old directory or none; an existing `path` is replaced). Directories 0755, files 0644 (under the
    default umask 022). The vocabulary is the tokenizer's (`len(tokenizer)`); eos/pad/bos ids come from it into
    config.json and generation_config.json. `initializer_range`: std of the random weights (larger than
    transformers' 0.02 makes a random model's next-token choices less flat). Returns `path`."""
    from transformers import AutoModelForCausalLM

    ids = special_token_ids(tokenizer)
    cfg = tiny_config(
        arch,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        dropout=dropout,
        initializer_range=initializer_range,
        eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
        bos_token_id=ids["bos_token_id"],
    )
    model = seeded_model(lambda: AutoModelForCausalLM.from_config(cfg, dtype=dtype), seed, ids)
    with atomic_dir(path) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(path)


_TEMPLATE_DEFAULT = object()


def seeded_model(build: Callable[[], Any], seed: int, ids: dict[str, Any]) -> Any:
    """`build()` (a transformers model) with torch's RNG seeded (the caller's global RNG stream is left as it was),
    its generation config holding the tokenizer's special ids (`special_token_ids`)."""
    from transformers import GenerationConfig

    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = build()
    finally:
        torch.random.set_rng_state(state)
    model.generation_config = GenerationConfig(
        eos_token_id=ids["generation_eos_token_id"], pad_token_id=ids["pad_token_id"], bos_token_id=ids["bos_token_id"]
    )
    return model


def create_tiny_chat_model(
    path: str | os.PathLike,
    *,
    arch: Arch,
    vocab_size: int = 512,
    texts: Iterable[str] | None = None,
    chat_template: Any = _TEMPLATE_DEFAULT,
    **model_kwargs: Any,
) -> Path:
    """One call for a complete toy chat model: a byte-level BPE tokenizer (`vocab_size`, trained on `texts`, default
    `meshrl.tokenizer.default_corpus()`) with the ChatML chat template (or `chat_template`; None for a plain-text
    tokenizer), and a tiny random `arch` model over it (`model_kwargs`: see `create_tiny_checkpoint`)."""
    from meshrl.tokenizer import CHATML_TEMPLATE, default_corpus, train_bpe_tokenizer

    template = CHATML_TEMPLATE if chat_template is _TEMPLATE_DEFAULT else chat_template
    tok = train_bpe_tokenizer(default_corpus() if texts is None else texts, vocab_size, chat_template=template)
    return create_tiny_checkpoint(path, arch=arch, tokenizer=tok, **model_kwargs)


__all__ = ["ARCHS", "Arch", "create_tiny_chat_model", "create_tiny_checkpoint", "special_token_ids", "tiny_config"]
