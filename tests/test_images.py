"""Images in rows (meshrl.rollout.images) and their loading (meshrl.data.prompts): every image form, every bad image,
the images field merged into the first user turn, the wire form's round trip, and rows with images read from
JSONL / Parquet / datasets directories / Python lists through the real data loader."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import pytest
from PIL import Image

from meshrl.data.prompts import DataConfig, as_row, load_prompt_rows
from meshrl.data.rows import BadRowError
from meshrl.errors import ConfigError, DataError
from meshrl.rollout.images import (
    BadImageError,
    WireImage,
    from_wire,
    image_parts,
    load_image,
    merge_images_field,
    resolve_row_images,
    row_images,
    to_wire,
    wire_image,
)
from meshrl.rollout.row import Row

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
WHERE = "row 3 of data/train.jsonl, image 1 of 1"


def _picture(w: int = 7, h: int = 5, mode: str = "RGB") -> Image.Image:
    """Every pixel different: a round trip that moves, drops or blends pixels shows."""
    im = Image.new("RGB", (w, h))
    im.putdata([(16 * x, 40 * y, (x * 7 + y * 13) % 256) for y in range(h) for x in range(w)])
    return im.convert(mode) if mode != "RGB" else im


def _encoded(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _pixels(im: Image.Image) -> bytes:
    assert im.mode == "RGB"
    return im.tobytes()


PIC = _picture()
PNG = _encoded(PIC, "PNG")
BIG_PNG = _encoded(_picture(64, 64), "PNG")


@pytest.fixture
def files(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(PNG)
    (tmp_path / "img" / "b.png").write_bytes(_encoded(_picture(3, 9), "PNG"))
    return tmp_path


# --- every form ----------------------------------------------------------------------------------------------------


def test_every_image_form_loads_as_the_same_rgb_pixels(files, monkeypatch):
    monkeypatch.chdir(files / "img")  # relative paths without base_dir are read from the working directory
    forms = {
        "absolute str path": str(files / "img" / "a.png"),
        "pathlib.Path": files / "img" / "a.png",
        "relative path, base_dir": "img/a.png",
        "relative path, working directory": "a.png",
        "bytes": PNG,
        "bytearray": bytearray(PNG),
        "PIL image": PIC.copy(),
        "datasets value with bytes": {"bytes": PNG, "path": "elsewhere/ignored.png"},
        "datasets value with a path": {"bytes": None, "path": "img/a.png"},
        "wire image": wire_image(PNG),
    }
    for what, value in forms.items():
        base_dir = None if what == "relative path, working directory" else files
        im = load_image(value, base_dir=base_dir, where=WHERE)
        assert isinstance(im, Image.Image) and im.size == (7, 5), what
        assert _pixels(im) == _pixels(PIC), what


def test_other_modes_become_rgb():
    for mode in ("RGBA", "L", "P", "CMYK"):
        src = _picture(mode=mode)
        im = load_image(_encoded(src, "TIFF") if mode == "CMYK" else src)
        assert im.mode == "RGB" and im.size == (7, 5) and _pixels(im) == _pixels(src.convert("RGB")), mode
    # A grey PNG decodes to the grey levels, expanded to three channels.
    grey = load_image(_encoded(_picture(mode="L"), "PNG"))
    assert grey.getpixel((3, 2)) == (_picture(mode="L").getpixel((3, 2)),) * 3


def test_exif_orientation_is_applied_as_transformers_does():
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: rotate 90 degrees clockwise to show it
    jpeg = _encoded(_picture(8, 4), "JPEG", exif=exif, quality=95)
    im = load_image(jpeg)
    assert im.size == (4, 8)
    wire = wire_image(jpeg)
    assert (wire.width, wire.height) == (4, 8) and from_wire(wire).size == (4, 8)


# --- bad images ----------------------------------------------------------------------------------------------------

BAD = [
    ("img/missing.png", "image file not found", "no such file", "fix the path"),
    (b"this is not an image", "undecodable image", "not an image", "give a PNG, JPEG"),
    (PNG[:40], "undecodable image", "an unknown format, or a damaged file", "give a PNG, JPEG"),
    (BIG_PNG[: len(BIG_PNG) // 2], "undecodable image", "not a decodable image", "give a PNG, JPEG"),  # truncated
    (17, "unsupported image type", "is a int, not an image", "give a file path, encoded image bytes"),
    ([PNG], "unsupported image type", "is a list, not an image", "give a file path"),
    (Image.new("RGB", (0, 3)), "zero-size image", "a zero-size image (0x3)", "remove it from the row"),
    ({"bytes": None, "path": None}, "empty image value", "neither bytes nor a path", "give the image's file"),
    ("https://example.com/cat.png", "image URL", "a URL; images are not downloaded", "give its path"),
]


@pytest.mark.parametrize("value, reason, what, todo", BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_bad_images_are_named_with_what_to_do(files, value, reason, what, todo):
    with pytest.raises(BadImageError) as e:
        load_image(value, base_dir=files, where=WHERE)
    msg = str(e.value)
    assert isinstance(e.value, BadRowError) and isinstance(e.value, DataError)
    assert e.value.reason == reason
    assert msg.startswith(WHERE) and what in msg and todo in msg, msg


def test_bad_image_messages_abbreviate_the_value(files):
    with pytest.raises(BadImageError) as e:
        load_image(b"x" * 5000, where=WHERE)
    assert "5000 bytes" in str(e.value) and len(str(e.value)) < 400
    with pytest.raises(BadImageError) as e:
        load_image("d/" + "long" * 100 + ".png", base_dir=files, where=WHERE)
    assert "'d/longlong" in str(e.value) and "..." in str(e.value)
    with pytest.raises(BadImageError, match=f"relative paths are read from {files}"):
        load_image("img/missing.png", base_dir=files, where=WHERE)


# --- the wire form -------------------------------------------------------------------------------------------------


def test_wire_round_trip_is_pixel_identical():
    for value in (PIC, _picture(mode="RGBA"), _encoded(PIC, "BMP"), _encoded(PIC, "GIF")):
        data = to_wire(value)
        assert data.startswith(PNG_SIGNATURE)  # a lossless PNG of the decoded RGB image
        assert _pixels(from_wire(data)) == _pixels(load_image(value))
    wire = wire_image(PIC)
    assert (wire.width, wire.height) == (7, 5) and _pixels(from_wire(wire)) == _pixels(PIC)
    assert repr(wire).startswith("WireImage(7x5, ")


def test_encoded_png_and_jpeg_are_carried_as_they_came():
    jpeg = _encoded(_picture(32, 24), "JPEG", quality=80)
    for data in (PNG, jpeg, _encoded(PIC, "WEBP", lossless=True)):
        assert to_wire(data) == data
        assert _pixels(from_wire(data)) == _pixels(load_image(data))  # the same decode on both sides
    assert wire_image(jpeg) == WireImage(jpeg, 32, 24)
    wire = wire_image(jpeg)
    assert wire_image(wire) is wire  # resolving twice changes nothing
    assert pickle.loads(pickle.dumps(wire)) == wire


# --- rows: parts, order, the images field --------------------------------------------------------------------------


def _chat(*contents):
    return [{"role": role, "content": c} for role, c in zip(("user", "assistant", "user"), contents, strict=False)]


def test_image_parts_and_row_images_keep_the_order_the_model_sees():
    messages = [
        {"role": "system", "content": "Look closely."},
        *_chat(
            [{"type": "image", "image": "one.png"}, {"type": "text", "text": "and"}, {"type": "image", "image": "two"}],
            "Yes.",
            [{"type": "text", "text": "now"}, {"type": "image", "image": "three"}],
        ),
    ]
    assert [p["image"] for p in image_parts(messages)] == ["one.png", "two", "three"]
    assert row_images(Row(messages)) == ["one.png", "two", "three"]
    assert row_images(Row("plain text")) == [] and row_images(Row(_chat("text only"))) == []


def test_merge_images_field_puts_images_before_the_first_user_turns_text():
    assert merge_images_field("How many?", ["a", "b"]) == [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": "a"},
                {"type": "image", "image": "b"},
                {"type": "text", "text": "How many?"},
            ],
        }
    ]
    system = {"role": "system", "content": "Be brief."}
    prompt = [system, {"role": "user", "content": "first"}, {"role": "user", "content": "second"}]
    merged = merge_images_field(prompt, ["a"])
    assert merged == [
        system,
        {"role": "user", "content": [{"type": "image", "image": "a"}, {"type": "text", "text": "first"}]},
        {"role": "user", "content": "second"},
    ]
    assert prompt[1] == {"role": "user", "content": "first"}  # the input is not modified
    parts = [{"type": "text", "text": "q"}, {"type": "image", "image": "x"}]
    assert merge_images_field([{"role": "user", "content": parts}], ["a"])[0]["content"] == [
        {"type": "image", "image": "a"},
        *parts,
    ]
    with pytest.raises(BadRowError, match="no user turn"):
        merge_images_field([system], ["a"])
    with pytest.raises(BadRowError, match="the images field is a str, expected a list of images"):
        merge_images_field("q", "a.png")


def test_resolve_row_images(files):
    text = Row("What is 2 + 2?", answer="4")
    assert resolve_row_images(text, base_dir=files, where="row 1", max_images=1) is text
    chat = Row(_chat("no images here"), answer="x")
    assert resolve_row_images(chat, base_dir=files, where="row 1", max_images=1) is chat
    row = Row(merge_images_field("Which is taller?", ["img/a.png", "img/b.png"]), answer="b", info={"k": 1})
    out = resolve_row_images(row, base_dir=files, where="row 3 of data/train.jsonl", max_images=4)
    images = row_images(out)
    assert [(w.width, w.height) for w in images] == [(7, 5), (3, 9)]
    assert all(isinstance(w, WireImage) for w in images)
    assert (
        out.answer == "b"
        and out.info == {"k": 1}
        and out.prompt[0]["content"][2] == {"type": "text", "text": "Which is taller?"}
    )
    assert row_images(row) == ["img/a.png", "img/b.png"]  # the input row is not modified
    assert pickle.loads(pickle.dumps(out)) == out
    many = Row(merge_images_field("q", ["img/a.png"] * 5))
    with pytest.raises(BadImageError, match=r"^row 3 has 5 images; --data.max-images-per-row is 4") as e:
        resolve_row_images(many, base_dir=files, where="row 3", max_images=4)
    assert e.value.reason == "too many images"
    bad = Row(merge_images_field("q", ["img/a.png", "img/nope.png"]))
    with pytest.raises(BadImageError, match=r"^row 3, image 2 of 2 'img/nope.png': no such file"):
        resolve_row_images(bad, base_dir=files, where="row 3", max_images=4)


# --- the data loader -----------------------------------------------------------------------------------------------


def _jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


IMAGE_ROWS = [
    {"prompt": "How many circles?", "images": ["img/a.png"], "answer": "3", "level": 1},
    {
        "messages": [
            {"role": "system", "content": "Count."},
            {
                "role": "user",
                "content": [{"type": "image", "image": "img/b.png"}, {"type": "text", "text": "How many?"}],
            },
        ],
        "answer": "2",
    },
    {"prompt": "No image here.", "answer": "0"},
    {"prompt": "Both.", "images": ["img/a.png", "img/b.png"], "answer": "5"},
]
IMAGES = DataConfig(images_field="images")


def _check_image_rows(rows):
    a, b, c, d = rows
    assert [(w.width, w.height) for w in row_images(a)] == [(7, 5)]
    assert a.prompt[0]["role"] == "user" and a.prompt[0]["content"][1] == {"type": "text", "text": "How many circles?"}
    assert dict(a.info) == {"level": 1} and a.answer == "3"  # the images field is not info
    assert [m["role"] for m in b.prompt] == ["system", "user"] and [(w.width, w.height) for w in row_images(b)] == [
        (3, 9)
    ]
    assert c == Row("No image here.", answer="0")  # a text row stays plain text
    assert [(w.width, w.height) for w in row_images(d)] == [(7, 5), (3, 9)]
    assert _pixels(from_wire(row_images(a)[0])) == _pixels(PIC)


def test_jsonl_with_images_through_the_data_loader(files, tmp_path, monkeypatch):
    path = _jsonl(files / "train.jsonl", IMAGE_ROWS)
    monkeypatch.chdir(tmp_path.parent)  # relative image paths are read from the data file's directory, not here
    out = load_prompt_rows(path, IMAGES)
    assert len(out) == 4 and not out.skipped
    _check_image_rows(out.rows)
    # Without --data.images-field the field is just info, and the message parts still load.
    plain = load_prompt_rows(path, DataConfig()).rows
    assert plain[0].prompt == "How many circles?" and plain[0].info["images"] == ["img/a.png"]
    assert len(row_images(plain[1])) == 1


def test_json_list_parquet_and_python_rows_with_images(files, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (files / "rows.json").write_text(json.dumps(IMAGE_ROWS))
    _check_image_rows(load_prompt_rows(str(files / "rows.json"), IMAGES).rows)
    # Parquet: an Image column as datasets writes it (structs of bytes and path); absent struct keys are null.
    table = pa.Table.from_pylist(
        [
            {"prompt": "How many circles?", "images": [{"bytes": PNG, "path": None}], "answer": "3"},
            {"prompt": "And here?", "images": [{"bytes": None, "path": "img/b.png"}], "answer": "1"},
            {"prompt": "None.", "images": None, "answer": "0"},
        ]
    )
    pq.write_table(table, files / "rows.parquet")
    a, b, c = load_prompt_rows(str(files / "rows.parquet"), IMAGES).rows
    assert row_images(a)[0].data == PNG and (row_images(b)[0].width, row_images(b)[0].height) == (3, 9)
    assert c == Row("None.", answer="0")
    # Python lists of dicts: relative paths from the working directory.
    monkeypatch.chdir(files)
    _check_image_rows(load_prompt_rows(IMAGE_ROWS, IMAGES).rows)
    row = as_row({"messages": IMAGE_ROWS[1]["messages"], "answer": "2"})
    assert [(w.width, w.height) for w in row_images(row)] == [(3, 9)]


def test_datasets_directory_with_an_image_feature(files):
    import datasets

    features = datasets.Features(
        {
            "prompt": datasets.Value("string"),
            "images": datasets.List(datasets.Image()),
            "answer": datasets.Value("string"),
        }
    )
    ds = datasets.Dataset.from_dict(
        {"prompt": ["How many?"], "images": [[{"bytes": PNG, "path": None}]], "answer": ["3"]}, features=features
    )
    ds.save_to_disk(str(files / "ds"))
    (row,) = load_prompt_rows(str(files / "ds"), IMAGES).rows  # datasets decodes: PIL images
    (wire,) = row_images(row)
    assert (wire.width, wire.height) == (7, 5) and _pixels(from_wire(wire)) == _pixels(PIC)


def test_a_bad_image_stops_the_load_naming_file_row_and_image(files):
    rows = [IMAGE_ROWS[0], {"prompt": "q", "images": ["img/a.png", "img/gone.png"], "answer": "1"}]
    path = _jsonl(files / "bad.jsonl", rows)
    with pytest.raises(BadImageError) as e:
        load_prompt_rows(path, IMAGES)
    msg = str(e.value)
    assert msg.startswith(f"row 2 of {path}, image 2 of 2 'img/gone.png': no such file {files / 'img' / 'gone.png'}")
    assert msg.endswith("(fix the row, or set --data.on-bad-image skip to skip rows with a bad image)")
    # --data.on-bad-row skip is about the rows' fields, not their images.
    with pytest.raises(BadImageError):
        load_prompt_rows(path, DataConfig(images_field="images", on_bad_row="skip"))
    many = _jsonl(files / "many.jsonl", [{"prompt": "q", "images": ["img/a.png"] * 3, "answer": "1"}])
    with pytest.raises(BadImageError, match=r"^row 1 of .*many.jsonl has 3 images; --data.max-images-per-row is 2"):
        load_prompt_rows(many, DataConfig(images_field="images", max_images_per_row=2))


def test_rows_with_bad_images_are_skipped_and_counted(files):
    (files / "img" / "junk.png").write_bytes(b"not a png")
    rows = [
        IMAGE_ROWS[0],
        {"prompt": "q", "images": ["img/gone.png"], "answer": "1"},
        {"prompt": "q", "images": ["img/junk.png"], "answer": "1"},
        {"prompt": "q", "images": ["img/a.png"] * 3, "answer": "1"},
        {"prompt": "q", "images": [7], "answer": "1"},
        {"prompt": "q", "images": ["img/gone.png"], "answer": "1"},
        {"prompt": "q", "images": "img/a.png", "answer": "1"},  # not a list: a bad row (--data.on-bad-row)
        IMAGE_ROWS[2],
    ]
    path = _jsonl(files / "mixed.jsonl", rows)
    cfg = DataConfig(images_field="images", max_images_per_row=2, on_bad_image="skip", on_bad_row="skip")
    out = load_prompt_rows(path, cfg)
    assert [r.answer for r in out.rows] == ["3", "0"]
    assert dict(out.skipped) == {
        "image file not found": 2,
        "undecodable image": 1,
        "too many images": 1,
        "unsupported image type": 1,
        "images field not a list": 1,
    }
    with pytest.raises(BadRowError, match="the images field is a str"):  # on_bad_row="error" still stops on it
        load_prompt_rows(path, DataConfig(images_field="images", on_bad_image="skip"))
    with pytest.raises(DataError, match="no usable rows"):
        load_prompt_rows(_jsonl(files / "all_bad.jsonl", rows[1:2]), cfg)


def test_bad_content_parts_are_bad_rows(files):
    def part_row(*parts):
        return {"messages": [{"role": "user", "content": list(parts)}], "answer": "1"}

    cases = [
        (part_row({"type": "video", "video": "v.mp4"}), "a content part is 'video'"),
        (part_row("just a string"), "a content part is 'str'"),
        (part_row({"type": "text", "text": 3}), "a text part has no str 'text'"),
        (part_row({"type": "image"}), "an image part has no 'image'"),
        (part_row({"type": "text", "text": "  "}), "is an empty prompt"),
        (
            {
                "messages": [
                    *part_row({"type": "text", "text": "q"})["messages"],
                    {"role": "assistant", "content": [{"type": "image", "image": "a"}]},
                ]
            },
            "ends with an assistant message holding an image",
        ),
    ]
    for raw, reason in cases:
        with pytest.raises(BadRowError, match=reason):
            load_prompt_rows([raw], DataConfig())
    # Columnar files fill absent keys of a part with null: dropped. A trailing assistant turn of text parts answers.
    raw = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": "img/a.png", "text": None},
                    {"type": "text", "text": "q", "image": None},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "fo"}, {"type": "text", "text": "ur"}]},
        ]
    }
    (row,) = load_prompt_rows(_jsonl(files / "parts.jsonl", [raw]), DataConfig()).rows
    assert row.answer == "four" and row.prompt[0]["content"][1] == {"type": "text", "text": "q"}
    assert isinstance(row.prompt[0]["content"][0]["image"], WireImage)


def test_text_rows_load_exactly_as_without_images(files):
    text_rows = [
        {"prompt": "What is 6 * 7?", "answer": "42", "images": None},
        {"prompt": "2 + 2?", "answer": "4", "images": []},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "4"}], "id": 7},
    ]
    path = _jsonl(files / "text.jsonl", text_rows)
    with_field = load_prompt_rows(path, IMAGES).rows
    assert with_field == [
        Row("What is 6 * 7?", answer="42"),
        Row("2 + 2?", answer="4"),
        Row([{"role": "user", "content": "hi"}], answer="4", info={"id": 7}),
    ]
    without = load_prompt_rows(path, DataConfig()).rows
    assert [r.prompt for r in without] == [r.prompt for r in with_field]
    assert without[1].info == {"images": []}  # without the option the field is the row's own


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(images_field="prompt"), "--data.images-field 'prompt' is also the prompt"),
        (dict(images_field="answer"), "--data.images-field 'answer' is also"),
        (dict(max_images_per_row=0), "--data.max-images-per-row 0 must be >= 1"),
        (dict(on_bad_image="ignore"), "--data.on-bad-image 'ignore'"),
    ],
)
def test_data_config_image_fields_are_checked(kw, message):
    with pytest.raises(ConfigError, match=message):
        DataConfig(**kw)
    assert DataConfig(images_field="").images_field is None
