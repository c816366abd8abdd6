"""Every bad input gives a clear error — naming the file / row / value / flag and what to do — before any process
starts, where it can be known then (issue 18, item 5). One test per input; all but the two command-line ones run the
checks in-process (nothing is spawned). bench/bad_inputs.py runs the same inputs through the command line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from meshrl.config import (
    ConfigError,
    EvalConfig,
    EvalRunConfig,
    GeneratorConfig,
    GRPOConfig,
    GRPORunConfig,
    ModelConfig,
    SFTConfig,
    SFTDataConfig,
    SFTRunConfig,
    TrainerConfig,
)
from meshrl.configs import PRESETS, SFT_PRESETS
from meshrl.data.prompts import DataConfig, load_prompt_rows
from meshrl.data.rows import BadRowError
from meshrl.data.sft import load_sft_dataset
from meshrl.preflight import check_model_dir, check_run_inputs
from meshrl.tokenizer import CharTokenizer, unknown_characters

GOOD_SFT = [{"prompt": "abc=", "response": "cba"}, {"prompt": "de=", "response": "ed"}]
GOOD_PROMPTS = [{"prompt": "What is 6 * 7?", "answer": "42"}, {"prompt": "2 + 2?", "answer": "4"}]


@pytest.fixture(scope="module")
def char_tok():
    """The tokenizer of a new model for the reverse task, as its directory holds it (with an unknown token)."""
    return CharTokenizer("abcdefgh=").to_hf()


@pytest.fixture
def model_copy(base_model_dir, tmp_path):
    """A copy of the tiny checkpoint, to damage."""
    return shutil.copytree(base_model_dir, tmp_path / "model")


def _lines(path, *lines: bytes) -> str:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def _row(d: dict) -> bytes:
    return json.dumps(d, ensure_ascii=False).encode()


# ---- 1. config.json ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, wrong",
    [
        ('{"model_type": "qwen3", "vocab_size": 13,\n', r"is not valid JSON: Expecting property name .* at line 2"),
        ("", "is not valid JSON: Expecting value at line 1, column 1"),
        ("[1, 2]", "holds a JSON list, not an object"),
        ('{"vocab_size": 13}', "has no 'model_type': transformers cannot tell the architecture"),
        ('{"model_type": "qwen3"}', r"has no 'vocab_size' \(a positive integer"),
        ('{"model_type": "qwen3", "vocab_size": "13"}', "has vocab_size='13'"),
    ],
)
def test_corrupt_config_json_names_the_file_and_what_is_wrong(model_copy, text, wrong):
    path = model_copy / "config.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=wrong) as e:
        check_model_dir(model_copy, "torchtitan")
    assert str(e.value).startswith(str(path)), e.value
    assert "restore it from the original checkpoint" in str(e.value)


def test_corrupt_config_json_is_refused_by_every_program(model_copy):
    (model_copy / "config.json").write_bytes(b'{"model_type": "qwen3"\xff}')
    model = ModelConfig(path=str(model_copy))
    for cfg in (GRPORunConfig(model=model), SFTRunConfig(model=model), EvalRunConfig(model=model)):
        with pytest.raises(ConfigError, match=rf"{model_copy}/config.json \(the checkpoint's config\) is not UTF-8"):
            check_run_inputs(cfg)


# ---- 2. safetensors ----------------------------------------------------------------------------------------------


def test_truncated_safetensors_names_the_file_and_the_missing_bytes(model_copy):
    weights = model_copy / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ConfigError, match=rf"{weights} is truncated: .* \({size - 100} bytes in all, 100 missing\)"):
        check_model_dir(model_copy)


@pytest.mark.parametrize(
    "damage, wrong",
    [
        (lambda b: b[:5], r"is 5 bytes, too short for a safetensors file"),
        (lambda b: b[:8] + b"\xff\xfe" + b[10:], "the safetensors header is not JSON"),
        (lambda b: (2**40).to_bytes(8, "little") + b[8:], r"its first 8 bytes give a 1099511627776-byte header"),
        (lambda b: (2).to_bytes(8, "little") + b"[]" + b[10:], "the safetensors header is a JSON list"),
    ],
)
def test_damaged_safetensors_header_names_the_file(model_copy, damage, wrong):
    weights = model_copy / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(ConfigError, match=wrong) as e:
        check_model_dir(model_copy)
    assert str(e.value).startswith(str(weights)) and "copy or download it again" in str(e.value)


def test_missing_weights_and_shards_are_named(model_copy):
    index = model_copy / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ConfigError, match=r"names weight shards that are not in .*model-00002-of-00002\.safetensors"):
        check_model_dir(model_copy)
    index.unlink()
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"has a config.json but no weights \(\*\.safetensors or pytorch_model"):
        check_model_dir(model_copy)


def test_a_whole_checkpoint_passes(base_model_dir):
    check_model_dir(base_model_dir, "torchtitan")


# ---- 3. bytes that are not UTF-8 ---------------------------------------------------------------------------------


def test_non_utf8_byte_in_sft_data_names_file_and_row_and_can_be_skipped(tmp_path, char_tok):
    bad = b'{"prompt": "ab\xff=", "response": "ba"}'
    path = _lines(tmp_path / "d.jsonl", _row(GOOD_SFT[0]), bad, _row(GOOD_SFT[1]))
    with pytest.raises(BadRowError) as e:
        load_sft_dataset(path, char_tok, max_seq_len=64)
    assert str(e.value) == (
        f"{path}, row 2: not UTF-8 text: byte 0xff at byte 15 of the line (save the file as UTF-8) (fix the row, or "
        "set --data.on-bad-row skip to skip such rows)"
    )
    ds = load_sft_dataset(path, char_tok, max_seq_len=64, on_bad_row="skip")
    assert len(ds) == 2 and dict(ds.skipped) == {"not UTF-8 text": 1}


def test_non_utf8_byte_in_prompt_rows_names_file_and_row_and_can_be_skipped(tmp_path):
    from meshrl.tasks import build_data_task

    bad = b'{"prompt": "What is 2 \xe9 2?", "answer": "4"}'
    path = _lines(tmp_path / "p.jsonl", _row(GOOD_PROMPTS[0]), bad, _row(GOOD_PROMPTS[1]))
    with pytest.raises(BadRowError, match=rf"^{path}, row 2: not UTF-8 text: byte 0xe9 .*--data.on-bad-row skip"):
        load_prompt_rows(path, DataConfig())
    skip = DataConfig(on_bad_row="skip")
    assert len(load_prompt_rows(path, skip)) == 2
    task = build_data_task(skip, train_rows=path, eval_rows=GOOD_PROMPTS)
    assert task.skipped == {"train: not UTF-8 text": 1}  # reported with the run's other skipped rows


def test_utf8_byte_order_mark_and_json_lists(tmp_path, char_tok):
    bom = _lines(tmp_path / "bom.jsonl", b"\xef\xbb\xbf" + _row(GOOD_SFT[0]), _row(GOOD_SFT[1]))
    assert len(load_sft_dataset(bom, char_tok, max_seq_len=64)) == 2
    listed = tmp_path / "d.json"
    listed.write_bytes(b'[{"prompt": "ab\xff=", "response": "ba"}]')
    with pytest.raises(ValueError, match=rf"{listed}: not UTF-8 text \(byte 0xff at byte offset 15\)"):
        load_sft_dataset(str(listed), char_tok, max_seq_len=64)


# ---- 4. text outside the tokenizer's vocabulary ------------------------------------------------------------------


def test_characters_outside_the_vocabulary_are_a_bad_row(tmp_path, char_tok):
    unknown = {"prompt": "abé=", "response": "éb中"}
    path = _lines(tmp_path / "d.jsonl", _row(GOOD_SFT[0]), _row(GOOD_SFT[1]), _row(unknown))
    with pytest.raises(BadRowError) as e:
        load_sft_dataset(path, char_tok, max_seq_len=64)
    assert str(e.value).startswith(
        f"{path}, row 3: characters ['é', '中'] are not in the tokenizer's vocabulary (they would train as '<unk>'); "
        "remove or replace them"
    ), e.value
    ds = load_sft_dataset(path, char_tok, max_seq_len=64, on_bad_row="skip")
    assert len(ds) == 2 and dict(ds.skipped) == {"characters outside the tokenizer's vocabulary": 1}
    assert unknown_characters(char_tok, "éb中") == ["é", "中"]


def test_chat_rows_and_the_unknown_token_written_out(char_tok):
    tok = CharTokenizer("abcdefgh=").to_hf()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    rows = [{"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "bä"}]}]
    with pytest.raises(BadRowError, match=r"row 1: characters \['ä'\] are not in the tokenizer's vocabulary"):
        load_sft_dataset(rows, tok, max_seq_len=64)
    # The unknown token's own string in the text is what the row means: not an unknown character.
    assert unknown_characters(char_tok, "ab<unk>") == []
    assert len(load_sft_dataset([{"prompt": "a<unk>=", "response": "b"}], char_tok, max_seq_len=64)) == 1


def test_a_byte_level_tokenizer_has_nothing_unknown():
    from meshrl.tokenizer import default_corpus, train_bpe_tokenizer

    bpe = train_bpe_tokenizer(default_corpus(50), vocab_size=300)
    assert unknown_characters(bpe, "naïve 中文 ✓") == []


# ---- 5. lengths past the model's context -------------------------------------------------------------------------


def test_max_seq_len_over_the_model_context_is_refused_naming_both(base_model_dir):
    with pytest.raises(ConfigError) as e:
        check_run_inputs(SFTRunConfig(data=SFTDataConfig(max_seq_len=4096)))
    assert str(e.value) == (
        "--data.max-seq-len 4096 is longer than the model's context of 256 positions (max_position_embeddings=256 "
        "of the new --model.flavor tiny model); use --data.max-seq-len 256 or less"
    )
    own = SFTRunConfig(model=ModelConfig(path=base_model_dir), data=SFTDataConfig(max_seq_len=300))
    with pytest.raises(ConfigError, match=rf"max_position_embeddings=256 in {base_model_dir}/config.json\)"):
        check_run_inputs(own, generator=False)
    with pytest.raises(ConfigError, match="--data.pack-len 512 is longer than the model's context of 256"):
        check_run_inputs(SFTRunConfig(data=SFTDataConfig(pack=True, pack_len=512)))
    check_run_inputs(SFTRunConfig(data=SFTDataConfig(max_seq_len=256)))


def test_generator_max_model_len_over_the_model_context_is_refused():
    cfg = GRPORunConfig(generator=GeneratorConfig(max_model_len=512))
    with pytest.raises(ConfigError, match=r"--generator.max-model-len 512 is longer than the model's context of 256"):
        check_run_inputs(cfg)
    check_run_inputs(SFTRunConfig(generator=GeneratorConfig(max_model_len=512)), generator=False)  # none started


# ---- 6. process counts -------------------------------------------------------------------------------------------


def _grpo_with(n: int, **trainer) -> GRPORunConfig:
    return GRPORunConfig(
        trainer=TrainerConfig(num_procs=n, micro_batch_size=n, **trainer), grpo=GRPOConfig(prompts_per_step=n)
    )


def test_more_cpu_trainer_ranks_than_cores_are_refused():
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ConfigError) as e:
        check_run_inputs(_grpo_with(cores + 1))
    msg = str(e.value)
    assert msg.startswith(f"--trainer.num-procs {cores + 1} with --trainer.device cpu: this machine gives the run ")
    assert f"{cores} CPU core" in msg and msg.endswith(f"use --trainer.num-procs {cores} or fewer")
    check_run_inputs(_grpo_with(cores))
    check_run_inputs(PRESETS["tiny-reverse"]())  # what the test suite and the main job run: 2 ranks


def test_reference_ranks_count_too():
    cores = len(os.sched_getaffinity(0))
    cfg = GRPORunConfig(grpo=GRPOConfig(kl_coef=0.1, reference_procs=cores + 1))
    with pytest.raises(ConfigError, match=rf"--grpo.reference-procs {cores + 1} with --trainer.device cpu"):
        check_run_inputs(cfg)


def test_more_cuda_ranks_than_visible_gpus_are_refused(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ConfigError) as e:
        check_run_inputs(_grpo_with(2, device="cuda"))
    assert str(e.value) == (
        "--trainer.num-procs 2 with --trainer.device cuda puts one rank on each GPU, but this process sees 1 GPU "
        "(CUDA_VISIBLE_DEVICES='0'); use --trainer.num-procs 1 or fewer, or place the ranks with --trainer.devices"
    )
    check_run_inputs(_grpo_with(2, device="cuda", devices=[0, 0]))  # placed by hand: two ranks share GPU 0
    with pytest.raises(ConfigError, match=r"--trainer.devices \[0, 1\] names GPU 1, but this process sees 1 GPU"):
        check_run_inputs(_grpo_with(2, device="cuda", devices=[0, 1]))
    with pytest.raises(ConfigError, match=r"--generator.devices \[3\] names GPU 3"):
        check_run_inputs(GRPORunConfig(generator=GeneratorConfig(devices=[3])))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError, match=r"--trainer.num-procs 1 .* sees 0 GPUs \(CUDA_VISIBLE_DEVICES=''\)"):
        check_run_inputs(_grpo_with(1, device="cuda"))


# ---- 7. flags that act only with another -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, flag",
    [
        (dict(kl_estimator="k1"), "--grpo.kl-estimator k1"),
        (dict(kl_mode="reward"), "--grpo.kl-mode reward"),
        (dict(reference_procs=2), "--grpo.reference-procs 2"),
    ],
)
def test_kl_flags_without_kl_coef_are_refused(kw, flag):
    with pytest.raises(ConfigError) as e:
        GRPOConfig(**kw)
    assert str(e.value) == (
        f"{flag} has no effect: grpo.kl_coef is 0 (no KL term, no reference model); set --grpo.kl-coef (e.g. 0.01) "
        f"as well, or drop {flag.split()[0]}"
    )
    GRPOConfig(kl_coef=0.01, **kw)


def test_other_flags_without_their_switch_are_refused():
    with pytest.raises(ConfigError, match="--grpo.max-sampling-rounds 8 has no effect: grpo.dynamic_sampling is off"):
        GRPOConfig(max_sampling_rounds=8)
    with pytest.raises(ConfigError, match="--grpo.overlong-penalty 0.5 has no effect: grpo.overlong_buffer is 0"):
        GRPOConfig(overlong_penalty=0.5)
    with pytest.raises(ConfigError, match="--data.pack-len 64 has no effect without --data.pack"):
        SFTDataConfig(pack_len=64)
    GRPOConfig(dynamic_sampling=True, max_sampling_rounds=8)
    for make in (*PRESETS.values(), *SFT_PRESETS.values()):
        make()  # every preset still loads


# ---- 8. values out of range name their own flag ------------------------------------------------------------------


def test_max_tokens_zero_names_its_flag_and_range(capsys):
    from meshrl.controller.cli import parse_run_config

    with pytest.raises(SystemExit):
        parse_run_config(GRPORunConfig, argv=["--preset", "tiny-reverse", "--generator.max-tokens", "0"])
    err = " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert "generator.max_tokens=0: the longest completion must be at least 1 token" in err, err
    assert "--generator.max-tokens in [1, 31]" in err and "overlong_buffer" not in err


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: GRPORunConfig(grpo=GRPOConfig(overlong_buffer=16)), r"overlong_buffer=16 must be < .*max_tokens=16"),
        (lambda: GRPORunConfig(eval=EvalConfig(max_tokens=64)), r"eval.max_tokens=64 .*generator.max_model_len=64; "
         r"use --eval.max-tokens in \[1, 63\]"),
        (lambda: GeneratorConfig(top_p=0.0), r"generator.top_p=0.0 must be in \(0, 1\]"),
        (lambda: GeneratorConfig(top_k=0), "generator.top_k=0 must be -1 .off. or a count of tokens >= 1"),
        (lambda: SFTConfig(batch_size=0), "sft.batch_size=0 must be >= 1"),
        (lambda: SFTDataConfig(max_seq_len=1), "--data.max-seq-len 1 must be >= 2"),
        (lambda: SFTDataConfig(pack=True, pack_len=8, max_seq_len=16), "--data.pack-len 8 is shorter than"),
    ],
)  # fmt: skip
def test_sibling_values_name_their_flag(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


# ---- chat roles (issue 31, item 14) -------------------------------------------------------------------------------

USR = {"messages": [{"role": "usr", "content": "What is 2 + 2?"}], "answer": "4"}
IPYTHON = {"messages": [{"role": "user", "content": "2 + 2?"}, {"role": "ipython", "content": "4"}], "answer": "4"}
# A template that knows one role past the standard four (as Llama 3's knows 'ipython'), in the ways templates test it.
IPYTHON_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'ipython' %}<|im_start|>tool\n"
    "{% elif message.role in ['user', 'system'] %}<|im_start|>{{ message.role }}\n{% endif %}"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _grpo_task(*argv: str):
    from controller.cli import parse_run_config
    from meshrl.tasks import build_task

    return build_task(parse_run_config(GRPORunConfig, argv=list(argv)))


def test_an_unknown_chat_role_in_prompt_rows_names_file_row_and_role(tmp_path):
    path = _lines(tmp_path / "p.jsonl", _row(GOOD_PROMPTS[0]), _row(USR))
    with pytest.raises(BadRowError) as e:
        _grpo_task("--data.train", path, "--data.eval", path)
    message = str(e.value)
    assert message.startswith(f"{path}, row 2: a message's role 'usr' is not a chat role the model's template knows")
    assert "assistant, system, tool, user" in message and "did you mean 'user'?" in message, message
    assert "--data.on-bad-row skip" in message, message
    task = _grpo_task("--data.train", path, "--data.eval", path, "--data.on-bad-row", "skip")
    assert len(task.train) == 1 and task.skipped == {
        "train: unknown chat role 'usr'": 1,
        "eval: unknown chat role 'usr'": 1,
    }


def test_roles_the_model_template_names_are_accepted(tmp_path):
    from meshrl.data.roles import template_roles
    from meshrl.models.tiny_hf import create_tiny_chat_model

    assert template_roles(IPYTHON_TEMPLATE) == {"ipython", "user", "system"}
    model = str(create_tiny_chat_model(tmp_path / "m", arch="qwen3", vocab_size=300, chat_template=IPYTHON_TEMPLATE))
    path = _lines(tmp_path / "p.jsonl", _row(GOOD_PROMPTS[0]), _row(IPYTHON))
    task = _grpo_task("--model.path", model, "--data.train", path, "--data.eval", path)
    assert task.train[1].prompt[1]["role"] == "ipython"
    with pytest.raises(BadRowError, match="role 'ipython' is not a chat role"):  # no template names it
        _grpo_task("--data.train", path, "--data.eval", path)


def test_an_unknown_chat_role_in_sft_rows_names_file_row_and_role(tmp_path):
    tok = CharTokenizer("abcdefgh=").to_hf()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"  # the characters it knows
    bad = {"messages": [{"role": "usr", "content": "ab"}, {"role": "assistant", "content": "ba"}]}
    good = {"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}]}
    path = _lines(tmp_path / "d.jsonl", _row(good), _row(bad))
    with pytest.raises(BadRowError) as e:
        load_sft_dataset(path, tok, max_seq_len=64)
    assert str(e.value).startswith(f"{path}, row 2: a message's role 'usr' is not a chat role"), e.value
    ds = load_sft_dataset(path, tok, max_seq_len=64, on_bad_row="skip")
    assert len(ds) == 1 and dict(ds.skipped) == {"unknown chat role 'usr'": 1}


# ---- the model's tokenizer (issue 31, item 14) ---------------------------------------------------------------------


def test_a_model_directory_without_tokenizer_files_is_refused_at_launch_naming_it(model_copy):
    from controller.cli import parse_run_config

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_copy / name).unlink()
    for cls in (GRPORunConfig, SFTRunConfig, EvalRunConfig):
        with pytest.raises(ConfigError) as e:
            check_run_inputs(parse_run_config(cls, argv=["--model.path", str(model_copy)]))
        assert str(e.value).startswith(f"--model.path {model_copy}: no tokenizer files there"), e.value
        assert "tokenizer.json" in str(e.value) and "save_pretrained" in str(e.value), e.value


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny Qwen3 with its own 300-token BPE tokenizer (eos 3, bos 1, pad 0; generation_config eos [3, 1])."""
    from meshrl.models.tiny_hf import create_tiny_chat_model

    return create_tiny_chat_model(tmp_path_factory.mktemp("chat") / "qwen3", arch="qwen3", vocab_size=300)


