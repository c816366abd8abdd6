"""Images in rows: chat messages whose content holds image parts, the shape HF processors' chat templates read.

    {"role": "user", "content": [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "How many cats?"}]}

An image is given as a file path (str or pathlib.Path; a relative one is read from `base_dir`, the directory of the
data file), raw encoded bytes (PNG, JPEG, ...), a PIL image, or a `datasets` Image value ({"bytes": ..., "path":
...}). Rows are resolved once, at load, into their wire form: every image decoded and checked, then carried as a
`WireImage` (encoded bytes + size) that pickles small across process boundaries and tells the renderer its size
without decoding it again:

    row = resolve_row_images(row, base_dir="data/", where="row 3 of data/train.jsonl", max_images=8)
    [img.width for img in row_images(row)]          # WireImage values, in the order the processor sees them
    pil = from_wire(row_images(row)[0])             # the RGB pixels the model is shown

A separate images field of a row (--data.images-field) is merged into the first user turn before its text
(`merge_images_field`). A bad image raises `BadImageError` (a `BadRowError`, so loaders name the file and row, and
skip and count it when asked) saying which image, what is wrong, and what to do.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshrl.data.rows import BadRowError
from meshrl.rollout.row import Row

if TYPE_CHECKING:  # Pillow is imported when an image is first decoded: text-only runs never load it
    from PIL.Image import Image

KEPT_FORMATS = frozenset({"PNG", "JPEG", "WEBP"})
"""Encoded images carried as they came (see `_encode`); any other format is re-encoded as PNG."""
FORMS = (
    "a file path, encoded image bytes (PNG, JPEG, ...), a PIL image, or a datasets Image value "
    "{'bytes': ..., 'path': ...}"
)


class BadImageError(BadRowError):
    """An image of a row that cannot be used: missing file, undecodable bytes, unsupported type, zero size, or more
    images than --data.max-images-per-row. `reason` is the kind of problem (skipped rows are counted by it)."""


@dataclass(frozen=True)
class WireImage:
    """An image as it crosses a process boundary: encoded bytes (PNG, or the original JPEG / PNG / WebP) and the
    size of the RGB image they decode to (what image-token counts are computed from)."""

    data: bytes
    width: int
    height: int

    def __repr__(self) -> str:  # rows are printed in errors and logs: not the bytes
        return f"WireImage({self.width}x{self.height}, {len(self.data)} bytes)"


def load_image(value: Any, *, base_dir: str | os.PathLike | None = None, where: str = "an image") -> Image:
    """`value` (any form of the module docstring, or a WireImage) as an RGB PIL image, or BadImageError naming
    `where` (e.g. "row 3 of data/train.jsonl, image 1"), the value, and what to do."""
    return _decode(value, base_dir, where)[0]


def to_wire(image: Any, *, base_dir: str | os.PathLike | None = None, where: str = "an image") -> bytes:
    """The encoded bytes that carry `image` (any form) across a process boundary; `from_wire` gives back its RGB
    pixels exactly."""
    return wire_image(image, base_dir=base_dir, where=where).data


def wire_image(image: Any, *, base_dir: str | os.PathLike | None = None, where: str = "an image") -> WireImage:
    """`image` (any form) decoded and checked once, as a WireImage."""
    if isinstance(image, WireImage):
        return image
    rgb, encoded, fmt = _decode(image, base_dir, where)
    return WireImage(_encode(rgb, encoded, fmt), rgb.width, rgb.height)


def from_wire(data: bytes | WireImage) -> Image:
    """The RGB PIL image of a wire form (a WireImage or its bytes)."""
    raw = data.data if isinstance(data, WireImage) else data
    return _decode_bytes(bytes(raw), "a wire image")[0]


def _encode(rgb: Any, encoded: bytes | None, fmt: str | None) -> bytes:
    # Encoded input that decoded fine is carried as it came: decoding is deterministic (one Pillow in every process
    # of a run), so the receiver gets the same pixels, and a photo's JPEG is several times smaller than its PNG —
    # re-encoding would cost time and wire size for nothing. The rest (PIL images, other formats) becomes a
    # lossless PNG of the decoded RGB image.
    if encoded is not None and fmt in KEPT_FORMATS:
        return encoded
    buf = io.BytesIO()
    rgb.save(buf, format="PNG")
    return buf.getvalue()


def _decode(value: Any, base_dir: str | os.PathLike | None, where: str) -> tuple[Any, bytes | None, str | None]:
    """(RGB image, the encoded bytes it came from or None, their format or None)."""
    from PIL import Image

    if isinstance(value, WireImage):
        return _decode_bytes(value.data, where)
    if isinstance(value, Image.Image):
        return _checked(_to_rgb(value), value, where), None, None
    if isinstance(value, bytes | bytearray | memoryview):
        return _decode_bytes(bytes(value), where)
    if isinstance(value, str | os.PathLike):
        return _decode_bytes(_read(value, base_dir, where), where, shown=value)
    if isinstance(value, Mapping) and {"bytes", "path"} & value.keys():  # a datasets Image value
        if value.get("bytes") is not None:
            return _decode(value["bytes"], base_dir, where)
        if value.get("path") is not None:
            return _decode(value["path"], base_dir, where)
        raise BadImageError(
            f"{where} {_show(value)}: a datasets Image value with neither bytes nor a path; give the image's file "
            "or bytes",
            reason="empty image value",
        )
    raise BadImageError(
        f"{where} {_show(value)} is a {type(value).__name__}, not an image; give {FORMS}",
        reason="unsupported image type",
    )


def _read(value: str | os.PathLike, base_dir: str | os.PathLike | None, where: str) -> bytes:
    name = os.fspath(value)
    if isinstance(name, str) and name.startswith(("http://", "https://")):
        raise BadImageError(
            f"{where} {_show(value)}: a URL; images are not downloaded, save it and give its path",
            reason="image URL",
        )
    path = Path(os.fsdecode(name)).expanduser()
    if not path.is_absolute():
        path = (Path(base_dir) if base_dir is not None else Path.cwd()) / path
    try:
        return path.read_bytes()
    except FileNotFoundError:
        relative = f" (relative paths are read from {base_dir})" if base_dir is not None else ""
        raise BadImageError(
            f"{where} {_show(value)}: no such file {path}{relative}; fix the path", reason="image file not found"
        ) from None
    except OSError as e:  # a directory, no permission, ...
        raise BadImageError(
            f"{where} {_show(value)}: cannot read {path} ({e.strerror or e}); give the path of an image file",
            reason="image file unreadable",
        ) from None


def _decode_bytes(data: bytes, where: str, *, shown: Any = None) -> tuple[Any, bytes, str | None]:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt = im.format
            im.load()  # decode every pixel now: a truncated file fails here, at load, not in the renderer
            rgb = _to_rgb(im)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        if isinstance(e, UnidentifiedImageError):
            what = "not an image Pillow can read (an unknown format, or a damaged file)"
        elif isinstance(e, Image.DecompressionBombError):
            what = f"too large to decode safely ({e})"
        else:
            what = f"not a decodable image ({type(e).__name__}: {e})"
        raise BadImageError(
            f"{where} {_show(data if shown is None else shown)}: {what}; give a PNG, JPEG or other image file Pillow "
            "reads",
            reason="undecodable image",
        ) from None
    return _checked(rgb, shown if shown is not None else data, where), data, fmt


def _to_rgb(im: Any) -> Any:
    from PIL import ImageOps

    # As transformers' load_image does: the EXIF orientation applied (a phone photo stored sideways is shown
    # upright), then RGB (alpha dropped, palettes and greyscale expanded).
    im = ImageOps.exif_transpose(im)
    return im.convert("RGB") if im.mode != "RGB" else im.copy()


def _checked(rgb: Any, value: Any, where: str) -> Any:
    if rgb.width == 0 or rgb.height == 0:
        raise BadImageError(
            f"{where} {_show(value)}: a zero-size image ({rgb.width}x{rgb.height}); remove it from the row",
            reason="zero-size image",
        )
    return rgb


def _show(value: Any, limit: int = 60) -> str:
    """The value, abbreviated for a message."""
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        return f"({repr(data[:16])}{'...' if len(data) > 16 else ''}, {len(data)} bytes)"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {_show(v, 30)}" for k, v in value.items()) + "}"
    if hasattr(value, "size") and hasattr(value, "mode"):  # a PIL image
        return f"(PIL {value.mode} image {value.size[0]}x{value.size[1]})"
    text = repr(os.fspath(value) if isinstance(value, os.PathLike) else value)
    return text if len(text) <= limit else text[:limit] + "..."


def image_parts(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The image parts ({"type": "image", "image": ...}) of chat messages, in order: the order the processor puts
    their image tokens in the prompt and the model sees them."""
    return [
        part
        for m in messages
        if isinstance(m.get("content"), list | tuple)
        for part in m["content"]
        if isinstance(part, Mapping) and part.get("type") == "image"
    ]


