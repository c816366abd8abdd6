"""Tiny vision-language checkpoints (meshrl.models.tiny_vlm) in transformers and vLLM (CPU, fp32, no hub access).

One checkpoint and one in-process vLLM engine per family (module-scoped, parametrized by arch).

torchvision: vLLM's vision-language models and the Qwen-VL processors of transformers (which require a video
processor) import it. The only torchvision this machine can install is PyPI's CUDA build, whose `import` fails
against the CPU torch (`operator torchvision::nms does not exist`: `_C.so` needs libtorch_cuda, and the fake
`nms` kernel is registered unguarded), so scripts/setup.sh removes it. Without an importable torchvision, the tests
that need it skip (saying why) and the rest check the checkpoint through the image processor (PIL backend) and the
transformers model.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from markers import needs_torchvision  # noqa: E402

from meshrl.models.tiny_vlm import VLM_ARCHS, create_tiny_vlm, default_pixels, image_token_count  # noqa: E402

torch.set_num_threads(1)


# Larger than transformers' 0.02, so that the random model's next-token distributions are far from flat (logits
# spread over ~6) and the image moves them (by ~1-2 in logprob): a parity check on near-uniform logprobs would prove
# little. (At 0.2 the activations grow and so does the fp32 rounding gap: 3e-5 instead of 4e-6.)
INIT_RANGE = 0.1
# An absolute bound: logprobs here lie in [-10, 0], where the two fp32 implementations' rounding differs by ~4e-6
# (measured on the 2-core CPU machine, both families, every image size).
ATOL = 1e-4
MAX_NEW = 4
MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}]


def _image(height: int, width: int, seed: int = 0):
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _sizes(arch: str) -> list[tuple[int, int]]:
    """Image sizes of 2×2, 2×2, 4×4 and 3×2 image tokens: the smallest, one just off the grid, the largest."""
    f = 28 if arch == "qwen2_5_vl" else 32
    return [(2 * f, 2 * f), (64, 64), (4 * f, 4 * f), (3 * f, 2 * f)]


@pytest.fixture(scope="module", params=VLM_ARCHS)
def vlm(request, tmp_path_factory):
    arch = request.param
    path = create_tiny_vlm(tmp_path_factory.mktemp(arch) / "model", arch, initializer_range=INIT_RANGE)
    return arch, str(path)


@pytest.fixture(scope="module")
def hf_model(vlm):
    return transformers.AutoModelForImageTextToText.from_pretrained(vlm[1], dtype=torch.float32).eval()


def _prompt_text(tokenizer) -> str:
    return tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)


def _collapse(ids: list[int], image_id: int) -> list[int]:
    """Expanded ids -> one image token per image (a run of image tokens is one image: the chat template puts each
    between `<|vision_start|>` and `<|vision_end|>`), the prompt form vLLM takes."""
    return [t for i, t in enumerate(ids) if t != image_id or i == 0 or ids[i - 1] != image_id]


def test_checkpoint_files_and_image_token_counts(vlm):
    arch, path = vlm
    from pathlib import Path

    names = {p.name for p in Path(path).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    assert {"preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json"} <= names
    lo, hi = default_pixels(arch)
    counts = [image_token_count(arch, h, w, min_pixels=lo, max_pixels=hi) for h, w in _sizes(arch)]
    assert counts == [4, 4, 16, 6]
    # The image processor alone (the PIL backend where torchvision is missing) agrees: one token per 2×2 patches.
    ip = transformers.AutoImageProcessor.from_pretrained(path)
    grids = [ip(images=[_image(h, w)], return_tensors="pt")["image_grid_thw"][0] for h, w in _sizes(arch)]
    assert [int(g.prod()) // 4 for g in grids] == counts


def test_transformers_forward_sees_the_image(vlm, hf_model):
    """Built without the processor (so it runs without torchvision): the chat template's text, its one image token
    repeated once per image token, and the image processor's pixels."""
    arch, path = vlm
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ip = transformers.AutoImageProcessor.from_pretrained(path)
    image_id = hf_model.config.image_token_id
    ids = tok(_prompt_text(tok), add_special_tokens=False)["input_ids"]
    assert ids.count(image_id) == 1
    logits = []
    for seed in (0, 1):
        pix = ip(images=[_image(64, 64, seed)], return_tensors="pt")
        n = int(pix["image_grid_thw"].prod()) // 4
        at = ids.index(image_id)
        expanded = torch.tensor([ids[:at] + [image_id] * n + ids[at + 1 :]])
        with torch.no_grad():
            out = hf_model(
                input_ids=expanded,
                attention_mask=torch.ones_like(expanded),
                mm_token_type_ids=(expanded == image_id).long(),  # 1: image token (what the processor returns)
                **pix,
            ).logits
        assert out.shape == (1, len(ids) - 1 + n, len(tok))
        assert torch.isfinite(out).all()
        logits.append(out)
    # A different image changes what follows it (the vision tower is wired in), by far more than rounding.
    assert (logits[0][0, -1] - logits[1][0, -1]).abs().max() > 100 * ATOL


