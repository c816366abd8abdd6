"""Tiny random vision-language checkpoints made in code (no downloads): Qwen2.5-VL and Qwen3-VL, built by
transformers itself and saved as a hub download would be — config.json + safetensors (`save_pretrained`), a
byte-level BPE tokenizer (`meshrl.tokenizer.train_bpe_tokenizer`) with the family's special tokens, the family's
chat template (image content parts become `<|vision_start|><|image_pad|><|vision_end|>`), and the processor files
(preprocessor_config.json, video_preprocessor_config.json, processor_config.json), so that transformers'
`AutoProcessor` / `AutoModelForImageTextToText` and vLLM load the directory like the real model.

    d = create_tiny_vlm("ckpt/qwen2_5_vl-tiny", "qwen2_5_vl")
    processor = AutoProcessor.from_pretrained(d)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    batch = processor(text=text, images=[image], return_tensors="pt")  # input_ids hold the expanded image tokens
    logits = AutoModelForImageTextToText.from_pretrained(d)(**batch).logits

An image of H×W pixels is resized to multiples of `patch_size * merge_size` (28 for Qwen2.5-VL, 32 for Qwen3-VL)
within [`min_pixels`, `max_pixels`] and becomes (H'/28)·(W'/28) image tokens (resp. /32): by default 4 tokens for a
56×56 or 64×64 image, 16 at most (112×112 for Qwen2.5-VL, 128×128 for Qwen3-VL).

vLLM takes a token prompt with ONE placeholder per image — the chat template's text tokenized as it is, e.g.
`processor.tokenizer(text)["input_ids"]` — and expands it itself (its `prompt_token_ids` then equal the
processor's `input_ids`). It does not recognise an already expanded prompt: given the processor's `input_ids` it
expands the first image token again and treats the rest as text, silently (vLLM 0.32).

Why Qwen3-VL as the second family: it is the other Qwen-VL generation the RL recipes train, both the installed
transformers (5.19) and vLLM (0.32, CPU) have it, and it matched transformers like Qwen2.5-VL does (fp32 logprobs
within 4e-6 over the whole vocabulary, prompt and greedy tokens, tests/test_vlm_models.py). LLaVA (llama + CLIP) ran
too (5e-7 at transformers' default init, as did the Qwen families), but transformers 5.19 saves its CLIP tower
without the `vision_model.` key prefix that hub checkpoints have and vLLM's loader requires, so its safetensors keys
would need rewriting after `save_pretrained`; Gemma 3 was not tried.

torchvision: every vLLM vision-language model, and the Qwen-VL processors of transformers (they require a video
processor), import it. The only torchvision this CPU machine can install is PyPI's CUDA build, whose import fails
against the CPU torch. Without it the checkpoint is still made, and its image processor (PIL backend) and the
transformers model work; `AutoProcessor` and vLLM do not.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import torch

from meshrl.models.qwen3 import atomic_dir

VLMArch = Literal["qwen2_5_vl", "qwen3_vl"]
VLM_ARCHS: tuple[str, ...] = ("qwen2_5_vl", "qwen3_vl")

# The Qwen-VL special tokens after the ChatML ones (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>` come with every
# `train_bpe_tokenizer` tokenizer).
QWEN_VL_SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"

# Qwen2.5-VL-Instruct's chat template as shipped: a default system message, and an image part rendered as
# `<|vision_start|><|image_pad|><|vision_end|>` (the processor then repeats `<|image_pad|>` once per image token).
QWEN2_5_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3-VL-Instruct's chat template without its tool-calling part: no default system message; the same image and
# video parts as Qwen2.5-VL.
QWEN3_VL_TEMPLATE = (
    "{%- set image_count = namespace(value=0) -%}{%- set video_count = namespace(value=0) -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for content in message['content'] -%}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content -%}"
    "{%- set image_count.value = image_count.value + 1 -%}"
    "{%- if add_vision_id -%}Picture {{ image_count.value }}: {% endif -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif content['type'] == 'video' or 'video' in content -%}"
    "{%- set video_count.value = video_count.value + 1 -%}"
    "{%- if add_vision_id -%}Video {{ video_count.value }}: {% endif -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in content -%}{{- content['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

# Per family: the model class, processor class, video processor class, chat template, vision patch size and the
# image normalisation of the real checkpoints (Qwen2.5-VL: CLIP's mean/std; Qwen3-VL: 0.5/0.5).
_FAMILY: dict[str, dict[str, Any]] = {
    "qwen2_5_vl": {
        "model": "Qwen2_5_VLForConditionalGeneration",
        "processor": "Qwen2_5_VLProcessor",
        "video_processor": "Qwen2VLVideoProcessor",
        "template": QWEN2_5_VL_TEMPLATE,
        "patch_size": 14,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    },
    "qwen3_vl": {
        "model": "Qwen3VLForConditionalGeneration",
        "processor": "Qwen3VLProcessor",
        "video_processor": "Qwen3VLVideoProcessor",
        "template": QWEN3_VL_TEMPLATE,
        "patch_size": 16,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    },
}
MERGE_SIZE = 2  # 2×2 vision patches are merged into one image token (both families)


def mrope_section(arch: VLMArch, head_dim: int) -> list[int]:
    """The (temporal, height, width) split of the rotary frequencies (head_dim / 2 of them) in the real models'
    proportions: Qwen2.5-VL [16, 24, 24] and Qwen3-VL [24, 20, 20] at head_dim 128."""
    half = head_dim // 2
    hw = (half * 3) // 8 if arch == "qwen2_5_vl" else (half * 5) // 16
    return [half - 2 * hw, hw, hw]


def tiny_vlm_config(
    arch: VLMArch,
    *,
    vocab_size: int,
    token_ids: dict[str, int],
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    vision_hidden_size: int = 64,
    vision_depth: int = 2,
    vision_num_heads: int = 2,
    vision_intermediate_size: int | None = None,
    vision_window_tokens: int = 2,
    vision_full_attention_every: int | None = None,
    initializer_range: float = 0.02,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
):
    """The transformers config of a tiny `arch` model. `token_ids`: the ids of `<|image_pad|>`, `<|video_pad|>`,
    `<|vision_start|>`, `<|vision_end|>` (keys: image, video, vision_start, vision_end). Default text head size
    64 / 2 = 32 (vLLM's CPU attention needs >= 32). The vision tower: `vision_depth` blocks; Qwen2.5-VL's last block
    attends over the whole image and the others over windows of 2×2 image tokens (real: 4×4 of 32 blocks, 4 full);
    Qwen3-VL feeds its first block's output into the text model (deepstack; real: blocks 8, 16, 24 of 27).
    Qwen2.5-VL as released: `vision_window_tokens=4` (windows of 4×4 image tokens) and
    `vision_full_attention_every=8`; with `vision_hidden_size=1280, vision_depth=32, vision_num_heads=16,
    vision_intermediate_size=3420` the tower is the released one's size (bench/vision_gpu.py)."""
    import transformers

    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"hidden_size={hidden_size}, num_heads={num_heads}, num_kv_heads={num_kv_heads} do not divide")
    if vision_hidden_size % vision_num_heads:
        raise ValueError(f"vision_hidden_size={vision_hidden_size} is not a multiple of {vision_num_heads} heads")
    head_dim = hidden_size // num_heads
    special = dict(eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=bos_token_id)
    text = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        initializer_range=initializer_range,
        **special,
    )
    vision = dict(
        depth=vision_depth,
        hidden_size=vision_hidden_size,
        intermediate_size=vision_intermediate_size or 2 * vision_hidden_size,
        num_heads=vision_num_heads,
        patch_size=_FAMILY[arch]["patch_size"],
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=2,
        out_hidden_size=hidden_size,
        initializer_range=initializer_range,
    )
    top = dict(
        image_token_id=token_ids["image"],
        video_token_id=token_ids["video"],
        vision_start_token_id=token_ids["vision_start"],
        vision_end_token_id=token_ids["vision_end"],
        architectures=[_FAMILY[arch]["model"]],
        initializer_range=initializer_range,
        **special,
    )
    if arch == "qwen2_5_vl":
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": mrope_section(arch, head_dim),
        }
        every = vision_full_attention_every or vision_depth
        vision.update(
            window_size=vision_window_tokens * MERGE_SIZE * vision["patch_size"],
            fullatt_block_indexes=list(range(every - 1, vision_depth, every)),
        )
        return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **top)
    if arch == "qwen3_vl":
        text["head_dim"] = head_dim
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": mrope_section(arch, head_dim),
            "mrope_interleaved": True,
        }
        # Learnt position embeddings of an 8×8 grid, interpolated to the image's patch grid (real: 48×48).
        vision.update(num_position_embeddings=64, deepstack_visual_indexes=[0])
        return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **top)
    raise ValueError(f"arch={arch!r}; use one of {list(VLM_ARCHS)}")


