"""torchtitan Qwen3 <-> HF checkpoints: what we save loads in transformers with the same logits, and a
failed save never leaves a half-written checkpoint behind."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.models import qwen3


def _titan_model(model_dir):
    hf_cfg = qwen3.read_hf_config(model_dir)
    tcfg = qwen3.titan_config_from_hf(hf_cfg)
    model = qwen3.build_model_on_meta(tcfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    model.load_state_dict(qwen3.hf_to_titan(qwen3.load_hf_state_dict(model_dir), tcfg))
    return model.eval(), tcfg


def test_random_checkpoint_loads_in_transformers_with_same_logits(base_model_dir, tokenizer):
    model, _ = _titan_model(base_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32).eval()
    x = torch.randint(0, tokenizer.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=1e-5, atol=1e-5)
    tok = AutoTokenizer.from_pretrained(base_model_dir)
    assert tok("ab=")["input_ids"] == tokenizer.encode("ab=")
    assert tok.eos_token_id == tokenizer.eos_id


def test_hf_roundtrip_is_exact(base_model_dir, tmp_path):
    model, tcfg = _titan_model(base_model_dir)
    out = qwen3.save_hf_checkpoint(
        tmp_path / "ckpt",
        qwen3.titan_to_hf(model.state_dict(), tcfg),
        qwen3.read_hf_config(base_model_dir),
        tokenizer_dir=base_model_dir,
    )
    a, b = qwen3.load_hf_state_dict(base_model_dir), qwen3.load_hf_state_dict(out)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert (out / "tokenizer.json").exists()


def test_failed_save_leaves_previous_checkpoint_intact(base_model_dir, tmp_path, monkeypatch):
    target = tmp_path / "ckpt"
    sd = qwen3.load_hf_state_dict(base_model_dir)
    cfg = qwen3.read_hf_config(base_model_dir)
    qwen3.save_hf_checkpoint(target, sd, cfg)
    before = sorted(p.name for p in target.iterdir())

    # A named fake: the disk failing half-way through writing the tensors cannot be produced for real here.
    import safetensors.torch

    def failing_save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", failing_save_file)
    with pytest.raises(OSError, match="No space left"):
        qwen3.save_hf_checkpoint(target, {k: v * 2 for k, v in sd.items()}, cfg)
    assert sorted(p.name for p in target.iterdir()) == before
    assert torch.equal(qwen3.load_hf_state_dict(target)["model.norm.weight"], sd["model.norm.weight"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.tmp")], "temp dir left behind"


def test_titan_flavors_map_to_hf_configs():
    cfg = qwen3.hf_config_dict("0.6B", vocab_size=151936)
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (1024, 28, 16)
    assert cfg["tie_word_embeddings"] is True
    with pytest.raises(ValueError, match="unknown Qwen3 flavor"):
        qwen3.hf_config_dict("7T", vocab_size=10)


def test_not_a_checkpoint_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="must be an HF-format checkpoint directory"):
        qwen3.read_hf_config(tmp_path)


def test_export_carries_tokenizer_chat_template_stop_ids_and_readable_modes(base_model_dir, tmp_path):
    """save_hf_checkpoint(tokenizer_dir=source) copies every tokenizer file (the chat template included), keeps the
    source's generation_config eos list, and leaves a 0755 directory of 0644 files (mkdtemp alone gives 0700)."""
    import json
    import os
    import shutil
    import stat

    from meshrl.models.hf_config import stop_token_ids

    source = tmp_path / "source"
    shutil.copytree(base_model_dir, source)
    (source / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    (source / "merges.txt").write_text("#version: 0.2\n")
    umask = os.umask(0o022)
    try:
        out = qwen3.save_hf_checkpoint(
            tmp_path / "export",
            qwen3.load_hf_state_dict(source),
            qwen3.read_hf_config(source),
            tokenizer_dir=source,
        )
    finally:
        os.umask(umask)
    names = {p.name for p in out.iterdir()}
    assert {"chat_template.jinja", "merges.txt", "tokenizer.json", "tokenizer_config.json"} <= names
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [1, 2]
    assert stop_token_ids(out) == [1, 2]
    assert AutoTokenizer.from_pretrained(out).chat_template == "{{ messages[0]['content'] }}"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o644}


def test_a_new_model_is_made_without_torchtitan(monkeypatch, tmp_path):
    """Where torchtitan does not import (the GPU machine's torch 2.11), a new Qwen3 of a flavor made in code still
    starts a run: transformers' initialisation, the same HF checkpoint layout (tied head, tokenizer files)."""
    import sys

    from transformers import AutoModelForCausalLM

    from meshrl.models.qwen3 import create_random_checkpoint
    from meshrl.tokenizer import train_bpe_tokenizer

    monkeypatch.setitem(sys.modules, "torchtitan.models.qwen3", None)  # `import` of it raises ImportError
    tok = train_bpe_tokenizer(["What is 12 + 34? \\boxed{46}"] * 50, 300)
    path = create_random_checkpoint(tmp_path / "m", flavor="tiny", tokenizer=tok, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.vocab_size == len(tok) and (path / "tokenizer.json").exists()


@pytest.mark.parametrize(
    "ids",
    [
        dict(eos_token_id=1, pad_token_id=0, bos_token_id=2),
        dict(eos_token_id=[151645, 151643], pad_token_id=151643),  # Qwen's two stop ids
        dict(eos_token_id=3),
        {},
        dict(eos_token_id=1, pad_token_id=-1),  # refused by transformers' check: it still goes through it
    ],
)
def test_generation_config_is_written_as_transformers_writes_it(ids, tmp_path):
    from transformers import GenerationConfig

    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir(), theirs.mkdir()
    try:
        GenerationConfig(**ids).save_pretrained(theirs)
    except ValueError as e:
        with pytest.raises(ValueError, match="pad_token_id"):
            qwen3.write_generation_config(ours, ids)
        assert "pad_token_id" in str(e)
        return
    qwen3.write_generation_config(ours, ids)
    assert (ours / "generation_config.json").read_bytes() == (theirs / "generation_config.json").read_bytes()
