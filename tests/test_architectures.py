"""meshrl on real transformers architectures — Qwen3, Qwen2, Llama, GPT-2 — made here (no downloads): a byte-level BPE
tokenizer with a ChatML chat template trained in code, a tiny random checkpoint built by transformers itself. For
each architecture, against transformers' own forward / `generate` (float32, the model in eval mode):
- the transformers engine (meshrl's own) and the vLLM engine: greedy tokens, their logprobs, prompt logprobs;
- the `hf` trainer backend, on a config with dropout > 0: logprobs in `forward` and `forward_backward`;
- trainer vs generator logprobs on the same sequences, before and after a training step pushed to both engines;
- the HF export: reloads with the trainer's logprobs, ships the tokenizer and chat template, modes 0755 / 0644.

Everything runs in this process (no Monarch mesh): one engine of each kind per architecture, a one-rank gloo group
for the trainer. Tests are grouped per architecture (module-scoped, parametrized fixtures), so each checkpoint and
engine is built once.
"""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

transformers = pytest.importorskip("transformers")

from meshrl.errors import ConfigError  # noqa: E402
from meshrl.models.hf_config import (  # noqa: E402
    check_backend_supports,
    max_positions,
    model_type,
    read_config,
    stop_token_ids,
)
from meshrl.models.tiny_hf import ARCHS, create_tiny_checkpoint  # noqa: E402
from meshrl.tokenizer import CHATML_TEMPLATE, default_corpus, train_bpe_tokenizer  # noqa: E402
from meshrl.types import Datum, LossSpec, OptimParams, SamplingParams  # noqa: E402

torch.set_num_threads(1)

VOCAB = 320
MAX_LEN = 128
ATOL = 1e-4  # logprob agreement between implementations (float32)
# The same float32 model computed another way (transformers' eval forward, a LoRA model against its merged
# weights, an exported copy): equal up to rounding, which grows with the logprob's magnitude (up to ~12 here: a
# difference of two terms that large), so the bound is relative, with a floor for values near 0. Measured on the
# CPU machine: at most 1.14e-5 absolute, 2.3e-6 relative (the LoRA merge; an absolute 1e-5 alone failed there).
SAME = dict(rtol=1e-5, atol=1e-5)
DROPOUT = 0.1  # configured in every checkpoint: eval mode must switch it off everywhere
# Larger than transformers' 0.02, so the random model's greedy choices have clear margins over float32 noise.
INIT_RANGE = 0.2
MESSAGES = [
    [{"role": "user", "content": "What is 12 + 7?"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Reverse the word cat."},
    ],
]


# ---- fixtures -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(default_corpus(500), VOCAB)


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def ckpt(arch, tokenizer, tmp_path_factory):
    """(model dir, the transformers model in eval mode, prompts as token ids)."""
    # Llama untied; Qwen3 tied (its default is untied); GPT-2 tied by its own default; Qwen2 default (untied).
    tie = {"qwen3": True}.get(arch)
    path = create_tiny_checkpoint(
        tmp_path_factory.mktemp(arch) / "model",
        arch=arch,
        tokenizer=tokenizer,
        seed=1,
        max_position_embeddings=MAX_LEN,
        dropout=DROPOUT,
        initializer_range=INIT_RANGE,
        tie_word_embeddings=tie,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True)["input_ids"] for m in MESSAGES]
    prompts.append(
        tokenizer.apply_chat_template(MESSAGES[0], add_generation_prompt=True, enable_thinking=False)["input_ids"]
    )
    prompts.append(tokenizer("12+345=")["input_ids"])
    return str(path), model, prompts


@pytest.fixture(scope="module")
def transformers_engine(ckpt):
    from meshrl.generation.transformers_engine import TransformersEngine

    engine = TransformersEngine(ckpt[0], max_model_len=MAX_LEN, max_num_seqs=4)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def vllm_engine(ckpt, one_rank_group):
    pytest.importorskip("vllm")
    from meshrl.generation.vllm_engine import VLLMEngine

    engine = VLLMEngine(ckpt[0], max_model_len=MAX_LEN, kv_cache_memory_bytes=16 * 2**20)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def policy(ckpt, one_rank_group):
    from meshrl.policy import Policy

    return Policy.from_options(ckpt[0], backend="hf", pad_id=0)