def _image_processor(arch: VLMArch, min_pixels: int, max_pixels: int):
    # The PIL backend: it needs no torchvision, and saves as the family's `Qwen2VLImageProcessor` config (which
    # AutoImageProcessor then loads with whichever backend is installed).
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    fam = _FAMILY[arch]
    return Qwen2VLImageProcessorPil(
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        patch_size=fam["patch_size"],
        merge_size=MERGE_SIZE,
        temporal_patch_size=2,
        image_mean=fam["image_mean"],
        image_std=fam["image_std"],
    )


def _video_processor_config(arch: VLMArch, min_pixels: int, max_pixels: int) -> dict[str, Any]:
    # Written as JSON: the video processor classes need torchvision, which a checkpoint's maker may not have.
    fam = _FAMILY[arch]
    return {
        "video_processor_type": fam["video_processor"],
        "processor_class": fam["processor"],
        "patch_size": fam["patch_size"],
        "temporal_patch_size": 2,
        "merge_size": MERGE_SIZE,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "image_mean": fam["image_mean"],
        "image_std": fam["image_std"],
    }


def vlm_tokenizer(arch: VLMArch, *, vocab_size: int = 512, texts: Iterable[str] | None = None):
    """A byte-level BPE tokenizer with ChatML and the Qwen-VL special tokens, and the family's chat template."""
    from meshrl.tokenizer import default_corpus, train_bpe_tokenizer

    if arch not in _FAMILY:
        raise ValueError(f"arch={arch!r}; use one of {list(VLM_ARCHS)}")
    return train_bpe_tokenizer(
        default_corpus() if texts is None else texts,
        vocab_size,
        chat_template=_FAMILY[arch]["template"],
        extra_special_tokens=QWEN_VL_SPECIAL_TOKENS,
    )