def row_images(row: Row) -> list[Any]:
    """The images of a row (the values of its image parts), in the order the model sees them; [] for a plain-text
    prompt."""
    return [] if isinstance(row.prompt, str) else [part.get("image") for part in image_parts(row.prompt)]


def merge_images_field(prompt: str | Sequence[Mapping[str, Any]], images: Sequence[Any]) -> list[dict[str, Any]]:
    """A row's separate list of images merged into its prompt: image parts before the text of the first user turn
    (a plain-text prompt becomes that one user turn). BadRowError if `images` is not a list or the prompt has no
    user turn."""
    if not isinstance(images, list | tuple):
        got = type(images).__name__
        raise BadRowError(f"the images field is a {got}, expected a list of images", reason="images field not a list")
    parts = [{"type": "image", "image": image} for image in images]
    if isinstance(prompt, str):
        return [{"role": "user", "content": [*parts, {"type": "text", "text": prompt}]}]
    messages = [dict(m) for m in prompt]
    for m in messages:
        if m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, str):
                m["content"] = [*parts, {"type": "text", "text": content}] if content else parts
            else:
                m["content"] = [*parts, *(content or [])]
            return messages
    raise BadRowError(
        "the row has an images field but its prompt has no user turn to put the images in",
        reason="images field without a user turn",
    )