def _launch(*argv: str) -> None:
    from controller.cli import parse_run_config

    check_run_inputs(parse_run_config(GRPORunConfig, argv=[*argv, "--model.backend", "hf"]))


def test_a_tokenizer_of_another_model_is_refused_at_launch(chat_model, tmp_path, char_tok):
    other = shutil.copytree(chat_model, tmp_path / "other")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (other / name).unlink(missing_ok=True)
    char_tok.save_pretrained(str(other))  # 13 ids, bos 2 (the model's bos is 1), eos 1 (one of the model's eos ids)
    with pytest.raises(ConfigError) as e:
        _launch("--model.path", str(other))
    message = str(e.value)
    assert message.startswith(f"the tokenizer in {other} and the model's config belong to different models"), message
    assert "the tokenizer has 13 tokens, the model's vocabulary 300 (config.json vocab_size)" in message, message
    assert "bos token '<bos>' is id 2, config.json / generation_config.json say bos_token_id 1" in message, message
    assert "eos" not in message.split("vocab_size)")[1], message  # its eos id is one the model stops at
    _launch("--model.path", str(chat_model))  # the model's own tokenizer: fine


def test_special_token_ids_unlike_the_config_are_refused(chat_model, tmp_path):
    other = shutil.copytree(chat_model, tmp_path / "other")
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((other / name).read_text())
        cfg["eos_token_id"], cfg["pad_token_id"] = 7, 9
        (other / name).write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        _launch("--model.path", str(other))
    message = str(e.value)
    assert "eos token '<|im_end|>' is id 3, config.json / generation_config.json say eos_token_id 7" in message
    assert "pad token '<|pad|>' is id 0, config.json / generation_config.json say pad_token_id 9" in message
    assert "Put the model's own tokenizer files next to its weights" in message, message


