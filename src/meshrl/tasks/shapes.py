"""Shapes: a visual question-answering task drawn in code, for vision-language models (no download).

Each row is a small white picture with 1-4 filled shapes (circle / square / triangle) of one or two colours,
never touching, and a question answered by one digit or one word, scored by exact match:

    --task shapes --shapes.num-train 5000 --shapes.image-size 56 --shapes.questions count,colour

    How many shapes are there?            -> "3"
    What colour is the shape?             -> "red"       (pictures of one colour)
    How many blue shapes are there?       -> "2"         (pictures of two colours; may be "0")
    What shape is it?                     -> "triangle"  (pictures of one kind of shape)

Rows: `Row(prompt=[{"role": "user", "content": [{"type": "image", "image": WireImage}, {"type": "text", "text":
"How many shapes are there? Answer with a number."}]}], answer="3", info={"question": "count", "shapes": [["circle",
"red"], ...]})`. The image is already in its wire form (meshrl.rollout.images). Shapes are drawn without
anti-aliasing, so every pixel is white or exactly one of the palette's colours. Held-out pictures never appear in
the training set. Deterministic: the same config gives the same rows.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from meshrl.errors import ConfigError
from meshrl.rollout.images import wire_image
from meshrl.tasks.base import Row, Task

PALETTE = {
    "red": (220, 30, 30),
    "green": (30, 150, 50),
    "blue": (30, 70, 220),
    "yellow": (235, 195, 15),
    "purple": (140, 50, 180),
    "orange": (245, 130, 20),
    "black": (0, 0, 0),
}
KINDS = ("circle", "square", "triangle")
QUESTIONS = ("count", "colour", "count_colour", "shape")
BACKGROUND = (255, 255, 255)
MARGIN = 2  # pixels between a shape and its grid cell's edge: shapes never touch (4 pixels apart at least)
MIN_SHAPE = 8  # the smallest side a shape is drawn with: smaller triangles and circles are hard to tell apart


@dataclass
class ShapesConfig:
    """The built-in visual task (--task shapes): questions about shapes drawn on a white picture, exact match."""

    num_train: int = 5000
    """Training questions, all distinct."""
    num_eval: int = 200
    """Held-out questions (distinct, none of their pictures in the training set; drawn first, so the same for any
    num_train)."""
    seed: int = 1234
    """Seed of the generated pictures and questions."""
    image_size: int = 56
    """Width and height of the square picture, in pixels."""
    min_shapes: int = 1
    """Fewest shapes in a picture."""
    max_shapes: int = 4
    """Most shapes in a picture (at most 9: counts are one digit)."""
    colours: str = "red,green,blue"
    """Comma-separated colours shapes are filled with; a picture uses one or two of them. Any of red, green, blue,
    yellow, purple, orange, black."""
    kinds: str = "circle,square,triangle"
    """Comma-separated kinds of shapes drawn: any of circle, square, triangle."""
    questions: str = "count,colour,count_colour"
    """Comma-separated kinds of questions, each equally likely: count ('How many shapes are there?'), colour ('What
    colour is the shape?', one colour a picture), count_colour ('How many red shapes are there?', two colours a
    picture), shape ('What shape is it?', one kind a picture)."""

    def __post_init__(self) -> None:
        if self.num_train < 1:
            raise ConfigError(f"--shapes.num-train={self.num_train}: the training set is empty")
        if self.num_eval < 1:
            raise ConfigError(f"--shapes.num-eval={self.num_eval}: the held-out set is empty")
        if not 1 <= self.min_shapes <= self.max_shapes <= 9:
            raise ConfigError(
                f"--shapes.min-shapes={self.min_shapes} and --shapes.max-shapes={self.max_shapes}: need 1 <= min "
                "<= max <= 9 (counts are one digit)"
            )
        for flag, names, known in (("colours", self.colour_list, PALETTE), ("kinds", self.kind_list, KINDS)):
            given = getattr(self, flag)
            if not names or len(set(names)) != len(names) or any(n not in known for n in names):
                raise ConfigError(
                    f"--shapes.{flag}={given!r}: give distinct names, comma-separated, from {', '.join(known)}"
                )
        questions = self.question_list
        if not questions or len(set(questions)) != len(questions) or any(q not in QUESTIONS for q in questions):
            raise ConfigError(
                f"--shapes.questions={self.questions!r}: give distinct names, comma-separated, from "
                f"{', '.join(QUESTIONS)}"
            )
        if "count_colour" in questions and len(self.colour_list) < 2:
            raise ConfigError(
                f"--shapes.questions has count_colour, which asks about pictures of two colours, but "
                f"--shapes.colours={self.colours!r} has one; add a colour or drop count_colour"
            )
        cell = self.image_size // self.grid
        if cell - 2 * MARGIN < MIN_SHAPE:
            need = self.grid * (MIN_SHAPE + 2 * MARGIN)
            raise ConfigError(
                f"--shapes.image-size={self.image_size} is too small for --shapes.max-shapes={self.max_shapes}: "
                f"each shape needs a {MIN_SHAPE + 2 * MARGIN}-pixel cell of a {self.grid}x{self.grid} grid; use "
                f"--shapes.image-size {need} or more"
            )

    @property
    def colour_list(self) -> list[str]:
        return [c.strip() for c in self.colours.split(",") if c.strip()]

    @property
    def kind_list(self) -> list[str]:
        return [k.strip() for k in self.kinds.split(",") if k.strip()]

    @property
    def question_list(self) -> list[str]:
        return [q.strip() for q in self.questions.split(",") if q.strip()]

    @property
    def grid(self) -> int:
        """Cells a side of the grid the shapes are placed in, one shape a cell (so that they never overlap)."""
        return math.ceil(math.sqrt(self.max_shapes))


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    x: int  # left
    y: int  # top
    size: int  # side of the square the shape fills (its bounding box)


@dataclass(frozen=True)
class Scene:
    """One question: the picture's shapes, the question asked and its answer."""

    shapes: tuple[Shape, ...]
    question: str  # one of QUESTIONS
    text: str
    answer: str