def image_token_count(arch: VLMArch, height: int, width: int, *, min_pixels: int, max_pixels: int) -> int:
    """How many image tokens an image of `height`×`width` pixels becomes (the processor's resize, then one token per
    2×2 patches)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    factor = _FAMILY[arch]["patch_size"] * MERGE_SIZE
    h, w = smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    return (h // factor) * (w // factor)


def default_pixels(arch: VLMArch) -> tuple[int, int]:
    """(min_pixels, max_pixels) of the tiny checkpoints: 2×2 to 4×4 image tokens."""
    factor = _FAMILY[arch]["patch_size"] * MERGE_SIZE
    return (2 * factor) ** 2, (4 * factor) ** 2


def create_tiny_vlm(
    out_dir: str | os.PathLike,
    arch: VLMArch = "qwen2_5_vl",
    *,
    vocab_size: int = 512,
    seed: int = 0,
    texts: Iterable[str] | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    dtype: torch.dtype = torch.float32,
    **sizes: Any,
) -> Path:
    """Build a random `arch` vision-language model with transformers (seeded: the same arguments give the same
    weights) and save it at `out_dir` with its tokenizer (`vlm_tokenizer`: `vocab_size`, `texts`), chat template and
    processor files, atomically (temp dir + rename; an existing `out_dir` is replaced). `sizes`: `tiny_vlm_config`'s
    keywords (hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings,
    vision_hidden_size, vision_depth, vision_num_heads, the other vision_* sizes, initializer_range). `min_pixels` /
    `max_pixels`: the image processor's resize bounds (default `default_pixels(arch)`). Returns `out_dir` as a Path."""
    import transformers

    from meshrl.models.tiny_hf import seeded_model, special_token_ids

    tok = vlm_tokenizer(arch, vocab_size=vocab_size, texts=texts)
    ids = special_token_ids(tok)
    tid = tok.convert_tokens_to_ids
    cfg = tiny_vlm_config(
        arch,
        vocab_size=len(tok),
        token_ids={
            "image": tid(IMAGE_TOKEN),
            "video": tid(VIDEO_TOKEN),
            "vision_start": tid("<|vision_start|>"),
            "vision_end": tid("<|vision_end|>"),
        },
        eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
        bos_token_id=ids["bos_token_id"],
        **sizes,
    )
    lo, hi = default_pixels(arch)
    min_pixels, max_pixels = min_pixels or lo, max_pixels or hi
    model_cls = getattr(transformers, _FAMILY[arch]["model"])
    model = seeded_model(lambda: model_cls(cfg).to(dtype), seed, ids)
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)  # tokenizer files and chat_template.jinja (which the processor reads too)
        _image_processor(arch, min_pixels, max_pixels).save_pretrained(tmp)
        _write_json(tmp / "video_preprocessor_config.json", _video_processor_config(arch, min_pixels, max_pixels))
        _write_json(tmp / "processor_config.json", {"processor_class": _FAMILY[arch]["processor"]})
    return Path(out_dir)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


__all__ = [
    "IMAGE_TOKEN",
    "QWEN2_5_VL_TEMPLATE",
    "QWEN3_VL_TEMPLATE",
    "VLMArch",
    "VLM_ARCHS",
    "create_tiny_vlm",
    "default_pixels",
    "image_token_count",
    "mrope_section",
    "tiny_vlm_config",
    "vlm_tokenizer",
]