def test_characters_outside_the_vocabulary_in_grpo_prompts_are_a_bad_row(base_model_dir, tmp_path):
    from controller.cli import parse_run_config
    from meshrl.tasks import build_task
    from meshrl.tasks.setup import TaskSetup

    path = _lines(
        tmp_path / "p.jsonl", _row({"prompt": "abc=", "answer": "cba"}), _row({"prompt": "abé=", "answer": "x"})
    )
    argv = ["--model.path", base_model_dir, "--data.train", path, "--data.eval", path, "--reward", "exact"]
    cfg = parse_run_config(GRPORunConfig, argv=argv)
    with pytest.raises(BadRowError) as e:
        TaskSetup.prepare(cfg, build_task(cfg), base_model_dir)
    assert str(e.value).startswith(
        "train prompt 2 ('abé='): characters ['é'] are not in the tokenizer's vocabulary (they would be read as "
        "'<unk>')"
    ), e.value
    assert "--data.on-bad-row skip" in str(e.value)
    cfg = parse_run_config(GRPORunConfig, argv=[*argv, "--data.on-bad-row", "skip"])
    setup = TaskSetup.prepare(cfg, build_task(cfg), base_model_dir)
    assert len(setup.train) == 1 and setup.train.skipped == 1
    assert "1 skipped (characters outside the tokenizer's vocabulary)" in setup.train.describe("train")


