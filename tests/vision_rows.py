"""Image rows and the generator-against-trainer check that the engines' vision tests share (the transformers engine's
and vLLM's): pictures drawn from a seed, one-image chat rows, and the largest sampled-token logprob gap."""

from __future__ import annotations

import numpy as np

from meshrl.rollout.images import wire_image
from meshrl.rollout.render import Renderer
from meshrl.rollout.row import Row
from meshrl.types import Datum


def picture(seed: int, height: int = 64, width: int = 64):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def image_row(seed: int, height: int = 64, text: str = "How many shapes?") -> Row:
    part = {"type": "image", "image": wire_image(picture(seed, height))}
    return Row([{"role": "user", "content": [part, {"type": "text", "text": text}]}], "3")


def prompts_of(renderer: Renderer, rows: list[Row]) -> tuple[list[list[int]], list[tuple[bytes, ...]]]:
    return [renderer.prompt_ids(r) for r in rows], [renderer.prompt_images(r) for r in rows]


def trainer_gap(policy, prompts, images, groups) -> float:
    """The largest |generator - trainer| logprob over every sampled token of `groups`."""
    data, expected = [], []
    for prompt, own, group in zip(prompts, images, groups, strict=True):
        for c in group:
            d = Datum.from_completion(prompt, c.token_ids, c.logprobs)
            d.images = own
            data.append(d)
            expected.append((len(prompt), c.logprobs))
    rows = policy.forward(data)
    return max(
        float(np.abs(np.array(row[n - 1 :]) - np.array(lp)).max()) for row, (n, lp) in zip(rows, expected, strict=True)
    )


def sequences_to_score(prompts, images, groups) -> tuple[list[list[int]], list[tuple[bytes, ...]], list[Datum]]:
    """Each sampled sequence (prompt + completion), its prompt's images, and the trainer's Datum that scores it
    (every position a target, image slots included)."""
    seqs = [p + c.token_ids for p, g in zip(prompts, groups, strict=True) for c in g]
    own = [im for im, g in zip(images, groups, strict=True) for _ in g]
    data = []
    for s, im in zip(seqs, own, strict=True):
        d = Datum.from_completion(s[:-1], s[-1:])
        d.images = im
        data.append(d)
    return seqs, own, data