# ---- helpers --------------------------------------------------------------------------------------------------


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def _hf_seq_logprobs(model, seq: list[int]) -> torch.Tensor:
    """log p(seq[t] | seq[:t]), t = 1 .. len-1, from transformers' logits."""
    ids = torch.tensor([seq])
    return torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]


def _close(got, want, atol=ATOL, rtol=0.0):
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float32), want.float(), rtol=rtol, atol=atol)


def _check_engine(engine, model, prompts):
    """Greedy tokens = transformers' generate (stopping at the same eos), their logprobs and prompt logprobs =
    transformers' log-softmax."""
    out = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0), policy_version=3)
    for prompt, (c,) in zip(prompts, out, strict=True):
        assert c.token_ids == _hf_greedy(model, prompt, 16)  # transformers stops at the generation_config's eos too
        assert c.policy_version == 3
        assert c.finish_reason == ("stop" if c.token_ids[-1] in (1, 3) else "length")
        _close(c.logprobs, _hf_seq_logprobs(model, prompt + c.token_ids)[len(prompt) - 1 :])
    seqs = [p + c.token_ids for p, (c,) in zip(prompts, out, strict=True)]
    for seq, lp in zip(seqs, engine.prompt_logprobs(seqs), strict=True):
        _close(lp, _hf_seq_logprobs(model, seq))
    return out


def _data(prompts, completions) -> list[Datum]:
    return [
        Datum.from_completion(p, c.token_ids, c.logprobs, 1.0) for p, (c,) in zip(prompts, completions, strict=True)
    ]


# ---- builders -------------------------------------------------------------------------------------------------


def test_bpe_tokenizer_is_deterministic_and_chatml(tokenizer, tmp_path):
    again = train_bpe_tokenizer(default_corpus(500), VOCAB)
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    assert len(tokenizer) == VOCAB
    text = "Hello world! 12+345 = 357 <think>x</think> héllo 日本"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # byte-level: every text round-trips
    assert [tokenizer.decode([t]) for t in tokenizer("2024")["input_ids"]] == list("2024")  # one token per digit
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert list(ids.values()) == [0, 1, 2, 3]
    assert (tokenizer.pad_token_id, tokenizer.eos_token, tokenizer.bos_token) == (0, "<|im_end|>", "<|endoftext|>")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == want
    assert tokenizer.apply_chat_template(msgs, tokenize=False) == want.removesuffix("<|im_start|>assistant\n")
    no_think = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert no_think == want + "<think>\n\n</think>\n\n"
    rendered = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]
    assert rendered[0] == ids["<|im_start|>"] and rendered.count(ids["<|im_end|>"]) == 2  # markers are single ids
    tokenizer.save_pretrained(tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.chat_template == CHATML_TEMPLATE and loaded.eos_token_id == 3
    assert loaded.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == want
    plain = train_bpe_tokenizer(["some text 123"] * 3, 270, chat_template=None)
    assert (plain.eos_token, plain.pad_token, plain.chat_template) == ("<|endoftext|>", "<|pad|>", None)
    with pytest.raises(ValueError, match="vocab_size=100 is too small"):
        train_bpe_tokenizer(["x"], 100)


def test_config_helpers(tokenizer, tmp_path):
    gpt2 = create_tiny_checkpoint(tmp_path / "gpt2", arch="gpt2", tokenizer=tokenizer, max_position_embeddings=96)
    cfg = read_config(gpt2)
    assert "max_position_embeddings" not in cfg and cfg["n_positions"] == 96  # what broke `cfg[...]` readers
    assert max_positions(cfg) == 96 and max_positions(transformers.AutoConfig.from_pretrained(gpt2)) == 96
    assert max_positions({"text_config": {"max_position_embeddings": 64}}) == 64
    assert max_positions({"model_type": "x"}, default=7) == 7
    with pytest.raises(ValueError, match="gives no context length"):
        max_positions({"model_type": "x"})
    assert model_type(gpt2) == "gpt2"
    # generation_config lists <|im_end|> and <|endoftext|> (Qwen's layout); config and tokenizer say <|im_end|>.
    assert json.loads((gpt2 / "generation_config.json").read_text())["eos_token_id"] == [3, 1]
    assert stop_token_ids(gpt2) == [1, 3]
    only_tokenizer = tmp_path / "only_tokenizer"  # the tokenizer's eos counts on its own
    only_tokenizer.mkdir()
    (only_tokenizer / "config.json").write_text('{"model_type": "gpt2"}')
    tokenizer.save_pretrained(only_tokenizer)
    assert stop_token_ids(only_tokenizer) == [3]
    check_backend_supports(gpt2, "hf")
    with pytest.raises(ConfigError, match=r"model.backend='torchtitan' loads Qwen3 checkpoints only; .* is a 'gpt2' "):
        check_backend_supports(gpt2, "torchtitan")
    with pytest.raises(ConfigError, match="use --model.backend hf"):  # the trainer's own refusal says the same
        from meshrl.models.config import ModelConfig, TrainerConfig
        from meshrl.models.titan_backend import TorchtitanBackend

        TorchtitanBackend(str(gpt2), ModelConfig(), TrainerConfig(num_procs=1), device=torch.device("cpu"))
    # Atomic, readable, seeded: the same arguments give the same weights; a rebuild replaces the directory.
    again = create_tiny_checkpoint(tmp_path / "gpt2", arch="gpt2", tokenizer=tokenizer, max_position_embeddings=96)
    assert (again / "model.safetensors").read_bytes() == (gpt2 / "model.safetensors").read_bytes()
    _check_modes(again)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp dirs left behind"


def test_make_tiny_checkpoint_cli(tmp_path):
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "make_tiny_checkpoint.py")
    spec = importlib.util.spec_from_file_location("make_tiny_checkpoint", path)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    texts = tmp_path / "texts.jsonl"
    texts.write_text('{"text": "the cat sat on the mat 123"}\n"plain string row"\n{"messages": [{"content": "hi"}]}\n')
    out = cli.main(["--arch", "llama", "--out", str(tmp_path / "m"), "--vocab-size", "280", "--texts", str(texts)])
    assert model_type(out) == "llama" and 262 < read_config(out)["vocab_size"] <= 280  # fewer merges: few texts
    assert (out / "chat_template.jinja").is_file()