def resolve_row_images(
    row: Row, *, base_dir: str | os.PathLike | None = None, where: str = "the row", max_images: int = 8
) -> Row:
    """The row with every image decoded, checked and replaced by its WireImage (the row itself when it has none).
    BadImageError for a bad image (naming `where` and the image's position) or for more than `max_images`."""
    if isinstance(row.prompt, str):
        return row
    n = len(image_parts(row.prompt))
    if n == 0:
        return row
    if n > max_images:
        raise BadImageError(
            f"{where} has {n} images; --data.max-images-per-row is {max_images}: raise it, or split the row",
            reason="too many images",
        )
    k = 0
    messages = []
    for m in row.prompt:
        content = m.get("content")
        if isinstance(content, list | tuple):
            parts = []
            for part in content:
                if isinstance(part, Mapping) and part.get("type") == "image":
                    k += 1
                    wire = wire_image(part.get("image"), base_dir=base_dir, where=f"{where}, image {k} of {n}")
                    part = {**part, "image": wire}
                parts.append(part)
            m = {**m, "content": parts}
        messages.append(m)
    return replace(row, prompt=messages)


__all__ = [
    "BadImageError",
    "WireImage",
    "from_wire",
    "image_parts",
    "load_image",
    "merge_images_field",
    "resolve_row_images",
    "row_images",
    "to_wire",
    "wire_image",
]
