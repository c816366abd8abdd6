"""Vision-language models in the trainer and the renderer (issue 34): image placeholders expanded to their image's
token count, the hf trainer's forward with pixel inputs (packed rows equal the unpacked forward, Qwen-VL's 3-D
rotary positions per document), the vision tower trained or frozen, weights named as the checkpoint names them,
the export reloading in transformers with the same logits, and SFT rows with images. Real tiny Qwen2.5-VL and
Qwen3-VL checkpoints made in code (meshrl.models.tiny_vlm), the real transformers models, one gloo rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshrl.models.tiny_vlm import create_tiny_vlm
from meshrl.rollout.images import wire_image
from meshrl.rollout.render import Renderer
from meshrl.rollout.row import Row
from meshrl.types import Datum

ARCHS = ("qwen2_5_vl", "qwen3_vl")


def picture(seed: int, height: int = 64, width: int = 64):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def image_row(seed: int, height: int = 64, text: str = "How many shapes?") -> Row:
    part = {"type": "image", "image": wire_image(picture(seed, height))}
    return Row([{"role": "user", "content": [part, {"type": "text", "text": text}]}], "3")


@pytest.fixture(scope="module", params=ARCHS)
def vlm(request, tmp_path_factory, one_rank_group):
    """(model dir, renderer, policy) of one family."""
    from meshrl.policy import Policy

    model_dir = create_tiny_vlm(tmp_path_factory.mktemp(request.param) / "model", request.param)
    return model_dir, Renderer.from_model_dir(model_dir), Policy.from_options(str(model_dir), backend="hf")


def datums(renderer: Renderer, rows: list[Row], responses: list[list[int]]) -> list[Datum]:
    out = []
    for row, response in zip(rows, responses, strict=True):
        d = Datum.from_completion(renderer.prompt_ids(row), response, [-1.0] * len(response), advantage=1.0)
        d.images = renderer.prompt_images(row)
        out.append(d)
    return out


def test_placeholders_expand_to_each_images_token_count(vlm):
    _, renderer, _ = vlm
    small, tall = image_row(0, 64), image_row(1, 128)
    image_id = renderer.vision.image_token_id
    counts = [renderer.prompt_ids(r).count(image_id) for r in (small, tall)]
    # The image processor's grid (patch 14 or 16, merged 2×2): a taller image, more tokens.
    assert counts[0] == renderer.vision.tokens_per_image(renderer.prompt_images(small)[0]) and counts[1] > counts[0]
    two = Row(
        [{"role": "user", "content": [*image_row(0).prompt[0]["content"][:1], *image_row(1, 128).prompt[0]["content"]]}]
    )
    assert renderer.prompt_ids(two).count(image_id) == sum(counts)
    assert len(renderer.prompt_images(two)) == 2 and renderer.prompt_images(Row("no image")) == ()


def test_packed_rows_equal_the_unpacked_forward_and_a_sequence_alone(vlm):
    _, renderer, policy = vlm
    rows = [image_row(0, 64), image_row(1, 96), image_row(2, 64, "What colour?")]
    data = datums(renderer, rows, [[20, 21, 22], [23, 24], [25, 26, 27, 28]])
    policy.pack_sequences = False
    unpacked = policy.forward(data)
    policy.pack_sequences = True
    try:
        packed = policy.forward(data)
    finally:
        policy.pack_sequences = False
    alone = policy.forward([data[1]])[0]
    for a, b in zip(unpacked, packed, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(alone, unpacked[1], atol=1e-5)
    assert all(np.isfinite(row).all() for row in unpacked)  # image tokens as targets score 0, not -inf
    # The picture reaches the model: another image, other logprobs for the same text.
    other = datums(renderer, [image_row(7, 64)], [[20, 21, 22]])
    assert np.abs(np.array(policy.forward(other)[0][-3:]) - np.array(unpacked[0][-3:])).max() > 1e-3


def test_a_step_trains_the_vision_tower_and_freeze_vision_keeps_it(vlm, tmp_path):
    from meshrl.models.hf_backend import is_vision_weight
    from meshrl.policy import Policy
    from meshrl.types import LossSpec, OptimParams

    model_dir, renderer, policy = vlm
    data = datums(renderer, [image_row(0), image_row(1, 96)], [[20, 21, 22], [23, 24]])
    loss = LossSpec("grpo", num_loss_tokens=5)
    for frozen in (False, True):
        p = policy if not frozen else Policy.from_options(str(model_dir), backend="hf", freeze_vision=True)
        before = {k: v.clone() for k, v in p.hf_state_dict().items()}
        result = p.forward_backward(data, loss, OptimParams(lr=1e-2))
        assert np.isfinite(result.loss)
        after = p.hf_state_dict()
        moved = {k for k in before if not torch.equal(before[k], after[k])}
        vision_moved = {k for k in moved if is_vision_weight(k)}
        assert moved - vision_moved, "the language model did not train"
        assert bool(vision_moved) != frozen, (frozen, sorted(vision_moved)[:3])
    policy.load_hf(str(model_dir))  # back to the checkpoint for the other tests


def test_weights_carry_the_checkpoints_names_and_the_export_reloads_with_the_same_logits(vlm, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    model_dir, renderer, policy = vlm
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert set(policy.hf_state_dict()) == saved  # what weight sync publishes: the checkpoint's own names
    out = policy.save_hf(str(tmp_path / "export"))
    for name in ("preprocessor_config.json", "chat_template.jinja", "tokenizer.json"):
        assert (tmp_path / "export" / name).exists(), name
    data = datums(renderer, [image_row(3, 96)], [[20, 21, 22]])
    ours = policy.forward(data)[0]
    model = AutoModelForImageTextToText.from_pretrained(out).eval()
    tokens = torch.tensor([list(data[0].tokens)])
    pixels = policy._vision.pixels(data[0].images)
    kinds = (tokens == policy._vision.image_token_id).int()
    with torch.no_grad():
        logits = model(input_ids=tokens, mm_token_type_ids=kinds, **pixels, use_cache=False).logits[0, :-1].float()
    logits[:, list(policy._vision.placeholder_ids)] = float("-inf")
    theirs = torch.log_softmax(logits, -1).gather(-1, tokens[0, 1:, None])[:, 0]
    response = slice(len(ours) - 3, None)  # the prompt's image tokens are scored 0 by the trainer
    np.testing.assert_allclose(ours[response], theirs[response].numpy(), atol=1e-5)


def test_bad_image_inputs_are_clear_errors(vlm, tmp_path):
    from meshrl.data.sft import load_sft_dataset, pack_examples
    from meshrl.errors import ConfigError
    from meshrl.models.tiny_hf import create_tiny_chat_model
    from meshrl.models.vision import VisionInputs

    model_dir, renderer, policy = vlm
    text_model = create_tiny_chat_model(tmp_path / "text", arch="qwen3", vocab_size=300)
    with pytest.raises(ValueError, match=r"the row has 1 image\(s\) but the model has no vision tower"):
        Renderer.from_model_dir(text_model).prompt_images(image_row(0))
    data = datums(renderer, [image_row(0)], [[20, 21]])
    data[0].images = ()  # image tokens, but no image sent with them
    with pytest.raises(ValueError, match="datum 0 has image tokens but no images"):
        policy.forward(data)
    # SFT rows with images: examples carry them; packing them in the data loader is refused with what to do.
    vision = VisionInputs.from_model_dir(model_dir)
    rows = [{"messages": [*image_row(k).prompt, {"role": "assistant", "content": "3"}]} for k in range(2)]
    sft = load_sft_dataset(rows, renderer.tokenizer, max_seq_len=128, vision=vision)
    assert [len(ex.images) for ex in sft.examples] == [1, 1]
    assert sft.examples[0].prompt_ids.count(vision.image_token_id) == vision.tokens_per_image(sft.examples[0].images[0])
    with pytest.raises(ConfigError, match="--data.pack with image rows"):
        pack_examples(sft.examples, 128)
    with pytest.raises(Exception, match="no vision tower"):
        load_sft_dataset(rows, renderer.tokenizer, max_seq_len=128)


def test_a_new_vision_flavor_needs_the_hf_backend():
    from meshrl.errors import ConfigError
    from meshrl.models.config import ModelConfig

    with pytest.raises(ConfigError, match="vision-language model: it trains with --model.backend hf"):
        ModelConfig(flavor="tiny-qwen2.5-vl")
    assert ModelConfig(flavor="tiny-qwen3-vl", backend="hf").flavor == "tiny-qwen3-vl"


def test_environment_episodes_open_with_the_rows_images(vlm):
    """The one rollout seam: an episode opened from an image row carries its images to the engine and into its
    training datum, and the trainer scores the sampled tokens as the engine did."""
    from meshrl.generation.transformers_engine import TransformersEngine
    from meshrl.rollout.episode import EpisodeRenderer
    from meshrl.rollout.runner import EpisodeLimits, EpisodeRunner
    from meshrl.rollout.single_turn import SingleTurnEnv
    from meshrl.types import SamplingParams

    model_dir, renderer, policy = vlm
    engine = TransformersEngine(str(model_dir), max_model_len=128, max_num_seqs=8)
    sent = []

    def generate(prompts, params, *images):
        sent.append(images[0] if images else None)
        return [g[0] for g in engine.generate(prompts, params, 0, images=images[0] if images else None)]

    try:
        rows = [image_row(0), image_row(1, 96)]
        run = EpisodeRunner(SingleTurnEnv, EpisodeRenderer(renderer), generate, EpisodeLimits(1, 128, 4, 30.0))
        episodes = run.run(rows, 2, SamplingParams(stop_token_ids=renderer.stop_token_ids), seed=0)
    finally:
        engine.shutdown()
    assert sent and all(im is not None and len(im) == 4 for im in sent)  # 2 rows x 2 episodes, an image each
    data = [e.tokens.datum() for e in episodes]
    assert [d.images for d in data] == [renderer.prompt_images(rows[k // 2]) for k in range(4)]
    for d, row in zip(data, policy.forward(data), strict=True):
        mask = np.asarray(d.loss_mask) > 0
        np.testing.assert_allclose(np.asarray(row)[mask], np.asarray(d.old_logprobs)[mask], atol=1e-4)


def test_token_counts_come_from_the_size_the_pixels_have(vlm):
    """The controller counts image tokens from the file's header (no pixels made there); an EXIF-rotated JPEG decodes
    turned a quarter, and the count follows the turned size, as the trainer's pixels do."""
    import io

    _, renderer, _ = vlm
    vision = renderer.vision
    for height, width, orientation in ((84, 200, 1), (84, 200, 6), (200, 120, 8)):
        exif = picture(0, height, width).getexif()
        exif[0x0112] = orientation
        out = io.BytesIO()
        picture(0, height, width).save(out, format="JPEG", exif=exif)
        image = wire_image(out.getvalue()).data
        assert vision.tokens_per_image(image) == vision.image_tokens(vision.pixels_of(image))[0]