def test_a_huge_sft_row_is_refused_by_its_characters_before_tokenising(tmp_path, char_tok, monkeypatch):
    """Issue 31, item 17: a row far past --data.max-seq-len is a bad row known from its characters, untokenised."""
    calls = []
    real = type(char_tok).__call__
    monkeypatch.setattr(
        type(char_tok), "__call__", lambda tok, text, **kw: calls.append(len(text)) or real(tok, text, **kw)
    )
    huge = {"prompt": "abc=" * 500_000, "response": "cba"}
    path = _lines(tmp_path / "d.jsonl", _row(GOOD_SFT[0]), _row(huge))
    with pytest.raises(BadRowError, match=r"row 2: 2000003 characters, more than 64 tokens can hold \(at most 5 "):
        load_sft_dataset(path, char_tok, max_seq_len=64)
    ds = load_sft_dataset(path, char_tok, max_seq_len=64, on_bad_row="skip")
    assert len(ds) == 1 and dict(ds.skipped) == {"over the limit of 64 tokens": 1}
    assert max(calls) < 10_000, max(calls)


# ---- through the command line ------------------------------------------------------------------------------------


def _cli(program: str, *args: str, cwd) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", f"meshrl.controller.{program}", *args, "--run.output-dir", str(cwd / "runs")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=cwd)