def _check_modes(path) -> None:
    if os.name != "posix":
        return
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o777 & ~umask
    for f in path.iterdir():
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o666 & ~umask, f


# ---- per architecture -----------------------------------------------------------------------------------------


def test_transformers_engine_matches_transformers(ckpt, transformers_engine):
    path, model, prompts = ckpt
    assert transformers_engine.eos_ids == {1, 3}  # generation_config's list, config's and the tokenizer's eos
    _check_engine(transformers_engine, model, prompts)


def test_vllm_engine_matches_transformers(ckpt, vllm_engine):
    path, model, prompts = ckpt
    assert vllm_engine.eos_ids == {1, 3}
    _check_engine(vllm_engine, model, prompts)


def test_hf_backend_has_no_dropout_and_matches_transformers(ckpt, policy):
    """The config has dropout 0.1; the trainer's logprobs, with and without grad, are transformers' eval-mode ones
    (a dropped-out forward differs by far more than ATOL) and are the same on every call."""
    path, model, prompts = ckpt
    assert not policy.backend.model.training
    seqs = [p + p[::-1][:5] for p in prompts]
    data = [Datum.from_completion(s[:4], s[4:], None, 1.0) for s in seqs]
    want = [_hf_seq_logprobs(model, s) for s in seqs]
    for got, w in zip(policy.forward(data), want, strict=True):
        _close(got, w, **SAME)
    n_tok = sum(d.num_loss_tokens for d in data)
    fb = policy.forward_backward(data, LossSpec("cross_entropy", num_loss_tokens=n_tok, return_logprobs=True))
    policy.zero_grad()
    for got, w in zip(fb.logprobs, want, strict=True):
        _close(got, w, **SAME)
    assert not policy.backend.model.training
    # Training mode would drop activations: the check above is a real one.
    model.train()
    try:
        with torch.no_grad():
            noisy = _hf_seq_logprobs(model, seqs[0])
    finally:
        model.eval()
    assert (noisy - want[0]).abs().max() > 10 * ATOL


