"""SFT data: file formats, chat messages, bad rows (reject with file/row/reason, or skip and count), and the
deterministic epoch sampler whose cursor makes resume exact."""

import json

import pytest

from meshrl.checkpoint import CheckpointManager, resolve_resume
from meshrl.data.sft import BadRowError, EpochSampler, load_sft_dataset
from meshrl.errors import DataError


@pytest.fixture(scope="module")
def hf_tok(base_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_model_dir)
    # A chat template within the character vocabulary: each turn's content followed by '='.
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    return tok


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


GOOD = [{"prompt": "abc=", "response": "cba"}, {"prompt": "de=", "response": "ed"}]


def test_prompt_response_rows_are_tokenised_with_eos(tmp_path, hf_tok):
    ds = load_sft_dataset(_write_jsonl(tmp_path / "d.jsonl", GOOD), hf_tok, max_seq_len=64)
    assert len(ds) == 2
    ex = ds.examples[0]
    assert hf_tok.decode(ex.prompt_ids).replace(" ", "") == "abc="
    assert ex.response_ids[-1] == hf_tok.eos_token_id and len(ex.response_ids) == 4


def test_parquet_and_in_memory_lists(tmp_path, hf_tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(GOOD), tmp_path / "d.parquet")
    a = load_sft_dataset(str(tmp_path / "d.parquet"), hf_tok, max_seq_len=64)
    b = load_sft_dataset(GOOD, hf_tok, max_seq_len=64)
    assert a.examples == b.examples


def test_json_lists_and_datasets_directories(tmp_path, hf_tok):
    import datasets

    (tmp_path / "d.json").write_text(json.dumps(GOOD, indent=1))
    datasets.Dataset.from_list(GOOD).save_to_disk(str(tmp_path / "ds"))
    expected = load_sft_dataset(GOOD, hf_tok, max_seq_len=64).examples
    assert load_sft_dataset(tmp_path / "d.json", hf_tok, max_seq_len=64).examples == expected
    assert load_sft_dataset(str(tmp_path / "ds"), hf_tok, max_seq_len=64).examples == expected
    with pytest.raises(DataError, match="missing.jsonl does not exist"):
        load_sft_dataset(str(tmp_path / "missing.jsonl"), hf_tok, max_seq_len=64)


def test_chat_messages_train_on_the_last_assistant_turn(hf_tok):
    rows = [{"messages": [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "cba"}]}]
    (ex,) = load_sft_dataset(rows, hf_tok, max_seq_len=64).examples
    assert hf_tok.decode(ex.prompt_ids).replace(" ", "") == "abc="
    assert hf_tok.decode(ex.response_ids[:-1]).replace(" ", "") == "cba="


BAD = [
    ({"prompt": "ab="}, "row 2: missing field 'response'"),
    ({"prompt": "ab=", "response": 7}, "row 2: field 'response' is int, expected str"),
    ({"prompt": "ab=", "response": "  "}, "row 2: empty response"),
    ({"prompt": "ab=", "response": "a" * 80}, "row 2: 84 tokens after tokenisation, over the limit of 64"),
    ("{not json", "row 2: invalid JSON"),
    ({"messages": [{"role": "user", "content": "ab"}]}, "row 2: the last message must be the assistant's"),
]


@pytest.mark.parametrize("bad, message", BAD)
def test_bad_rows_are_rejected_with_file_row_and_reason(tmp_path, hf_tok, bad, message):
    path = _write_jsonl(tmp_path / "d.jsonl", [GOOD[0], bad, GOOD[1]])
    with pytest.raises(BadRowError, match=f"d.jsonl, {message}"):
        load_sft_dataset(path, hf_tok, max_seq_len=64)


def test_bad_rows_can_be_skipped_and_counted(tmp_path, hf_tok):
    path = _write_jsonl(tmp_path / "d.jsonl", [GOOD[0]] + [b for b, _ in BAD] + [GOOD[1]])
    ds = load_sft_dataset(path, hf_tok, max_seq_len=64, on_bad_row="skip")
    assert len(ds) == 2 and sum(ds.skipped.values()) == len(BAD)
    with pytest.raises(ValueError, match="no usable rows"):
        load_sft_dataset([{"prompt": "a"}], hf_tok, max_seq_len=64, on_bad_row="skip")


def test_epoch_sampler_resumes_exactly():
    full = EpochSampler(10, seed=3)
    straight = [full.next_indices(4) for _ in range(6)]  # 2.4 epochs
    half = EpochSampler(10, seed=3)
    first = [half.next_indices(4) for _ in range(3)]
    resumed = EpochSampler.from_state(10, json.loads(json.dumps(half.state())))
    assert first + [resumed.next_indices(4) for _ in range(3)] == straight
    flat = sum(straight, [])
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))  # each epoch: all once


def test_checkpoint_commit_is_atomic_and_pruned(tmp_path):
    ckpts = CheckpointManager(tmp_path, keep_last_n=2)
    for step in (1, 2, 3):
        tmp = ckpts.begin(step)
        (tmp / "trainer").mkdir()
        ckpts.commit(tmp, step, {"step": step})
    assert [p.name for p in ckpts.complete()] == ["step_00000002", "step_00000003"]
    crashed = ckpts.begin(4)  # a save that never finished
    (crashed / "trainer").mkdir()
    assert ckpts.latest().name == "step_00000003"
    assert resolve_resume(str(tmp_path), tmp_path).name == "step_00000003"
    ckpts.begin(5)  # the next save clears the leftover
    assert not crashed.exists()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resolve_resume("latest", tmp_path / "elsewhere")
