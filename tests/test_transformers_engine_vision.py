"""The transformers engine on vision-language models (issue 34): image prompts through prefill (vision tower, image
features in the image tokens, 3-D rotary positions) and decode (each row's rope delta), placeholders never sampled,
weight sync under the trainer's (checkpoint) names. The reference is the hf trainer (`Policy`, one gloo rank): the
generator's sampled-token logprobs must be the trainer's logprobs of the same sequences. Tiny random Qwen2.5-VL
and Qwen3-VL checkpoints made in code (meshrl.models.tiny_vlm), fp32 on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vision_rows import image_row, picture, prompts_of, sequences_to_score, trainer_gap

from meshrl.generation.transformers_engine import TransformersEngine
from meshrl.models.tiny_vlm import VLM_ARCHS, create_tiny_vlm
from meshrl.rollout.environment import Environment, StepResult
from meshrl.rollout.images import wire_image
from meshrl.rollout.render import Renderer
from meshrl.rollout.row import Row
from meshrl.types import SamplingParams

# Wider than transformers' 0.02, so that the next-token distributions are far from flat and an image moves them
# (tests/test_vlm_models.py says more).
INIT_RANGE = 0.1
# fp32, the same transformers model on both sides: measured gaps are ~1e-6.
ATOL = 1e-4
# About one token in six stops a sequence: lengths vary, so rows finish at different steps and the running rows
# are refilled and compacted while others decode (3 slots for 4 sequences, stops read every 2 steps:
# `sync_every=2`; seed 1 compacts in both families).
STOPS = list(range(3, 512, 6))


@pytest.fixture(scope="module", params=VLM_ARCHS)
def vlm(request, tmp_path_factory, one_rank_group):
    """(model dir, renderer, engine, trainer) of one family."""
    from meshrl.policy import Policy

    model_dir = str(create_tiny_vlm(tmp_path_factory.mktemp(request.param) / "model", request.param,
                                    initializer_range=INIT_RANGE))  # fmt: skip
    engine = TransformersEngine(model_dir, max_model_len=256, max_num_seqs=3, sync_every=2)
    yield model_dir, Renderer.from_model_dir(model_dir), engine, Policy.from_options(model_dir, backend="hf", pad_id=0)
    engine.shutdown()


def logprobs_of(groups) -> list[list[float]]:
    return [c.logprobs for group in groups for c in group]


def test_sampled_logprobs_equal_the_trainers(vlm, monkeypatch):
    _, renderer, engine, policy = vlm
    prompts, images = prompts_of(renderer, [image_row(0, 64), image_row(1, 128)])
    assert len(prompts[0]) < len(prompts[1])  # the taller image has more image tokens
    compactions = []
    compact = engine.runner.compact
    monkeypatch.setattr(engine.runner, "compact", lambda step: (compactions.append(step.src), compact(step))[1])
    params = SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=1, stop_token_ids=STOPS)
    groups = engine.generate(prompts, params, 0, images=images)
    assert any(compactions), "no running row was moved: the rope deltas' bookkeeping went untested"
    assert {len(c.token_ids) for g in groups for c in g} != {12}
    assert not {t for g in groups for c in g for t in c.token_ids} & set(engine.placeholder_ids)
    gap = trainer_gap(policy, prompts, images, groups)
    assert gap <= ATOL, gap
    # Scoring the same sequences: the trainer's rows, image targets (0 there) included.
    seqs, own, data = sequences_to_score(prompts, images, groups)
    for got, want in zip(engine.prompt_logprobs(seqs, images=own), policy.forward(data), strict=True):
        np.testing.assert_allclose(got, want, atol=ATOL)


def test_greedy_is_deterministic_and_sees_the_image(vlm):
    _, renderer, engine, _ = vlm
    greedy = SamplingParams(n=1, max_tokens=6, temperature=0.0)
    prompts, images = prompts_of(renderer, [image_row(0), image_row(1)])
    assert prompts[0] == prompts[1] and images[0] != images[1]  # the same tokens, two images
    first = engine.generate(prompts, greedy, 0, images=images)
    again = engine.generate(prompts, greedy, 0, images=images)
    assert logprobs_of(first) == logprobs_of(again)
    [a], [b] = first
    assert a.token_ids != b.token_ids or np.abs(np.array(a.logprobs) - np.array(b.logprobs)).max() > 1e-2


def test_placeholders_are_never_sampled(vlm):
    """A model that puts nearly all its mass on the image token after the prompt (its output row set along the
    prompt's last hidden state) still never writes it: greedy, the device-loop sampler and the host one (top-p)."""
    model_dir, renderer, _, _ = vlm
    engine = TransformersEngine(model_dir, max_model_len=256, max_num_seqs=4)
    try:
        prompts, images = prompts_of(renderer, [image_row(0)])
        seen = []
        hook = engine.runner.lm_head.register_forward_hook(lambda m, args, out: seen.append(args[0].detach()))
        engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), 0, images=images)
        hook.remove()
        h = seen[0][0]
        image_id = engine.vision.image_token_id
        weight = engine.runner.lm_head.weight.detach().clone()
        weight[image_id] = 50 * h / h.square().sum()  # logit 50 there, the others within a few units of 0
        engine.load_weights({"lm_head.weight": weight})
        engine.runner.suppress.zero_()  # the setup bites: unsuppressed, greedy writes the image token first
        [[c]] = engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), 0, images=images)
        assert c.token_ids == [image_id]
        engine.runner.suppress[list(engine.placeholder_ids)] = float("-inf")
        for params in (
            SamplingParams(n=1, max_tokens=6, temperature=0.0),
            SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=1),
            SamplingParams(n=4, max_tokens=6, temperature=1.0, top_p=0.95, seed=1),
        ):
            [group] = engine.generate(prompts, params, 0, images=images)
            assert not {t for c in group for t in c.token_ids} & set(engine.placeholder_ids)
            assert all(np.isfinite(c.logprobs).all() for c in group)
    finally:
        engine.shutdown()


