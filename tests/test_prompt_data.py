"""RL prompt rows: every source form (JSONL, .json, Parquet, datasets directories, Python lists), plain and chat
prompts, field names, answers, extra fields into Row.info, bad rows (rejected naming file / row / field, or skipped
and counted), source errors, drop_long, and the epoch sampler's exact resume."""

import json

import pytest

from meshrl.data.prompts import DataConfig, PromptRows, drop_long, load_prompt_rows
from meshrl.data.rows import BadRowError, iter_rows
from meshrl.data.sampler import EpochSampler
from meshrl.errors import ConfigError, DataError
from meshrl.tasks.base import Row

CFG = DataConfig()
SKIP = DataConfig(on_bad_row="skip")

PLAIN = [{"prompt": "What is 6 * 7?", "answer": "42", "level": 3}, {"prompt": "2 + 2?", "answer": 4, "tags": ["a"]}]
# A Parquet / Arrow table has one type a column and the same columns in every row (null where a row lacks one).
COLUMNAR = [
    {"prompt": "What is 6 * 7?", "answer": "42", "level": 3, "tags": None},
    {"prompt": "2 + 2?", "answer": "4", "level": None, "tags": ["a"]},
]
NO_ANSWER = "missing field 'answer' (the reference answer; set --data.answer-field '' if the verifier needs none)"
CHAT = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "6 * 7?"}], "answer": "42"},
    {"messages": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}], "id": 7},
]


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _check_plain(out: PromptRows):
    assert [r.prompt for r in out.rows] == ["What is 6 * 7?", "2 + 2?"]
    assert [r.answer for r in out.rows] == ["42", "4"]  # the integer answer 4 -> "4"
    assert dict(out.rows[0].info) == {"level": 3} and dict(out.rows[1].info) == {"tags": ["a"]}
    assert not out.skipped and len(out) == 2


def test_jsonl_plain_prompts(tmp_path):
    out = load_prompt_rows(_jsonl(tmp_path / "p.jsonl", PLAIN), CFG)
    _check_plain(out)
    assert out.source.endswith("p.jsonl") and not out.rows[0].is_chat
    assert out.rows[0].verifier_view() == {"level": 3, "prompt": "What is 6 * 7?", "answer": "42"}


def test_jsonl_chat_messages_with_and_without_trailing_assistant(tmp_path):
    out = load_prompt_rows(_jsonl(tmp_path / "c.jsonl", CHAT), CFG)
    a, b = out.rows
    assert a.is_chat and [m["role"] for m in a.prompt] == ["system", "user"] and a.answer == "42"
    assert dict(a.info) == {}
    # The trailing assistant turn leaves the prompt and, with no answer field, becomes the answer.
    assert b.prompt == [{"role": "user", "content": "2 + 2?"}] and b.answer == "4" and dict(b.info) == {"id": 7}
    # An answer field wins over the trailing assistant turn (which still leaves the prompt).
    row = {"messages": CHAT[1]["messages"], "answer": "four"}
    (c,) = load_prompt_rows([row], CFG).rows
    assert c.answer == "four" and len(c.prompt) == 1


def test_prompt_field_may_hold_chat_messages():
    (r,) = load_prompt_rows([{"prompt": [{"role": "user", "content": "hi"}], "answer": "x"}], CFG).rows
    assert r.prompt == [{"role": "user", "content": "hi"}] and r.answer == "x"


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(COLUMNAR), tmp_path / "p.parquet", row_group_size=1)  # two row groups
    out = load_prompt_rows(str(tmp_path / "p.parquet"), CFG)
    assert [r.prompt for r in out.rows] == ["What is 6 * 7?", "2 + 2?"] and [r.answer for r in out.rows] == ["42", "4"]
    # Other columns travel in info untouched, nulls included (the verifier sees the row's columns).
    assert dict(out.rows[0].info) == {"level": 3, "tags": None} and dict(out.rows[1].info) == {
        "level": None,
        "tags": ["a"],
    }