def test_trainer_generator_parity_weight_sync_and_export(ckpt, policy, transformers_engine, vllm_engine, tmp_path):
    """Logprob parity on sampled sequences (what GRPO's importance ratio compares: generator vs trainer), then one
    trainer step whose weights are loaded into both engines (the weight sync's payload): equal again, and different
    from before. Then the HF export of the trained policy: transformers reloads it with the trainer's logprobs, and
    it carries the tokenizer, the chat template and the stop ids, readable by others."""
    path, model, prompts = ckpt
    engines = {"transformers": transformers_engine, "vllm": vllm_engine}
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5)

    def check_parity() -> list[list[float]]:
        seqs = []
        for engine in engines.values():
            comps = engine.generate(prompts, params, policy_version=policy.policy_version)
            trainer = policy.forward(_data(prompts, comps))
            for (c,), got in zip(comps, trainer, strict=True):
                _close(c.logprobs, torch.tensor(got[-len(c.token_ids) :]))
            seqs += [p + c.token_ids for p, (c,) in zip(prompts, comps, strict=True)]
        trainer = policy.forward([Datum.from_completion(s[:1], s[1:]) for s in seqs])
        for engine in engines.values():
            for got, want in zip(engine.prompt_logprobs(seqs), trainer, strict=True):
                _close(got, torch.tensor(want))
        return trainer

    before = check_parity()
    data = [Datum.from_completion(p, p[::-1][:6], None, 1.0) for p in prompts]
    policy.forward_backward(data, LossSpec("cross_entropy", num_loss_tokens=sum(d.num_loss_tokens for d in data)))
    policy.optim_step(OptimParams(lr=3e-2))
    weights = policy.hf_state_dict(torch.float32)
    for engine in engines.values():
        engine.load_weights(weights)
    after = check_parity()
    assert max(abs(a - b) for ra, rb in zip(after, before, strict=False) for a, b in zip(ra, rb, strict=False)) > 1e-3

    umask = os.umask(0o022)  # the modes below are those of the default umask
    try:
        out = policy.save_hf(str(tmp_path / "export"))
    finally:
        os.umask(umask)
    out = tmp_path / "export"
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o755
    for f in out.iterdir():
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o644, f
    names = {f.name for f in out.iterdir()}
    assert {"chat_template.jinja", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names
    assert stop_token_ids(out) == stop_token_ids(path) == [1, 3]  # the source's eos list survives the export
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == CHATML_TEMPLATE and tok.eos_token == "<|im_end|>"
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    data = [Datum.from_completion(p[:2], p[2:], None, 1.0) for p in prompts]
    for p, got in zip(prompts, policy.forward(data), strict=True):
        _close(got, _hf_seq_logprobs(exported, p), **SAME)
    for engine in engines.values():  # restore the module's engines to the checkpoint's weights
        engine.load_weights(_checkpoint_weights(path))


def test_lora_stays_in_eval_mode_and_merges(ckpt, one_rank_group, tmp_path):
    """LoRA on every linear layer (GPT-2's are `Conv1D`, stored [in, out]): the wrapped model stays in eval mode,
    and the merged weights (what is pushed to the generators and exported) give the trainer's logprobs."""
    from meshrl.policy import Policy

    path, model, prompts = ckpt
    # peft sets fan_in_fan_out itself for GPT-2's Conv1D layers (stored [in, out]), with a warning.
    p = Policy.from_options(path, backend="hf", lora_rank=4, lora_alpha=8.0, lora_target_modules="all-linear", seed=0)
    assert not any(m.training for m in p.model.modules())
    data = [Datum.from_completion(q, q[::-1][:6], None, 1.0) for q in prompts]
    for _ in range(2):
        p.forward_backward(data, LossSpec("cross_entropy", num_loss_tokens=sum(d.num_loss_tokens for d in data)))
        p.optim_step(OptimParams(lr=3e-2))
    assert not any(m.training for m in p.model.modules())
    want = p.forward(data)
    merged = transformers.AutoModelForCausalLM.from_pretrained(p.save_hf(str(tmp_path / "merged")), dtype=torch.float32)
    moved = 0.0
    for d, got in zip(data, want, strict=True):
        _close(got, _hf_seq_logprobs(merged.eval(), list(d.tokens)), **SAME)
        moved = max(moved, float((torch.tensor(got) - _hf_seq_logprobs(model, list(d.tokens))).abs().max()))
    assert moved > 1e-3  # the adapters trained


def _checkpoint_weights(path: str) -> dict[str, torch.Tensor]:
    from meshrl.models.qwen3 import load_hf_state_dict

    return load_hf_state_dict(path)
