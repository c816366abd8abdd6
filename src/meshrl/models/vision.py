"""Images in a trainer process: pixel inputs from the model's own image processor, and positions per document.

    vision = VisionInputs.from_model_dir(model_dir, model)       # None for a text-only checkpoint
    batch = vision.pack(data, pad_id, row_len=0, pack=True)        # tokens, positions, the index back, pixel inputs
    logits = model(input_ids=batch.tokens, position_ids=batch.positions, **batch.pixels, use_cache=False).logits

A `Datum` carries its images as encoded bytes (`Datum.images`, in the order their placeholder runs appear in its
tokens, which already hold the expanded image tokens the controller's processor wrote). The pixels are made here,
where they are needed, not in the controller: an image crosses the process boundary once, compressed, and the
group's G samples share one bytes object (pickle sends it once per call), so one image is decoded and processed
once per call (`_pixel_cache`).

Positions are computed per document, so a packed row gives the logits of its documents run alone (tested against
the unpacked forward): Qwen2.5-VL / Qwen3-VL place image tokens on a 3-D (time, height, width) rotary grid
(`get_rope_index` of the model); transformers masks attention across packed documents only from 1-D text positions,
which it takes as the first of four rows (`position_ids` `[4, R, L]`: text, then the three rotary rows). Models with
plain 1-D positions (LLaVA-style) take `[R, L]` positions, as text models do.
"""

from __future__ import annotations

import hashlib
import io
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshrl.batching import pack_rows


def is_vision_checkpoint(model_dir: str | Path) -> bool:
    """True when the checkpoint's config.json has a vision tower (`vision_config`)."""
    import json

    f = Path(model_dir) / "config.json"
    try:
        return "vision_config" in json.loads(f.read_text())
    except (OSError, ValueError):
        return False


def image_token_id(config: Any) -> int:
    """The id of the placeholder token an image's features replace (Qwen: `image_token_id`, LLaVA:
    `image_token_index`)."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    raise ValueError(f"{type(config).__name__} names no image token (image_token_id / image_token_index)")


def placeholder_ids(config: Any) -> tuple[int, ...]:
    """Tokens that stand for images or videos in a prompt (their features replace them). A model must never write
    one: the trainer would take a sampled one for an image slot. The generators suppress them and the trainer's
    logprobs leave them out, so both score the same distribution."""
    ids = [image_token_id(config)]
    for name in ("video_token_id", "video_token_index"):
        value = getattr(config, name, None)
        if value is not None:
            ids.append(int(value))
    return tuple(sorted(set(ids)))


@dataclass
class VisionBatch:
    """A forward's inputs for `data` with images: `tokens` `[R, L]`, `positions` (`[4, R, L]` for 3-D rotary
    positions, else `[R, L]`), `index` `[D, T]` into the flattened `[R, L - 1]` target logprobs that gives back
    `collate`'s layout (row d: datum d's targets), and `pixels` (the image processor's tensors for every image of
    the rows, in token order)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    index: torch.Tensor
    pixels: dict[str, torch.Tensor]