def test_parquet_mixing_plain_and_chat_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"prompt": "q", "messages": None, "answer": "a", "id": 1},
        {"prompt": None, "messages": [{"role": "user", "content": "q2"}], "answer": "b", "id": 2},
        {"prompt": None, "messages": [{"role": "user", "content": "q3"}, {"role": "assistant", "content": "c"}],
         "answer": None, "id": 3},
    ]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "m.parquet")
    a, b, c = load_prompt_rows(str(tmp_path / "m.parquet"), CFG).rows
    assert (a.prompt, a.answer, dict(a.info)) == ("q", "a", {"id": 1})  # null fields count as absent, not info
    assert (b.prompt, b.answer, dict(b.info)) == ([{"role": "user", "content": "q2"}], "b", {"id": 2})
    assert (c.prompt, c.answer, dict(c.info)) == ([{"role": "user", "content": "q3"}], "c", {"id": 3})
    with pytest.raises(BadRowError, match="row 1: missing field 'prompt'"):
        load_prompt_rows([{"prompt": None, "answer": "a"}], CFG)


def test_parquet_chat_rows_drop_null_message_keys(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [  # from_pylist takes the columns from the first row
        {"messages": [{"role": "user", "content": "q", "name": "bob"}], "answer": "a"},
        {"messages": [{"role": "user", "content": "hi", "name": None}, {"role": "assistant", "content": "yo"}]},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    b, a = load_prompt_rows(tmp_path / "c.parquet", CFG).rows  # a Path works too
    assert a.prompt == [{"role": "user", "content": "hi"}] and a.answer == "yo"
    assert b.prompt == [{"role": "user", "content": "q", "name": "bob"}] and b.answer == "a"


def test_datasets_save_to_disk_directories(tmp_path):
    import datasets

    datasets.Dataset.from_list(COLUMNAR).save_to_disk(str(tmp_path / "ds"))
    out = load_prompt_rows(str(tmp_path / "ds"), CFG)
    assert [r.prompt for r in out.rows] == ["What is 6 * 7?", "2 + 2?"] and [r.answer for r in out.rows] == ["42", "4"]
    assert dict(out.rows[0].info) == {"level": 3, "tags": None} and dict(out.rows[1].info) == {
        "level": None,
        "tags": ["a"],
    }

    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(COLUMNAR), "test": datasets.Dataset.from_list(COLUMNAR[:1])}
    ).save_to_disk(str(tmp_path / "dd"))
    assert len(load_prompt_rows(f"{tmp_path / 'dd'}:train", CFG)) == 2
    assert len(load_prompt_rows(f"{tmp_path / 'dd'}:test", CFG)) == 1
    with pytest.raises(ValueError, match=r"several splits \['test', 'train'\]: name one, e\.g\. .*dd:test"):
        load_prompt_rows(str(tmp_path / "dd"), CFG)
    with pytest.raises(ValueError, match="no split 'dev'"):
        load_prompt_rows(f"{tmp_path / 'dd'}:dev", CFG)
    with pytest.raises(ValueError, match="single dataset, not splits"):
        load_prompt_rows(f"{tmp_path / 'ds'}:train", CFG)
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(ValueError, match="not one written by datasets' save_to_disk"):
        load_prompt_rows(str(tmp_path / "plain_dir"), CFG)


def test_python_list_and_json_list(tmp_path):
    _check_plain(load_prompt_rows(PLAIN, CFG))
    assert load_prompt_rows(PLAIN, CFG).source == "<in-memory list>"
    (tmp_path / "p.json").write_text(json.dumps(PLAIN, indent=2))
    _check_plain(load_prompt_rows(str(tmp_path / "p.json"), CFG))
    # A .json file of JSON lines reads as JSONL.
    _check_plain(load_prompt_rows(_jsonl(tmp_path / "l.json", PLAIN), CFG))
    (tmp_path / "broken.json").write_text('[{"prompt": "a"},\n {"prompt": ')
    with pytest.raises(ValueError, match=r"broken\.json: not valid JSON .* line 2"):
        load_prompt_rows(str(tmp_path / "broken.json"), CFG)