@needs_torchvision
def test_processor_renders_and_expands_the_image_placeholder(vlm, hf_model):
    arch, path = vlm
    processor = transformers.AutoProcessor.from_pretrained(path)
    text = processor.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 1
    assert text.endswith("How many?<|im_end|>\n<|im_start|>assistant\n")
    image_id = hf_model.config.image_token_id
    lo, hi = default_pixels(arch)
    for h, w in _sizes(arch):
        batch = processor(text=text, images=[_image(h, w)], return_tensors="pt")
        ids = batch["input_ids"][0].tolist()
        n = image_token_count(arch, h, w, min_pixels=lo, max_pixels=hi)
        assert ids.count(image_id) == n and int(batch["image_grid_thw"].prod()) == 4 * n
        assert batch["pixel_values"].shape[0] == 4 * n
        assert _collapse(ids, image_id) == processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = hf_model(**batch).logits
        assert logits.shape == (1, len(ids), len(processor.tokenizer)) and torch.isfinite(logits).all()


@pytest.fixture(scope="module")
def llm(vlm):
    import meshrl.generation.vllm_engine  # noqa: F401  (its CPU environment: in-process engine core, no compile)
    from meshrl.generation.base import DEFAULT_CPU_KV_CACHE_BYTES

    vllm = pytest.importorskip("vllm")
    # The engine core in this process on a GPU too (on CPU meshrl's import sets it): a `unit` test starts no processes.
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")  # float32 dots in vLLM's Triton attention, as VLLMEngine sets
    engine = vllm.LLM(
        model=vlm[1],
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        max_num_batched_tokens=4096,
        kv_cache_memory_bytes=DEFAULT_CPU_KV_CACHE_BYTES,
        seed=0,
        # A multimodal processor needs the tokenizer: skip_tokenizer_init=True (VLLMEngine's) refuses to start.
        skip_tokenizer_init=False,
        max_logprobs=-1,
        limit_mm_per_prompt={"image": 1, "video": 0},
        disable_log_stats=True,
    )
    yield engine
    core = getattr(engine.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del engine, core
    gc.collect()


def _hf_logprobs(hf_model, processor, text, image, completion: list[int]) -> tuple[list[int], torch.Tensor]:
    batch = processor(text=text, images=[image], return_tensors="pt")
    ids = batch["input_ids"][0].tolist()
    full = torch.tensor([ids + completion])
    batch["input_ids"], batch["attention_mask"] = full, torch.ones_like(full)
    if "mm_token_type_ids" in batch:  # 0 (text) for the completion
        batch["mm_token_type_ids"] = torch.nn.functional.pad(batch["mm_token_type_ids"], (0, len(completion)))
    with torch.no_grad():
        return ids, torch.log_softmax(hf_model(**batch).logits[0].float(), -1)


@needs_torchvision
def test_vllm_logprobs_match_transformers_on_an_image_prompt(vlm, hf_model, llm):
    """The prompt carries one image token (vLLM expands it to the processor's ids); prompt logprobs over the whole
    vocabulary, then the full distributions of `MAX_NEW` greedy tokens, against one transformers forward."""
    from vllm import SamplingParams

    arch, path = vlm
    processor = transformers.AutoProcessor.from_pretrained(path)
    text = processor.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    params = SamplingParams(
        max_tokens=MAX_NEW, temperature=0.0, prompt_logprobs=-1, logprobs=-1, ignore_eos=True, detokenize=False
    )
    vocab = len(processor.tokenizer)
    last_rows = []
    for h, w, seed in ((64, 64, 0), (64, 64, 1), *((h, w, 2) for h, w in _sizes(arch)[2:])):
        image = _image(h, w, seed)
        out = llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"image": [image]}}], params)[0]
        completion = list(out.outputs[0].token_ids)
        ids, ref = _hf_logprobs(hf_model, processor, text, image, completion)
        assert list(out.prompt_token_ids) == ids, "vLLM expanded the image token unlike the processor"
        assert len(completion) == MAX_NEW
        rows = [out.prompt_logprobs[i] for i in range(1, len(ids))] + list(out.outputs[0].logprobs)
        got = torch.tensor([[row[t].logprob for t in range(vocab)] for row in rows])
        diff = (got - ref[: len(rows)]).abs().max().item()
        assert diff <= ATOL, f"{arch} {h}x{w}: vLLM and transformers logprobs differ by {diff:.2e}"
        assert completion == ref[len(ids) - 1 : -1].argmax(-1).tolist()
        last_rows.append(got[len(ids) - 2])
    # Two images of one size give different next-token distributions (the image reaches vLLM's model too).
    assert (last_rows[0] - last_rows[1]).abs().max() > 100 * ATOL


@needs_torchvision
def test_vllm_expands_again_an_already_expanded_prompt(vlm, llm):
    """vLLM 0.32 does not recognise the processor's expanded ids: it expands the first image token again and keeps
    the others as text — a longer, wrong prompt, without an error. Hand vLLM `_collapse(ids)` instead."""
    from vllm import SamplingParams

    arch, path = vlm
    processor = transformers.AutoProcessor.from_pretrained(path)
    text = processor.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    image = _image(64, 64)
    ids = processor(text=text, images=[image], return_tensors="pt")["input_ids"][0].tolist()
    out = llm.generate(
        [{"prompt_token_ids": ids, "multi_modal_data": {"image": [image]}}],
        SamplingParams(max_tokens=1, temperature=0.0, detokenize=False),
    )[0]
    n = ids.count(processor.image_token_id)
    assert len(out.prompt_token_ids) == len(ids) + n - 1