def test_weights_synced_under_the_trainers_names_reach_the_vision_tower(vlm):
    _, renderer, engine, policy = vlm
    greedy = SamplingParams(n=1, max_tokens=4, temperature=0.0)
    prompts, images = prompts_of(renderer, [image_row(0)])
    before = logprobs_of(engine.generate(prompts, greedy, 0, images=images))
    published = policy.hf_state_dict()
    # Qwen2.5-VL's checkpoint names its tower `visual.` (the module: `model.visual.`), Qwen3-VL's `model.visual.`.
    name = next(k for k in published if "visual." in k and k.endswith("patch_embed.proj.weight"))
    engine.load_weights(published)
    assert logprobs_of(engine.generate(prompts, greedy, 0, images=images)) == before
    changed = dict(published)
    changed[name] = published[name] + 0.5 * torch.randn(
        published[name].shape, generator=torch.Generator().manual_seed(0)
    )
    engine.load_weights(changed)
    after = logprobs_of(engine.generate(prompts, greedy, 0, images=images))
    assert np.abs(np.array(after[0]) - np.array(before[0])).max() > 1e-3
    # The same change in blocks (as several trainer ranks publish a weight), then the original back.
    whole = changed[name]
    half = whole.shape[0] // 2
    zero = (0,) * (whole.ndim - 1)
    engine.load_weights({name: published[name]})
    engine.load_weight_pieces({name: (tuple(whole.shape), whole.dtype, [((0, *zero), whole[:half]),
                                                                          ((half, *zero), whole[half:])])})  # fmt: skip
    assert logprobs_of(engine.generate(prompts, greedy, 0, images=images)) == after
    engine.load_weights({name: published[name]})
    assert logprobs_of(engine.generate(prompts, greedy, 0, images=images)) == before


def test_text_prompts_mixed_with_image_prompts(vlm):
    _, renderer, engine, policy = vlm
    rows = [image_row(0, 64), Row("How many shapes are there?"), image_row(2, 96, "What colour?")]
    prompts, images = prompts_of(renderer, rows)
    assert images[1] == ()
    groups = engine.generate(prompts, SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=3), 0, images=images)
    gap = trainer_gap(policy, prompts, images, groups)
    assert gap <= ATOL, gap
    greedy = SamplingParams(n=1, max_tokens=6, temperature=0.0)
    mixed = engine.generate(prompts, greedy, 0, images=images)
    alone = engine.generate(prompts[1:2], greedy, 0)  # a text prompt needs no images argument
    assert mixed[1][0].token_ids == alone[0][0].token_ids
    np.testing.assert_allclose(mixed[1][0].logprobs, alone[0][0].logprobs, atol=1e-5)
    # A prompt's image tokens must be its images': missing images are refused, not generated from.
    with pytest.raises(ValueError, match="image tokens but no images"):
        engine.generate(prompts[:1], greedy, 0)