def test_custom_field_names_and_no_answer():
    cfg = DataConfig(prompt_field="question", messages_field="conversation", answer_field="solution")
    rows = [
        {"question": "q1", "solution": 3.5, "prompt": "kept in info"},
        {"conversation": [{"role": "user", "content": "q2"}], "solution": "s2"},
    ]
    a, b = load_prompt_rows(rows, cfg).rows
    assert (a.prompt, a.answer, dict(a.info)) == ("q1", "3.5", {"prompt": "kept in info"})
    assert b.prompt == [{"role": "user", "content": "q2"}] and b.answer == "s2"
    # No answer field: rows need none.
    (r,) = load_prompt_rows([{"prompt": "p", "tests": [1]}], DataConfig(answer_field="")).rows
    assert r.answer is None and dict(r.info) == {"tests": [1]}
    # With answer_field=None, an "answer" column is just another info field.
    (r,) = load_prompt_rows([{"prompt": "p", "answer": "x"}], DataConfig(answer_field=None)).rows
    assert r.answer is None and dict(r.info) == {"answer": "x"}


def test_answer_values():
    def answer(v):
        return load_prompt_rows([{"prompt": "p", "answer": v}], CFG).rows[0].answer

    assert answer(42) == "42" and answer(42.0) == "42.0" and answer(-1.5) == "-1.5" and answer(" x ") == " x "


MSG = "must be a non-empty list of {role, content} messages"
BAD = [
    ("{not json", "invalid JSON"),
    ({"question": "q", "answer": "a"}, "missing field 'prompt' (or 'messages' for a chat prompt)"),
    ({"prompt": 17, "answer": "a"}, "field 'prompt' is int, expected str or a list of messages"),
    ({"prompt": "   ", "answer": "a"}, "field 'prompt' is an empty prompt"),
    ({"prompt": "q"}, "missing field 'answer'"),
    ({"prompt": "q", "answer": ["a"]}, "field 'answer' is list, expected str, int or float"),
    ({"prompt": "q", "answer": {"x": 1}}, "field 'answer' is dict, expected str, int or float"),
    ({"prompt": "q", "answer": ""}, "field 'answer' is an empty answer"),
    ({"messages": [], "answer": "a"}, f"field 'messages' {MSG}; it is empty"),
    ({"messages": "hi", "answer": "a"}, f"field 'messages' {MSG}; it is str"),
    ({"messages": ["hi"], "answer": "a"}, f"field 'messages' {MSG}; a message is str"),
    ({"messages": [{"role": "user"}], "answer": "a"}, f"field 'messages' {MSG}; a message's 'content' is missing"),
    ({"messages": [{"role": 1, "content": "x"}], "answer": "a"}, f"field 'messages' {MSG}; a message's 'role' is int"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "field 'messages' holds only the assistant's message"),
    ({"messages": [{"role": "user", "content": " "}], "answer": "a"}, "field 'messages' is an empty prompt"),
    ({"messages": [{"role": "user", "content": "q"}]}, "missing field 'answer'"),
    (
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
        "field 'messages' ends with an empty assistant message",
    ),
    ([1, 2], "row is list, expected an object"),
]


@pytest.mark.parametrize("bad, reason", BAD, ids=[r for _, r in BAD])
def test_bad_rows_are_rejected_naming_file_row_and_field(tmp_path, bad, reason):
    path = _jsonl(tmp_path / "d.jsonl", [PLAIN[0], bad, PLAIN[1]])
    with pytest.raises(BadRowError) as e:
        load_prompt_rows(path, CFG)
    msg = str(e.value)
    assert msg.startswith(f"{path}, row 2: {reason}"), msg
    assert msg.endswith("(fix the row, or set --data.on-bad-row skip to skip such rows)")


def test_bad_rows_are_skipped_and_counted_by_reason(tmp_path):
    rows = [PLAIN[0]] + [b for b, _ in BAD] + [{"prompt": 5, "answer": "a"}, "", PLAIN[1]]  # "" is a blank line
    out = load_prompt_rows(_jsonl(tmp_path / "d.jsonl", rows), SKIP)
    assert [r.prompt for r in out.rows] == ["What is 6 * 7?", "2 + 2?"]
    assert sum(out.skipped.values()) == len(BAD) + 1
    assert out.skipped["field 'prompt' is int, expected str or a list of messages"] == 2
    assert out.skipped[NO_ANSWER] == 2
    for _, reason in BAD:
        assert any(k.startswith(reason) for k in out.skipped), reason