def test_cli_refuses_a_truncated_checkpoint_before_any_process(model_copy, tmp_path):
    weights = model_copy / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    proc = _cli("grpo", "--preset", "tiny-reverse", "--model.path", str(model_copy), cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"config error: {weights} is truncated"), proc.stderr
    assert "Traceback" not in proc.stderr and "[meshrl] starting" not in proc.stdout


def test_cli_names_file_and_row_of_a_non_utf8_sft_row(base_model_dir, tmp_path):
    path = _lines(tmp_path / "d.jsonl", _row(GOOD_SFT[0]), b'{"prompt": "a\xc3=", "response": "a"}')
    args = ["--model.path", base_model_dir, "--data.train", path, "--data.eval", "None"]
    proc = _cli("sft", *args, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"data error: {path}, row 2: not UTF-8 text: byte 0xc3"), proc.stderr
    assert "trainer processes" not in proc.stdout


def test_a_warm_up_batch_the_rows_cannot_fill_is_refused_before_any_process_starts(tmp_path):
    """It was refused after the trainer, generator and reward processes had started (~25 s wasted). The test runs
    in the unit lane, whose guard fails it if a process starts."""
    from meshrl.controller import grpo
    from meshrl.controller.cli import parse_run_config

    argv = ["--preset", "tiny-reverse", "--warmup.steps", "2", "--warmup.batch-size", "64", "--reverse.num-train",
            "16", "--run.output-dir", str(tmp_path)]  # fmt: skip
    with pytest.raises(ConfigError, match=r"warmup.batch_size=64, but only 16 training rows .*--warmup.batch-size"):
        grpo.main(parse_run_config(GRPORunConfig, argv=argv))