def test_an_observation_with_an_image_in_a_later_turn(vlm):
    """An environment's observation may hold images (issue 34: one rollout seam for tasks and environments): the
    bridge between turns expands its placeholder to the image's tokens and appends the image, the engine continues
    from the whole episode with both images, and the trainer scores every model token of it the same (3-D positions
    restart nowhere: the second image sits after generated text). A text-only model refuses such an observation."""
    from meshrl.rollout.episode import EpisodeRenderer, EpisodeTokens

    _, renderer, engine, policy = vlm
    episodes = EpisodeRenderer(renderer)
    row = image_row(2, 64, "What is shown?")
    messages, ids = episodes.opening(row, None)
    tokens = EpisodeTokens(images=episodes.opening_images(row, None))
    tokens.add_context(ids)
    params = SamplingParams(n=1, max_tokens=6, temperature=1.0, seed=3, stop_token_ids=STOPS)
    for turn in range(2):
        [[completion]] = engine.generate([list(tokens.tokens)], params, 0, images=[tokens.images])
        tokens.add_completion(completion)
        messages.append({"role": "assistant", "content": renderer.completion_text(completion.token_ids)})
        if turn == 0:
            seen = {"type": "image", "image": picture(7, 96)}  # a PIL image, as an environment would return it
            observation = [{"role": "user", "content": [{"type": "text", "text": "And now?"}, seen]}]
            bridge, images = episodes.bridge(messages, observation, completion.token_ids)
            assert len(images) == 1 and images[0] == wire_image(picture(7, 96)).data
            expected = renderer.vision.tokens_per_image(images[0])
            assert bridge.count(renderer.vision.image_token_id) == expected > 1
            tokens.add_context(bridge)
            tokens.images += images
            messages += observation
    assert len(tokens.images) == 2 and len(tokens.turn_starts) == 2
    datum = tokens.datum()
    [row_logprobs] = policy.forward([datum])
    sampled = np.array(tokens.logprobs[1:])[np.array(tokens.model_mask[1:]) > 0]
    trained = np.array(row_logprobs)[np.array(tokens.model_mask[1:]) > 0]
    assert np.abs(sampled - trained).max() <= ATOL
    # Without a vision tower the observation is refused by name (the episode ends as the environment's error).
    text_only = EpisodeRenderer(Renderer(renderer.tokenizer, stop_token_ids=renderer.stop_token_ids))
    with pytest.raises(ValueError, match="no vision tower"):
        text_only.bridge(messages[:2], observation, [1])


class _PictureEnv(Environment):
    """Shows a second picture after the model's first message, ends after its second. `broken`: the picture it
    shows is bytes that decode to nothing (an environment's bug)."""

    broken = False

    def reset(self, row: Row, seed: int) -> None:
        self.turn = 0

    def step(self, message: str) -> StepResult:
        self.turn += 1
        if self.turn == 2:
            return StepResult(reward=1.0, done=True)
        image = b"not a picture" if self.broken else picture(11, 48)
        return StepResult(observation=[{"role": "user", "content": [{"type": "image", "image": image}]}])


def test_the_episode_runner_carries_observation_images_to_the_engine(vlm):
    """Through the runner (the rollout seam every program uses): episodes of two turns end with both images and the
    second turn was generated from both; an undecodable observation image ends its episode as the environment's
    error, naming the image, without failing the others."""
    from meshrl.rollout.episode import EpisodeRenderer
    from meshrl.rollout.runner import EpisodeLimits, EpisodeRunner

    _, renderer, engine, _ = vlm
    calls = []

    def generate(prompts, params, images=None):
        calls.append([len(im) for im in images])
        return [c for group in engine.generate(prompts, params, 0, images=images) for c in group]

    limits = EpisodeLimits(max_turns=3, max_tokens=256, turn_max_tokens=4, timeout_s=30.0)
    episodes = EpisodeRunner(_PictureEnv, EpisodeRenderer(renderer), generate, limits)
    done = episodes.run([image_row(5, 64)], 2, SamplingParams(temperature=1.0, stop_token_ids=STOPS), seed=1)
    assert calls == [[1, 1], [2, 2]]  # turn 2 sees the row's image and the observation's
    assert [len(e.tokens.images) for e in done] == [2, 2] and {e.outcome.finish_reason for e in done} == {"done"}

    class Broken(_PictureEnv):
        broken = True

    failed = EpisodeRunner(Broken, EpisodeRenderer(renderer), generate, limits).run(
        [image_row(5, 64)], 1, SamplingParams(temperature=1.0, stop_token_ids=STOPS), seed=1
    )
    [outcome] = [e.outcome for e in failed]
    assert outcome.finish_reason == "env_error" and "image 0 of the observation" in outcome.error