def test_no_usable_rows_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"<in-memory list> have no usable rows \(every row was bad; skipped: \{"):
        load_prompt_rows([{"prompt": "q"}], SKIP)
    with pytest.raises(ValueError, match=r"e\.jsonl have no usable rows \(it holds no rows\)"):
        load_prompt_rows(_jsonl(tmp_path / "e.jsonl", [""]), CFG)


def test_limit_stops_after_n_usable_rows(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "bad"}, *PLAIN, "{not json"])
    out = load_prompt_rows(path, DataConfig(on_bad_row="skip", max_eval_rows=1), limit=1)
    assert [r.prompt for r in out.rows] == ["What is 6 * 7?"]
    assert load_prompt_rows(path, SKIP, limit=1).skipped == {NO_ANSWER: 1}  # the rows after the limit are not read


def test_source_errors_name_the_path_and_the_supported_forms(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl does not exist; expected a \.jsonl file, .*parquet"):
        load_prompt_rows(str(tmp_path / "nope.jsonl"), CFG)
    (tmp_path / "d.csv").write_text("prompt,answer\nq,a\n")
    with pytest.raises(ValueError, match=r"d\.csv: unsupported file type '\.csv'; use a \.jsonl file"):
        load_prompt_rows(str(tmp_path / "d.csv"), CFG)
    with pytest.raises(TypeError, match="rows source is a dict"):
        load_prompt_rows({"prompt": "q"}, CFG)
    with pytest.raises(ValueError, match="no prompt rows source"):
        load_prompt_rows(None, CFG)


def test_iter_rows_numbers_jsonl_rows_by_line(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"a": 1}, "", {"a": 2}, "{x"])
    rows = list(iter_rows(path))
    assert [n for n, _ in rows] == [1, 3, 4] and rows[1][1] == {"a": 2} and isinstance(rows[2][1], BadRowError)


def test_data_config_validation_names_the_flag():
    with pytest.raises(ConfigError, match="--data.on-bad-row"):
        DataConfig(on_bad_row="ignore")
    with pytest.raises(ConfigError, match="--data.max-eval-rows"):
        DataConfig(max_eval_rows=0)
    with pytest.raises(ConfigError, match="--data.prompt-field"):
        DataConfig(prompt_field="")
    with pytest.raises(ConfigError, match="--data.messages-field and --data.prompt-field"):
        DataConfig(messages_field="prompt")
    with pytest.raises(ConfigError, match="--data.answer-field 'prompt'"):
        DataConfig(answer_field="prompt")
    assert DataConfig(answer_field="", train="", eval="").answer_field is None


def test_drop_long_drops_and_counts_never_truncates():
    rows = [Row(prompt=p) for p in ("a", "bb", "ccc", "d")]
    kept, dropped = drop_long(rows, [1, 2, 3, 1], max_len=2)
    assert [r.prompt for r in kept] == ["a", "bb", "d"] and dropped == 1
    assert drop_long(rows, [1, 1, 1, 1], 1) == (rows, 0)
    with pytest.raises(ValueError, match="4 rows but 3 lengths"):
        drop_long(rows, [1, 2, 3], 2)


def test_epoch_sampler_restored_mid_epoch_continues_exactly_across_the_epoch_boundary():
    straight = EpochSampler(7, seed=11)
    expected = [straight.next_indices(3) for _ in range(8)]  # 24 draws: over 3 epochs of 7
    for stop in range(1, 8):  # interrupt after each number of draws, mid-epoch or not
        first = EpochSampler(7, seed=11)
        head = [first.next_indices(3) for _ in range(stop)]
        resumed = EpochSampler.from_state(7, json.loads(json.dumps(first.state())))
        assert head + [resumed.next_indices(3) for _ in range(8 - stop)] == expected, stop
    # 6 of 7 drawn: mid-epoch; the next draw of 3 spans the boundary into epoch 1.
    s = EpochSampler(7, seed=11)
    s.next_indices(6)
    assert s.state() == {"epoch": 0, "offset": 6, "seed": 11}
    flat = sum(expected, [])
    assert all(sorted(flat[e * 7 : (e + 1) * 7]) == list(range(7)) for e in range(3))  # each epoch: all once
    assert flat[:7] != flat[7:14]  # a fresh shuffle each epoch
    from meshrl.data.sft import EpochSampler as FromSFT

    assert FromSFT is EpochSampler