def make_scene(cfg: ShapesConfig, rng: random.Random) -> Scene:
    """One picture and question, drawn from `rng`."""
    question = rng.choice(cfg.question_list)
    n = rng.randint(cfg.min_shapes, cfg.max_shapes)
    if question == "colour":
        palette = [rng.choice(cfg.colour_list)]
    elif question == "count_colour" or len(cfg.colour_list) > 1 and rng.random() < 0.5:
        palette = rng.sample(cfg.colour_list, 2)
    else:
        palette = [rng.choice(cfg.colour_list)]
    kinds = [rng.choice(cfg.kind_list)] if question == "shape" else cfg.kind_list
    grid, cell = cfg.grid, cfg.image_size // cfg.grid
    inner = cell - 2 * MARGIN
    shapes = []
    for c in sorted(rng.sample(range(grid * grid), n)):  # sorted: a scene's shapes read row by row
        size = rng.randint(max(MIN_SHAPE, inner * 2 // 3), inner)
        x = (c % grid) * cell + MARGIN + rng.randint(0, inner - size)
        y = (c // grid) * cell + MARGIN + rng.randint(0, inner - size)
        shapes.append(Shape(rng.choice(kinds), rng.choice(palette), x, y, size))
    if question == "count":
        text, answer = "How many shapes are there? Answer with a number.", str(n)
    elif question == "colour":
        what = "the shape" if n == 1 else "the shapes"
        text, answer = f"What colour {'is' if n == 1 else 'are'} {what}? Answer with one word.", palette[0]
    elif question == "count_colour":
        asked = rng.choice(palette)
        text = f"How many {asked} shapes are there? Answer with a number."
        answer = str(sum(s.colour == asked for s in shapes))
    else:
        text = f"What shape {'is it' if n == 1 else 'are they'}? Answer with one word."
        answer = shapes[0].kind
    return Scene(tuple(shapes), question, text, answer)


def draw(shapes: tuple[Shape, ...] | list[Shape], image_size: int):
    """The RGB PIL picture of `shapes` on white; no anti-aliasing (every pixel white or a palette colour)."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (image_size, image_size), BACKGROUND)
    pen = ImageDraw.Draw(im)
    for s in shapes:
        box = (s.x, s.y, s.x + s.size - 1, s.y + s.size - 1)
        fill = PALETTE[s.colour]
        if s.kind == "circle":
            pen.ellipse(box, fill=fill)
        elif s.kind == "square":
            pen.rectangle(box, fill=fill)
        else:  # apex up
            pen.polygon([(s.x + (s.size - 1) / 2, s.y), (s.x, box[3]), (box[2], box[3])], fill=fill)
    return im


def make_row(scene: Scene, image_size: int) -> Row:
    image = wire_image(draw(scene.shapes, image_size))
    content = [{"type": "image", "image": image}, {"type": "text", "text": scene.text}]
    info = {"question": scene.question, "shapes": [[s.kind, s.colour] for s in scene.shapes]}
    return Row(prompt=[{"role": "user", "content": content}], answer=scene.answer, info=info)


def _distinct_rows(cfg: ShapesConfig, n: int, rng: random.Random, exclude: set[tuple[Shape, ...]]) -> list[Row]:
    # Distinct pictures (not only distinct questions): a held-out picture asked another question is still seen.
    out: list[Row] = []
    for _ in range(50 * n):
        if len(out) == n:
            break
        scene = make_scene(cfg, rng)
        if scene.shapes in exclude:
            continue
        exclude.add(scene.shapes)
        out.append(make_row(scene, cfg.image_size))
    return out


def build_shapes_task(cfg: ShapesConfig) -> Task:
    """Distinct held-out pictures, then distinct training pictures that are not among them, each from its own
    random stream of the seed (the held-out set does not depend on `num_train`)."""
    seen: set[tuple[Shape, ...]] = set()
    held_out = _distinct_rows(cfg, cfg.num_eval, random.Random(f"shapes-eval-{cfg.seed}"), seen)
    train = _distinct_rows(cfg, cfg.num_train, random.Random(f"shapes-train-{cfg.seed}"), seen)
    if len(held_out) < cfg.num_eval or len(train) < cfg.num_train:
        raise ConfigError(
            f"shapes: found only {len(train)} + {len(held_out)} distinct pictures of the {cfg.num_train} + "
            f"{cfg.num_eval} asked for; raise --shapes.image-size or --shapes.max-shapes, or lower "
            "--shapes.num-train / --shapes.num-eval"
        )
    # exact: the completion, whitespace stripped, is the digit or the word.
    return Task("shapes", train, held_out, reward="exact=1.0", verifier="exact")


__all__ = ["PALETTE", "Scene", "Shape", "ShapesConfig", "build_shapes_task", "draw", "make_scene"]
