"""meshrl's vLLM engine (`VLLMEngine`) on vision-language models (issue 34): image prompts in meshrl's form (the
renderer's expanded image tokens and the wire-encoded images, as a generator receives them), sampled-token logprobs
against the hf trainer's, scoring image sequences, placeholders never sampled, and a weight update that reaches the
vision tower under the trainer's names. Tiny random Qwen2.5-VL and Qwen3-VL checkpoints made in code, float32.

vLLM's vision-language models import torchvision, which does not load beside this CPU build of torch
(tests/test_vlm_models.py says why): these tests skip here and run on the GPU machine (`bash bench/gpu_run.sh
vision-vllm`), where the vLLM pieces carry a torchvision built for their torch."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from markers import needs_torchvision
from vision_rows import image_row, prompts_of, sequences_to_score, trainer_gap

from meshrl.models.tiny_vlm import VLM_ARCHS, create_tiny_vlm
from meshrl.rollout.render import Renderer
from meshrl.rollout.row import Row
from meshrl.types import SamplingParams

pytestmark = needs_torchvision

# Wider than transformers' 0.02, so that the next-token distributions are far from flat and an image moves them.
INIT_RANGE = 0.1
# float32 on both sides (the trainer on the CPU, vLLM on the GPU where it runs): the transformers engine's gap on the
# GPU machine was 6.7e-6 (docs/vision.md); vLLM's own attention and rotary kernels add rounding, not more.
ATOL = 1e-4


@pytest.fixture(scope="module", params=VLM_ARCHS)
def vlm(request, tmp_path_factory, one_rank_group):
    """(renderer, engine, trainer) of one family."""
    from meshrl.generation.vllm_config import VLLMEngineConfig
    from meshrl.generation.vllm_engine import VLLMEngine
    from meshrl.policy import Policy

    model_dir = str(create_tiny_vlm(tmp_path_factory.mktemp(request.param) / "model", request.param,
                                    initializer_range=INIT_RANGE))  # fmt: skip
    policy = Policy.from_options(model_dir, backend="hf", pad_id=0)
    # The engine core in this process on a GPU too (on CPU it always is): a `unit` test starts no processes.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # Eager: the engine starts in seconds instead of a minute of compilation and CUDA graphs, same numerics.
    # No sleep mode: vLLM's sleep allocator takes one engine per process, and each family makes one here.
    engine = VLLMEngine(model_dir, VLLMEngineConfig(enforce_eager=True, enable_sleep_mode=False), max_model_len=256,
                        kv_cache_memory_bytes=64 * 2**20)  # fmt: skip
    yield Renderer.from_model_dir(model_dir), engine, policy
    engine.shutdown()


def test_sampled_and_scored_logprobs_equal_the_trainers_on_image_prompts(vlm):
    renderer, engine, policy = vlm
    prompts, images = prompts_of(renderer, [image_row(0, 64), image_row(1, 128)])
    assert len(prompts[0]) < len(prompts[1])  # the taller image has more image tokens
    groups = engine.generate(prompts, SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=1), 0, images=images)
    assert not {t for g in groups for c in g for t in c.token_ids} & set(engine.placeholder_ids)
    gap = trainer_gap(policy, prompts, images, groups)
    assert gap <= ATOL, f"vLLM's sampled-token logprobs differ from the trainer's by {gap:.2e} on image prompts"
    # Scoring the same sequences (the reference / parity path): the trainer's rows, image targets included.
    seqs, own, data = sequences_to_score(prompts, images, groups)
    for got, want, s in zip(engine.prompt_logprobs(seqs, images=own), policy.forward(data), seqs, strict=True):
        # At text positions. vLLM's prompt logprobs are raw (VLLMEngine.prompt_logprobs): their distribution keeps the
        # image placeholders' share, which the trainer's leaves out, so they lie below the trainer's by
        # -log(1 - share): measured on one H100 up to 0.033 for these random models (a trained model gives the
        # placeholders next to nothing), never above. (The sampled-token logprobs above agree: vLLM samples with the
        # placeholders suppressed.)
        text = [i for i in range(len(want)) if s[i + 1] not in engine.placeholder_ids]
        below = np.array(want)[text] - np.array(got)[text]
        assert below.min() >= -ATOL and below.max() <= 0.1, (below.min(), below.max())


def test_greedy_sees_the_image(vlm):
    renderer, engine, _ = vlm
    greedy = SamplingParams(n=1, max_tokens=6, temperature=0.0)
    prompts, images = prompts_of(renderer, [image_row(0), image_row(1)])
    assert prompts[0] == prompts[1] and images[0] != images[1]  # the same tokens, two images
    [a], [b] = engine.generate(prompts, greedy, 0, images=images)
    assert a.token_ids != b.token_ids or np.abs(np.array(a.logprobs) - np.array(b.logprobs)).max() > 1e-2


def test_weights_synced_under_the_trainers_names_reach_the_vision_tower(vlm):
    """The trainer's published tensors (its checkpoint names) load as they are; a changed patch embedding moves the
    engine's logprobs (vLLM's loader maps the names onto its tower), and the original brings them back."""
    renderer, engine, policy = vlm
    greedy = SamplingParams(n=1, max_tokens=4, temperature=0.0)
    prompts, images = prompts_of(renderer, [image_row(0)])
    logprobs = lambda: [c.logprobs for g in engine.generate(prompts, greedy, 0, images=images) for c in g]  # noqa: E731
    before = logprobs()
    published = policy.hf_state_dict()
    name = next(k for k in published if "visual." in k and k.endswith("patch_embed.proj.weight"))
    engine.load_weights(published)
    np.testing.assert_allclose(logprobs()[0], before[0], atol=1e-6)
    changed = dict(published)
    changed[name] = published[name] + 0.5 * torch.randn(
        published[name].shape, generator=torch.Generator().manual_seed(0)
    )
    engine.load_weights(changed)
    assert np.abs(np.array(logprobs()[0]) - np.array(before[0])).max() > 1e-3
    engine.load_weights({name: published[name]})
    np.testing.assert_allclose(logprobs()[0], before[0], atol=1e-6)


def test_text_prompts_mixed_with_image_prompts(vlm):
    renderer, engine, policy = vlm
    rows = [image_row(0, 64), Row("How many shapes are there?"), image_row(2, 96)]
    prompts, images = prompts_of(renderer, rows)
    assert images[1] == ()
    groups = engine.generate(prompts, SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=3), 0, images=images)
    gap = trainer_gap(policy, prompts, images, groups)
    assert gap <= ATOL, gap
