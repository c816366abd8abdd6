"""The visual shapes task (meshrl.tasks.shapes): answers re-derived from the pixels of each drawn picture, determinism,
held-out pictures never trained on, exact-match scoring, config validation, and `--task shapes` wiring."""

from __future__ import annotations

import pytest

from meshrl.config import GRPORunConfig
from meshrl.controller.cli import parse_run_config
from meshrl.errors import ConfigError
from meshrl.rewards import exact
from meshrl.rollout.images import WireImage, from_wire, row_images
from meshrl.tasks import build_task
from meshrl.tasks.base import Task
from meshrl.tasks.shapes import BACKGROUND, PALETTE, ShapesConfig, build_shapes_task

COLOUR_OF = {rgb: name for name, rgb in PALETTE.items()}


def _blobs(row) -> list[tuple[str, str]]:
    """(colour, kind) of every shape in the row's picture, found from its pixels alone: connected regions of one
    palette colour (4-neighbours), the kind told by how much of its bounding box a region fills."""
    (wire,) = row_images(row)
    im = from_wire(wire)
    w, h = im.size
    px = im.load()
    seen: set[tuple[int, int]] = set()
    blobs = []
    for y0 in range(h):
        for x0 in range(w):
            rgb = px[x0, y0]
            if rgb == BACKGROUND or (x0, y0) in seen:
                continue
            assert rgb in COLOUR_OF, f"pixel {rgb} is neither white nor a palette colour (anti-aliased?)"
            stack, region = [(x0, y0)], []
            seen.add((x0, y0))
            while stack:
                x, y = stack.pop()
                region.append((x, y))
                for nx, ny in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
                    if 0 <= nx < w and 0 <= ny < h and (nx, ny) not in seen and px[nx, ny] != BACKGROUND:
                        assert px[nx, ny] == rgb, "two shapes touch"
                        seen.add((nx, ny))
                        stack.append((nx, ny))
            xs, ys = [p[0] for p in region], [p[1] for p in region]
            fill = len(region) / ((max(xs) - min(xs) + 1) * (max(ys) - min(ys) + 1))
            kind = "square" if fill > 0.95 else "circle" if fill > 0.68 else "triangle"  # 1, pi/4, 1/2
            blobs.append((COLOUR_OF[rgb], kind))
    return blobs


def _text(row) -> str:
    (part,) = [p for p in row.prompt[0]["content"] if p["type"] == "text"]
    return part["text"]


def _answer_from_pixels(row) -> str:
    blobs, text = _blobs(row), _text(row)
    if text.startswith("How many shapes"):
        return str(len(blobs))
    if text.startswith("How many "):
        colour = text.split()[2]
        assert colour in PALETTE
        return str(sum(c == colour for c, _ in blobs))
    if text.startswith("What colour"):
        (colour,) = {c for c, _ in blobs}
        return colour
    assert text.startswith("What shape"), text
    (kind,) = {k for _, k in blobs}
    return kind


@pytest.mark.parametrize(
    "cfg",
    [
        ShapesConfig(num_train=150, num_eval=50, seed=1, questions="count,colour,count_colour,shape"),
        ShapesConfig(num_train=80, num_eval=20, seed=2, image_size=40, max_shapes=9, questions="count,shape"),
        ShapesConfig(num_train=80, num_eval=20, seed=3, image_size=96, colours="yellow,purple,black", kinds="circle"),
    ],
)
def test_answers_are_right_by_the_pixels(cfg):
    task = build_shapes_task(cfg)
    assert isinstance(task, Task) and task.name == "shapes" and task.reward == "exact=1.0" and task.verifier == "exact"
    assert len(task.train) == cfg.num_train and len(task.eval) == cfg.num_eval
    asked = set()
    for row in list(task.train) + list(task.eval):
        (wire,) = row_images(row)
        assert isinstance(wire, WireImage) and (wire.width, wire.height) == (cfg.image_size, cfg.image_size)
        assert row.prompt[0]["role"] == "user" and row.prompt[0]["content"][0]["type"] == "image"  # image, then text
        blobs = _blobs(row)
        assert cfg.min_shapes <= len(blobs) <= cfg.max_shapes
        assert sorted(blobs) == sorted((c, k) for k, c in row.info["shapes"])  # the spec is what was drawn
        assert len({c for c, _ in blobs}) <= 2 and {c for c, _ in blobs} <= set(cfg.colour_list)
        assert row.answer == _answer_from_pixels(row), (_text(row), row.info)
        assert task.demonstration(row) == row.answer
        asked.add(row.info["question"])
    assert asked == set(cfg.question_list)