class VisionInputs:
    """The model's image processor and position rule, in the process that runs the model."""

    def __init__(self, image_processor: Any, config: Any, rope_index: Any = None, *, cache_size: int = 256) -> None:
        self.image_processor, self.config = image_processor, config
        self.image_token_id = image_token_id(config)
        self.placeholder_ids = placeholder_ids(config)
        self.merge = int(getattr(getattr(config, "vision_config", None), "spatial_merge_size", 1) or 1)
        self._rope_index = rope_index  # the model's get_rope_index (3-D rotary positions), or None
        self._pixel_cache: OrderedDict[bytes, dict[str, torch.Tensor]] = OrderedDict()
        self._cache_size = cache_size

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, model: torch.nn.Module | None = None) -> VisionInputs | None:
        """None for a text-only checkpoint. `model`: the transformers model (its `get_rope_index`, if any, gives
        the 3-D positions); None where only prompts are rendered (the controller: `expand`)."""
        if not is_vision_checkpoint(model_dir):
            return None
        from transformers import AutoConfig, AutoImageProcessor

        config = AutoConfig.from_pretrained(str(model_dir))
        # The image processor alone, not AutoProcessor: the Qwen-VL processors build a video processor too, which
        # needs torchvision (not installed here); the placeholder expansion they do is `expand` below.
        processor = AutoImageProcessor.from_pretrained(str(model_dir))
        inner = getattr(model, "model", model)
        return cls(processor, config, getattr(inner, "get_rope_index", None))

    # ---- prompts ------------------------------------------------------------------------------------------------
    def tokens_per_image(self, image: bytes) -> int:
        """How many image tokens `image` becomes: Qwen-VL: its grid cells after resizing / merge²; fixed-size
        encoders (LLaVA-style): the config's `image_seq_length`, else the patch count (+1 for a kept CLS token).
        Qwen-VL counts from the image's size alone (the processor's own `get_number_of_image_patches`, read from the
        file's header): the controller renders every prompt at launch and makes no pixels for it."""
        patches_of = getattr(self.image_processor, "get_number_of_image_patches", None)
        if patches_of is not None:
            from PIL import Image

            with Image.open(io.BytesIO(image)) as im:  # the header only: no decode
                width, height = im.size
                if im.getexif().get(0x0112, 1) in (5, 6, 7, 8):  # turned a quarter on decode (images.from_wire)
                    width, height = height, width
            return int(patches_of(height, width, {})) // (self.merge * self.merge)
        counted = self.image_tokens(self.pixels_of(image))
        if counted:
            return int(counted[0])
        fixed = getattr(self.config, "image_seq_length", None)
        if fixed:
            return int(fixed)
        vc = self.config.vision_config
        patches = (int(vc.image_size) // int(vc.patch_size)) ** 2
        return patches + (1 if getattr(self.config, "vision_feature_select_strategy", "default") == "full" else 0)

    def expand(self, ids: Sequence[int], images: Sequence[bytes], what: str = "the prompt") -> list[int]:
        """A rendered prompt with one image placeholder per image (what chat templates write) -> the prompt with
        each placeholder repeated as many times as its image has tokens: the ids the trainer and the generators
        see (the Qwen-VL and LLaVA processors do the same to text)."""
        at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(at) != len(images):
            raise ValueError(
                f"{what} renders {len(at)} image placeholder(s) for {len(images)} image(s): the chat template must "
                "write one per image part ({'type': 'image'}) of the messages"
            )
        out: list[int] = []
        last = 0
        for i, image in zip(at, images, strict=True):
            out += ids[last:i]
            out += [self.image_token_id] * self.tokens_per_image(image)
            last = i + 1
        return out + list(ids[last:])

    @property
    def rope_3d(self) -> bool:
        return self._rope_index is not None

    # ---- pixels -------------------------------------------------------------------------------------------------
    def pixels_of(self, image: bytes) -> dict[str, torch.Tensor]:
        """The image processor's tensors for one image (cached by content: a group's samples share their prompt's
        images)."""
        key = hashlib.blake2b(image, digest_size=16).digest()
        hit = self._pixel_cache.get(key)
        if hit is not None:
            self._pixel_cache.move_to_end(key)
            return hit
        from meshrl.rollout.images import from_wire

        out = self.image_processor(images=[from_wire(image)], return_tensors="pt")
        tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
        self._pixel_cache[key] = tensors
        if len(self._pixel_cache) > self._cache_size:
            self._pixel_cache.popitem(last=False)
        return tensors

    def pixels(self, images: Sequence[bytes]) -> dict[str, torch.Tensor]:
        """Every image's tensors, concatenated in order along the first dimension (the order the model scatters
        image features into the image tokens)."""
        parts = [self.pixels_of(b) for b in images]
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]} if parts else {}

    def image_tokens(self, pixels: dict[str, torch.Tensor]) -> list[int]:
        """Image tokens per image (Qwen: grid cells / merge²; otherwise unknown: [])."""
        grid = pixels.get("image_grid_thw")
        if grid is None:
            return []
        return (grid.prod(-1) // (self.merge * self.merge)).tolist()

    def check(self, tokens: Sequence[int], images: Sequence[bytes], what: str) -> None:
        """A sequence's image tokens must be exactly what its images become: a mismatch would scatter image
        features into the wrong tokens (or fail deep inside the model)."""
        found = int(np.count_nonzero(np.asarray(tokens) == self.image_token_id))
        expected = self.image_tokens(self.pixels(images)) if images else []
        if expected and found != sum(expected):
            raise ValueError(
                f"{what} has {found} image tokens but its {len(images)} image(s) make {sum(expected)} "
                f"({expected}); the prompt was rendered with another image processor or other images"
            )
        if not images and found:
            raise ValueError(f"{what} has {found} image tokens but no images")

    def stand_in(self, pad_id: int) -> Any:
        """A loss-free Datum of one blank picture: a row that runs the vision tower where a trainer rank's share has
        no image (Policy: FSDP needs every rank to run it)."""
        from PIL import Image

        from meshrl.rollout.images import to_wire
        from meshrl.types import Datum

        if not hasattr(self, "_blank"):
            self._blank = to_wire(Image.new("RGB", (56, 56), "white"))
        tokens = [self.image_token_id] * self.tokens_per_image(self._blank) + [pad_id]
        return Datum(tokens, [0.0] * (len(tokens) - 1), images=(self._blank,))

    # ---- positions ----------------------------------------------------------------------------------------------
    def positions_of(self, tokens: Sequence[int], images: Sequence[bytes]) -> torch.Tensor:
        """One document's positions: `[4, n]` (text, then the 3-D rotary rows) or `[1, n]`."""
        n = len(tokens)
        text = torch.arange(n).reshape(1, n)
        if not self.rope_3d:
            return text
        ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64)).reshape(1, n)
        grid = self.pixels(images).get("image_grid_thw") if images else None
        kinds = (ids == self.image_token_id).int()
        rope, _ = self._rope_index(ids, kinds, image_grid_thw=grid)
        return torch.cat([text, rope.reshape(3, n).to(text.dtype)])

    # ---- a forward's inputs -------------------------------------------------------------------------------------
    def pack(self, data: Sequence[Any], pad_id: int, *, row_len: int, pack: bool, device: torch.device) -> VisionBatch:
        """Rows for the forward of `data` (Datums, some with images): packed when `pack` (documents side by side in
        rows of at most `row_len` tokens, 0: one row), else one row per datum. Padding continues the row's last
        document (its loss mask is 0 there)."""
        lengths = [len(d.tokens) for d in data]
        rows = pack_rows(lengths, row_len) if pack else [[i] for i in range(len(data))]
        L = max(sum(lengths[i] for i in row) for row in rows)
        T = max(lengths) - 1
        P = 4 if self.rope_3d else 1
        tokens = np.full((len(rows), L), pad_id, dtype=np.int64)
        positions = torch.zeros(P, len(rows), L, dtype=torch.long)
        index = np.zeros((len(data), T), dtype=np.int64)
        images: list[bytes] = []
        for r, row in enumerate(rows):
            offset = 0
            for i in row:
                n, d = lengths[i], data[i]
                own = list(d.images or ())
                tokens[r, offset : offset + n] = d.tokens
                positions[:, r, offset : offset + n] = self.positions_of(d.tokens, own)
                index[i, : n - 1] = r * (L - 1) + offset + np.arange(n - 1)
                images += own
                offset += n
            positions[:, r, offset:] = positions[:, r, offset - 1 : offset] + torch.arange(1, L - offset + 1)
        as_tensor = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
        pos = positions.to(device) if P == 4 else positions[0].to(device)
        pixels = {k: v.to(device) for k, v in self.pixels(images).items()}
        return VisionBatch(as_tensor(tokens), pos, as_tensor(index), pixels)