def test_deterministic_by_seed():
    cfg = dict(num_train=60, num_eval=20)
    a, b = build_shapes_task(ShapesConfig(seed=7, **cfg)), build_shapes_task(ShapesConfig(seed=7, **cfg))
    assert a.train == b.train and a.eval == b.eval
    assert [row_images(r)[0].data for r in a.train] == [row_images(r)[0].data for r in b.train]
    c = build_shapes_task(ShapesConfig(seed=8, **cfg))
    assert a.train != c.train


def test_held_out_pictures_are_never_trained_on():
    small = build_shapes_task(ShapesConfig(num_train=100, num_eval=60, max_shapes=2))
    big = build_shapes_task(ShapesConfig(num_train=600, num_eval=60, max_shapes=2))
    for task in (small, big):
        train = {row_images(r)[0].data for r in task.train}
        held_out = {row_images(r)[0].data for r in task.eval}
        assert len(train) == len(task.train) and len(held_out) == len(task.eval)  # distinct pictures
        assert not train & held_out
    assert small.eval == big.eval  # the same held-out questions whatever the training-set size


def test_scoring_is_exact_match():
    task = build_shapes_task(ShapesConfig(num_train=40, num_eval=10, questions="count,colour"))
    for row in task.eval:
        view = row.verifier_view()
        assert exact(row.answer, view) == 1.0 and exact(f" {row.answer}\n", view) == 1.0
        wrong = "9" if row.answer.isdigit() else "grey"
        capitalised = [] if row.answer.isdigit() else [row.answer.capitalize()]
        for completion in (wrong, f"{row.answer} shapes", f"The answer is {row.answer}.", *capitalised):
            assert exact(completion, view) == 0.0, completion


def test_built_in_task_and_its_flags():
    cfg = parse_run_config(
        GRPORunConfig, argv=["--task", "shapes", "--shapes.num-train", "30", "--shapes.num-eval", "6"]
    )
    assert cfg.shapes == ShapesConfig(num_train=30, num_eval=6)
    task = build_task(cfg)
    assert task.name == "shapes" and len(task.train) == 30 and len(task.eval) == 6


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(num_train=0), "--shapes.num-train=0"),
        (dict(num_eval=0), "--shapes.num-eval=0"),
        (dict(min_shapes=0), "need 1 <= min <= max <= 9"),
        (dict(min_shapes=3, max_shapes=2), "need 1 <= min <= max <= 9"),
        (dict(max_shapes=10, image_size=200), "need 1 <= min <= max <= 9"),
        (dict(colours="red,pink"), "--shapes.colours='red,pink'"),
        (dict(colours="red,red"), "give distinct names"),
        (dict(kinds="hexagon"), "--shapes.kinds='hexagon'"),
        (dict(questions="count,size"), "--shapes.questions='count,size'"),
        (dict(colours="red", questions="count_colour"), "add a colour or drop count_colour"),
        (
            dict(image_size=20),
            "--shapes.image-size=20 is too small for --shapes.max-shapes=4.*use --shapes.image-size 24",
        ),
    ],
)
def test_bad_config_is_named(kw, message):
    with pytest.raises(ConfigError, match=message):
        ShapesConfig(**kw)
