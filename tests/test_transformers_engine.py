"""meshrl's 'transformers' engine (TransformersEngine) against transformers on a tiny random Qwen3 (CPU,
fp32, no hub access).

One engine is started for the whole module (start-up dominates the cost). The weight-update test restores the
original weights before it returns, so test order does not matter.
"""

from __future__ import annotations

import math

import pytest
import torch
from markers import needs_cuda

transformers = pytest.importorskip("transformers")

import numpy as np  # noqa: E402

from meshrl.generation.transformers_engine import TransformersEngine  # noqa: E402
from meshrl.generation.transformers_engine.sampler import inverse_cdf, uniform_noise, uniform_noise_torch  # noqa: E402
from meshrl.types import SamplingParams  # noqa: E402

torch.set_num_threads(1)

VOCAB = 48
MAX_MODEL_LEN = 256
ATOL = 1e-4
# Larger than the default 0.02 so the random model is not degenerate (std 0.02 just repeats the last token)
# while greedy choices keep a clear margin over fp32 noise.
INIT_RANGE = 0.3
EOS_PROMPT = [5, 6, 7]
PROMPTS = [EOS_PROMPT, [20, 21, 22], [3], [40, 2, 17, 9, 33, 12, 8], [11, 30, 11, 30, 11]]


def _config(eos_token_id: int):
    return transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_MODEL_LEN,
        tie_word_embeddings=True,
        torch_dtype="float32",
        initializer_range=INIT_RANGE,
        eos_token_id=eos_token_id,
        pad_token_id=0,
        bos_token_id=None,
    )


def _make_model(seed: int, eos_token_id: int):
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(_config(eos_token_id)).eval()
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = 0
    return model


def _save_tokenizer(path: str, eos_token_id: int) -> None:
    """Character-level WordLevel tokenizer with `<eos>` at `eos_token_id`, HF format."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    others = ["<pad>", "<unk>"] + list("abcdefghijklmnopqrstuvwxyz0123456789 .,!?+-*/")
    ids = [i for i in range(VOCAB) if i != eos_token_id]
    assert len(others) == len(ids)
    vocab = {"<eos>": eos_token_id, **dict(zip(others, ids, strict=True))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(path)


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def _hf_logprobs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log p(tokens[i] | prompt + tokens[:i]) under softmax(logits / temperature)."""
    seq = torch.tensor([prompt + tokens])
    logits = model(seq).logits[0].float() / temperature
    lp = torch.log_softmax(logits, dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens))
    return lp[pos, torch.tensor(tokens)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(engine, model A, eos id). The EOS id is chosen so that EOS_PROMPT's greedy continuation ends on it."""
    model_dir = str(tmp_path_factory.mktemp("tiny_qwen3"))
    model = _make_model(0, eos_token_id=1)
    model.generation_config.eos_token_id = None  # free-running continuation, to pick the EOS from
    free = _hf_greedy(model, EOS_PROMPT, 10)
    eos = next(t for k, t in enumerate(free) if k >= 2 and t not in free[:k])
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    model.save_pretrained(model_dir)  # safetensors
    _save_tokenizer(model_dir, eos)

    engine = TransformersEngine(model_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=8)
    yield engine, model, eos
    engine.shutdown()


def test_greedy_matches_transformers(setup):
    engine, model, eos = setup
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0), policy_version=7)
    assert len(out) == len(PROMPTS)
    reasons = []
    for prompt, comps in zip(PROMPTS, out, strict=True):
        assert len(comps) == 1
        c = comps[0]
        assert c.prompt_ids == prompt
        assert c.policy_version == 7
        assert c.token_ids == _hf_greedy(model, prompt, 12), f"prompt {prompt}"
        if c.token_ids[-1] == eos:
            assert c.finish_reason == "stop"
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 12
        reasons.append(c.finish_reason)
    # The model's EOS (generation_config.json, no tokenizer loaded) is honoured, not only max_tokens.
    assert out[0][0].finish_reason == "stop" and 3 <= len(out[0][0].token_ids) <= 10
    assert "length" in reasons


def test_greedy_logprobs_match_transformers(setup):
    engine, model, _ = setup
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, n=2), policy_version=0)
    for prompt, comps in zip(PROMPTS, out, strict=True):
        assert len(comps) == 2 and comps[0].token_ids == comps[1].token_ids  # greedy n=2: identical copies
        c = comps[0]
        assert len(c.logprobs) == len(c.token_ids)
        assert all(isinstance(x, float) for x in c.logprobs)
        ref = _hf_logprobs(model, prompt, c.token_ids)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=ATOL, rtol=0)


def test_prompt_logprobs_match_transformers(setup):
    engine, model, _ = setup
    g = torch.Generator().manual_seed(5)
    seqs = [
        [4, 9],
        [5, 6, 7, 8, 9, 10, 11],
        torch.randint(0, VOCAB, (40,), generator=g).tolist(),
        # exactly max_model_len tokens: the full sequence a max-length completion produces
        torch.randint(0, VOCAB, (MAX_MODEL_LEN,), generator=g).tolist(),
        [13],
    ]
    got = engine.prompt_logprobs(seqs)
    assert len(got) == len(seqs)
    assert got[-1] == []
    for s, lp in zip(seqs[:-1], got[:-1], strict=True):
        assert len(lp) == len(s) - 1
        ref = _hf_logprobs(model, s[:1], s[1:])
        torch.testing.assert_close(torch.tensor(lp), ref, atol=ATOL, rtol=0)


def test_sampling_n_and_processed_logprobs(setup):
    engine, model, eos = setup
    temp = 0.7
    params = SamplingParams(max_tokens=10, temperature=temp, n=4, seed=123)
    prompts = PROMPTS[1:3]
    out = engine.generate(prompts, params, policy_version=3)
    assert [len(c) for c in out] == [4, 4]
    for prompt, comps in zip(prompts, out, strict=True):
        for c in comps:
            assert 1 <= len(c.token_ids) <= 10
            assert len(c.logprobs) == len(c.token_ids)
            assert all(0 <= t < VOCAB for t in c.token_ids)
            assert all(math.isfinite(x) and x <= 0 for x in c.logprobs)
            assert c.policy_version == 3 and c.prompt_ids == prompt
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == eos
            else:
                assert c.finish_reason == "length" and len(c.token_ids) == 10 and eos not in c.token_ids
            # processed logprobs: under the temperature-scaled distribution actually sampled from
            ref = _hf_logprobs(model, prompt, c.token_ids, temperature=temp)
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=ATOL, rtol=0)
        assert len({tuple(c.token_ids) for c in comps}) > 1, "4 samples at T=0.7 should not all coincide"
    # seeded -> reproducible
    again = engine.generate(prompts, params, policy_version=3)
    assert [[c.token_ids for c in x] for x in again] == [[c.token_ids for c in x] for x in out]
    # ... and the same prompt twice in one call does not reuse the same noise
    twice = engine.generate([prompts[0], prompts[0]], params, policy_version=3)
    assert [c.token_ids for c in twice[0]] == [c.token_ids for c in out[0]]
    assert [c.token_ids for c in twice[1]] != [c.token_ids for c in twice[0]]

    # top-k: every token is in the top k, and its logprob is renormalised over those k
    k = 3
    out = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=1.0, top_k=k, n=2, seed=9), 0)
    for prompt, comps in zip(prompts, out, strict=True):
        for c in comps:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + c.token_ids])).logits[0].float()
            for i, (t, lp) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
                row = logits[len(prompt) - 1 + i]
                top = torch.topk(row, k)
                assert t in top.indices.tolist()
                ref = torch.log_softmax(top.values, -1)[top.indices.tolist().index(t)].item()
                assert abs(lp - ref) < ATOL


def test_stop_token_ids(setup):
    engine, model, _ = setup
    prompt = PROMPTS[3]
    greedy = _hf_greedy(model, prompt, 12)
    stop = greedy[2]
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop])
    (c,) = engine.generate([prompt], params, 1)[0]
    cut = greedy.index(stop) + 1
    assert c.finish_reason == "stop"
    assert c.token_ids == greedy[:cut]  # the stop token is kept, with its logprob
    assert len(c.logprobs) == cut


def test_load_weights_then_matches_new_model(setup):
    engine, model_a, eos = setup
    model_b = _make_model(1, eos_token_id=eos)
    g = torch.Generator().manual_seed(11)
    # > 128 tokens (the CPU KV block size) so its first block lands in the prefix cache before the update
    long_prompt = torch.randint(0, VOCAB, (150,), generator=g).tolist()
    prompts = PROMPTS + [long_prompt]
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    seqs = [p + _hf_greedy(model_b, p, 12) for p in prompts]

    before = engine.generate(prompts, greedy, 0)
    before_lp = engine.prompt_logprobs(seqs)
    try:
        # As the trainer sends it: tied, so no lm_head.weight. This is the tied-lm_head trap: without
        # re-processing the CPU lm_head, logits would come from the OLD embedding matrix.
        sd = {k: v for k, v in model_b.state_dict().items() if k != "lm_head.weight"}
        assert "model.layers.0.self_attn.q_proj.weight" in sd
        engine.load_weights(sd)

        after = engine.generate(prompts, greedy, 1)
        assert [c[0].token_ids for c in after] != [c[0].token_ids for c in before]
        for prompt, comps, seq in zip(prompts, after, seqs, strict=True):
            c = comps[0]
            assert prompt + c.token_ids == seq, f"prompt of length {len(prompt)}"
            ref = _hf_logprobs(model_b, prompt, c.token_ids)
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=ATOL, rtol=0)
        after_lp = engine.prompt_logprobs(seqs)
        for seq, lp, old in zip(seqs, after_lp, before_lp, strict=True):
            ref = _hf_logprobs(model_b, seq[:1], seq[1:])
            torch.testing.assert_close(torch.tensor(lp), ref, atol=ATOL, rtol=0)
            assert max(abs(x - y) for x, y in zip(lp, old, strict=True)) > 0.1
    finally:
        # Restore A (full state dict, lm_head.weight included this time) for the other tests.
        engine.load_weights(model_a.state_dict())
    restored = engine.generate(prompts, greedy, 2)
    assert [c[0].token_ids for c in restored] == [c[0].token_ids for c in before]
    for r, b in zip(restored, before, strict=True):
        torch.testing.assert_close(torch.tensor(r[0].logprobs), torch.tensor(b[0].logprobs), atol=ATOL, rtol=0)


def test_validation_errors(setup):
    engine, _, _ = setup
    assert engine.max_model_len == MAX_MODEL_LEN
    long_prompt = [3] * 250
    with pytest.raises(ValueError) as err:
        engine.generate([[3, 4], long_prompt], SamplingParams(max_tokens=10), 0)
    msg = str(err.value)
    for part in ("prompt 1", "250", "max_tokens=10", f"max_model_len={MAX_MODEL_LEN}"):
        assert part in msg, msg
    assert "lower max_tokens" in msg
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        engine.generate([[]], SamplingParams(), 0)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 48\)"):
        engine.generate([[1, 2, VOCAB]], SamplingParams(), 0)
    with pytest.raises(ValueError, match="sequence 0"):
        engine.prompt_logprobs([[1] * (MAX_MODEL_LEN + 1)])
    # the engine still works after rejected calls
    (c,) = engine.generate([[3, 4]], SamplingParams(max_tokens=2, temperature=0.0), 0)[0]
    assert len(c.token_ids) >= 1


def test_uniform_noise_torch_is_bit_identical_to_numpy():
    rng = np.random.default_rng(0)
    seeds = np.concatenate([rng.integers(0, 2**63 - 1, 500, dtype=np.int64), [0, 1, 2**63 - 1]])
    steps = np.concatenate([rng.integers(0, 5000, 500, dtype=np.int64), [0, 7, 4095]])
    ref = uniform_noise(seeds.astype(np.uint64), steps.astype(np.uint64))
    got = uniform_noise_torch(torch.from_numpy(seeds), torch.from_numpy(steps)).numpy()
    assert np.array_equal(got, ref)
    assert ((got >= 0) & (got < 1)).all()


@pytest.mark.parametrize("vocab", [48, 128, 1000, 151936])
def test_inverse_cdf_two_levels_equals_one_cumsum(vocab):
    g = torch.Generator().manual_seed(vocab)
    n = 64
    logits = torch.randn(n, vocab, generator=g) * 3
    logits[:, ::7] = float("-inf")  # masked tokens (top-k / top-p): zero probability
    probs = torch.softmax(logits, -1)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    u[:4] = torch.tensor([0.0, 1 - 2**-53, 0.5, 1 - 1e-9], dtype=torch.float64)  # the edges
    got = inverse_cdf(probs, u)
    assert (probs.gather(1, got[:, None]) > 0).all(), "never a token of zero probability"
    cdf = probs.double().cumsum(-1)
    ref = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=vocab - 1)
    # Equal except where u x total falls within float32 rounding of a CDF step.
    agree = (got == ref).float().mean().item()
    assert agree >= 0.95, agree
    lo = (cdf.gather(1, got[:, None])[:, 0] - probs.double().gather(1, got[:, None])[:, 0]) / cdf[:, -1]
    hi = cdf.gather(1, got[:, None])[:, 0] / cdf[:, -1]
    assert ((u >= lo - 1e-5) & (u <= hi + 1e-5)).all()


def test_device_loop_equals_per_step_sampling(setup):
    """The device loop (no top-k/top-p; sampling with the tokens read back every `sync_every` steps) and the
    per-step path (top-k = vocabulary: the same distribution, sampled outside the graph every step) draw the
    same tokens with the same logprobs from the same seeds; and the chunk size does not change anything."""
    engine, model, eos = setup
    prompts = [EOS_PROMPT] + PROMPTS[1:3]
    loop = SamplingParams(max_tokens=20, temperature=0.9, n=4, seed=77)
    step = SamplingParams(max_tokens=20, temperature=0.9, n=4, seed=77, top_k=VOCAB)
    a = engine.generate(prompts, loop, 0)
    syncs = engine.stats["host_syncs"]
    b = engine.generate(prompts, step, 0)
    assert engine.stats["host_syncs"] == syncs  # the top-k request did not use the device loop
    old = engine.sync_every
    try:
        engine.sync_every = 1
        c = engine.generate(prompts, loop, 0)
    finally:
        engine.sync_every = old
    for x, y, z in zip(a, b, c, strict=True):
        for cx, cy, cz in zip(x, y, z, strict=True):
            assert cx.token_ids == cy.token_ids == cz.token_ids
            assert cx.finish_reason == cy.finish_reason == cz.finish_reason
            torch.testing.assert_close(torch.tensor(cx.logprobs), torch.tensor(cy.logprobs), atol=ATOL, rtol=0)
            torch.testing.assert_close(torch.tensor(cx.logprobs), torch.tensor(cz.logprobs), atol=ATOL, rtol=0)
    stopped = [c for x in a for c in x if c.finish_reason == "stop"]
    assert any(len(c.token_ids) < 16 for c in stopped)  # seed 77 stops some rows inside a chunk
    for c in stopped:  # a stop inside a chunk: nothing after the stop token survives
        assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1]


def test_decode_attention_sdpa_matches_matmul(setup):
    """The SDPA decode variant gives the matmul engine's greedy tokens and logprobs (rows of different lengths)."""
    engine, model, _ = setup
    other = TransformersEngine(engine.model_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, attn_impl="sdpa")
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0)
        ref = engine.generate(PROMPTS, params, 0)
        got = other.generate(PROMPTS, params, 0)
        for r, g in zip(ref, got, strict=True):
            assert g[0].token_ids == r[0].token_ids
            torch.testing.assert_close(torch.tensor(g[0].logprobs), torch.tensor(r[0].logprobs), atol=ATOL, rtol=0)
    finally:
        other.shutdown()


def _fp8_reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """What the engine computes with an fp8 cache, as one forward over prompt + completion: prompt positions attend
    exactly (the engine's prefill), later ones over keys / values rounded to fp8 (its decode steps)."""
    from meshrl.generation.transformers_engine.kernels import dequantize_kv, quantize_kv

    def attend(k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            query, k, v, is_causal=True, scale=scaling, enable_gqa=True
        )

    exact = attend(key, value)
    rounded = attend(dequantize_kv(*quantize_kv(key), key.dtype), dequantize_kv(*quantize_kv(value), value.dtype))
    out = torch.cat([exact[:, :, : _FP8_PROMPT_LEN[0]], rounded[:, :, _FP8_PROMPT_LEN[0] :]], dim=2)
    return out.transpose(1, 2).contiguous(), None


_FP8_PROMPT_LEN = [0]


@pytest.mark.parametrize(
    "attn_impl",
    [
        "matmul",
        "sdpa",
        pytest.param("triton", marks=needs_cuda),
    ],
)
def test_fp8_kv_cache(setup, attn_impl):
    """kv_cache_dtype='fp8': the cache holds e4m3 keys / values with a float32 scale per (token, kv head), a
    quarter of the float32 cache's bytes per slot plus the scales. Greedy decoding over it gives the logprobs of a
    transformers forward whose decode positions attend over the same rounded keys / values, and those differ from
    the exact model's (the rounding is really there); a sleep / wake-up cycle re-makes the cache and its scales."""
    engine, model, _ = setup
    other = TransformersEngine(
        engine.model_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, attn_impl=attn_impl, kv_cache_dtype="fp8"
    )
    transformers.AttentionInterface.register("fp8_reference", _fp8_reference_attention)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        engine.model_dir, attn_implementation="fp8_reference"
    ).eval()
    try:
        assert other.attn_impl == attn_impl and other.attn_fallback is None
        assert other.runner.kv.dtype == torch.float8_e4m3fn and other.runner.kv_scale.dtype == torch.float32
        D = model.config.head_dim
        assert other.kv_cache_bytes * 4 * D == engine.kv_cache_bytes * (D + 4)  # same slots, fp8 + scale per vector
        out = other.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0), 0)
        to_exact = []
        for prompt, comps in zip(PROMPTS, out, strict=True):
            c = comps[0]
            _FP8_PROMPT_LEN[0] = len(prompt)
            ref = _hf_logprobs(reference, prompt, c.token_ids)
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=ATOL, rtol=0)
            to_exact.append((ref - _hf_logprobs(model, prompt, c.token_ids)).abs().max())
        assert max(to_exact) > 1e-2  # fp8's rounding moves them (0.33 at most here)
        other.sleep(1)
        other.wake_up()
        again = other.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0), 0)
        assert [g[0].token_ids for g in again] == [g[0].token_ids for g in out]
    finally:
        other.shutdown()


def test_fp8_tuned_launch_falls_back_to_the_default_launch(monkeypatch):
    """Where the fp8 cache's tuned decode launch fails its start-up check (e.g. a GPU with less shared memory), the
    engine keeps the Triton kernel with the default launch and says why. The failure cannot be produced on this
    CPU: the check is a stand-in that fails whenever a launch is given; the runner's own choice logic runs."""
    from meshrl.generation.transformers_engine import model_runner

    calls = []

    def check(device, dtype, heads, kv_heads, head_dim, max_len, fp8=False, launch=None):
        calls.append((heads, kv_heads, head_dim, max_len, fp8, launch))
        return "out of shared memory (stand-in)" if launch else None

    monkeypatch.setattr(model_runner, "check_triton_attention", check)
    monkeypatch.setattr(model_runner, "triton_decode_supported", lambda head_dim, group: None)
    runner = model_runner.ModelRunner.__new__(model_runner.ModelRunner)
    runner.device, runner.torch_dtype, runner._heads, runner.kv_heads = torch.device("cuda"), torch.bfloat16, 16, 8
    runner.head_dim, runner.max_model_len, runner.kv_fp8 = 128, 2048, True
    runner._ctx, runner.attn_fallback, runner.attn_launch_fallback = model_runner.AttentionContext(), None, None
    assert runner._choose_attn("auto") == "triton"
    assert runner._ctx.launch == {} and runner.attn_launch_fallback == "out of shared memory (stand-in)"
    assert calls == [(16, 8, 128, 2048, True, {"block_n": 128, "num_stages": 3}), (16, 8, 128, 2048, True, None)]


def test_fp8_kv_cache_config_errors():
    from meshrl.errors import ConfigError
    from meshrl.generation.transformers_engine import TransformersEngineConfig

    with pytest.raises(ConfigError, match="kv_cache_dtype='int8'"):
        TransformersEngineConfig(kv_cache_dtype="int8")  # type: ignore[arg-type]


_TRITON_CHECK = """
import os
import torch
from meshrl.generation.transformers_engine.kernels import decode_attention_triton
torch.manual_seed(0)
torch.set_default_device(os.environ.get("CHECK_DEVICE", "cpu"))
for B, S, Hkv, G, L, D in [(3, 4, 2, 2, 100, 32), (2, 2, 8, 2, 384, 128), (40, 40, 2, 4, 70, 32)]:
    kc, vc = torch.randn(S, Hkv, L, D), torch.randn(S, Hkv, L, D)
    q = torch.randn(B, Hkv * G, D)
    pos = torch.randint(0, L, (B,))
    pos[0], pos[-1] = 0, L - 1
    bias = torch.where(torch.arange(L)[None] <= pos[:, None], 0.0, float("-inf"))
    p = torch.softmax(q.reshape(B, Hkv, G, D) @ kc[:B].transpose(-1, -2) * D**-0.5 + bias[:, None, None], -1)
    ref = (p @ vc[:B]).reshape(B, Hkv * G, D)
    err = (decode_attention_triton(q, kc, vc, pos, L, D**-0.5) - ref).abs().max().item()
    assert err < 1e-5, (B, S, Hkv, G, L, D, err)
    # an fp8 cache (keys far from 1, values far below it) against the same formulation over its dequantized values
    from meshrl.generation.transformers_engine.kernels import dequantize_kv, quantize_kv
    (k8, ks), (v8, vs) = quantize_kv(kc * 50), quantize_kv(vc * 1e-3)
    kd, vd = dequantize_kv(k8, ks, torch.float32), dequantize_kv(v8, vs, torch.float32)
    assert (kd - kc * 50).abs().max() < 0.04 * (kc * 50).abs().max()
    p = torch.softmax(q.reshape(B, Hkv, G, D) @ kd[:B].transpose(-1, -2) * D**-0.5 / 50 + bias[:, None, None], -1)
    ref = (p @ vd[:B]).reshape(B, Hkv * G, D)
    got = decode_attention_triton(q / 50, k8, v8, pos, L, D**-0.5, k_scale=ks, v_scale=vs)
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, ("fp8", B, S, Hkv, G, L, D, err)
    # the decode step's fused store: each row's new key at its position, as quantize_kv rounds it
    from meshrl.generation.transformers_engine.kernels import store_kv_fp8_triton
    new, rows = torch.randn(B, Hkv, D) * 7, torch.randperm(S)[:B]
    before = k8.view(torch.uint8).clone()
    store_kv_fp8_triton(new, k8, ks, rows, pos)
    want8, want_scale = quantize_kv(new)
    same = k8[rows, :, pos].view(torch.uint8) == want8.view(torch.uint8)
    if os.environ.get("CHECK_DEVICE") == "cuda":
        assert bool(same.all())
    else:  # Triton's interpreter rounds a value whose rounding carries into the next binade (126.8 -> 64, not 128)
        assert float(same.float().mean()) > 0.95
    torch.testing.assert_close(ks[rows, :, pos], want_scale)
    before[rows, :, pos] = k8[rows, :, pos].view(torch.uint8)
    assert torch.equal(k8.view(torch.uint8), before)  # nothing else written
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from meshrl.generation.transformers_engine.kernels import rmsnorm_triton
for shape in [(5, 1024), (3, 7, 16, 128), (2, 48)]:
    norm = Qwen3RMSNorm(shape[-1], eps=1e-6)
    norm.weight.data = torch.randn(shape[-1])
    x = torch.randn(*shape) * 3
    err = (rmsnorm_triton(x, norm.weight, norm.variance_epsilon) - norm(x)).abs().max().item()
    assert err < 1e-5, (shape, err)
print("ok")
"""


def test_triton_kernels():
    """The Triton decode kernel (float32) against softmax(q k^T) v with per-row lengths: GQA groups of 2 and 4,
    one program per (row, kv head) and rows split over several programs; the fused RMSNorm against transformers'
    Qwen3RMSNorm. Compiled on a GPU; on CPU through Triton's interpreter (whose numpy handling differs between
    Triton versions: the GPU machine's fails where its compiled kernels pass)."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    on_gpu = torch.cuda.is_available()
    env = dict(os.environ, CHECK_DEVICE="cuda") if on_gpu else dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _TRITON_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


# ---------------------------------------------------------------- KV cache at fixed addresses (CUDA VMM)


def _tokens_and_logprobs(groups):
    return [[c.token_ids for c in g] for g in groups], [[c.logprobs for c in g] for g in groups]


def test_vmm_struct_layouts_match_cuda_h():
    """The ctypes structs against cuda.h's (sizes and offsets read with offsetof from CUDA 13.0's header)."""
    import ctypes

    from meshrl.generation.transformers_engine import device_memory as dm

    assert ctypes.sizeof(dm.CUmemLocation) == 8 and dm.CUmemLocation.id.offset == 4
    prop = dm.CUmemAllocationProp
    assert ctypes.sizeof(prop) == 32
    offsets = [prop.type, prop.requestedHandleTypes, prop.location, prop.win32HandleMetaData, prop.allocFlags]
    assert [f.offset for f in offsets] == [0, 4, 8, 16, 24]
    flags = dm.CUmemAllocFlags
    assert ctypes.sizeof(flags) == 8 and [flags.gpuDirectRDMACapable.offset, flags.usage.offset] == [1, 2]
    assert flags.reserved.offset == 4
    assert ctypes.sizeof(dm.CUmemAccessDesc) == 12 and dm.CUmemAccessDesc.flags.offset == 8


class _FakeDriver:
    """`device_memory.Driver`'s methods over bookkeeping, to check RemappableBuffer's calls without a GPU."""

    GRAN = 2 << 20

    def __init__(self):
        self.log, self.ctx_depth, self.handles, self.fail = [], 0, set(), {}
        self.next_addr, self.next_handle = 1 << 40, 1

    def _check(self, name):
        self.log.append(name)
        if name in self.fail:
            from meshrl.generation.transformers_engine.device_memory import CudaDriverError

            raise CudaDriverError(name, self.fail[name], "FAKE")

    def device(self, ordinal):
        return ordinal

    def retain_primary_context(self, dev):
        self._check("retain")
        return 0xC0

    def release_primary_context(self, dev):
        self._check("release_ctx")

    def push_context(self, ctx):
        assert ctx == 0xC0
        self.ctx_depth += 1

    def pop_context(self):
        self.ctx_depth -= 1

    def granularity(self, prop):
        assert self.ctx_depth == 1 and prop.type == 1 and prop.location.type == 1
        return self.GRAN

    def reserve(self, size, alignment):
        self._check("reserve")
        assert size % self.GRAN == 0 and alignment == self.GRAN
        self.next_addr += 1 << 36
        return self.next_addr

    def free_address(self, ptr, size):
        self._check("free_address")

    def create(self, size, prop):
        self._check("create")
        self.next_handle += 1
        self.handles.add(self.next_handle)
        return self.next_handle

    def release(self, handle):
        self._check("release")
        self.handles.remove(handle)

    def map(self, ptr, size, handle):
        self._check("map")

    def unmap(self, ptr, size):
        self._check("unmap")

    def set_access(self, ptr, size, desc):
        assert desc.flags == 3 and desc.location.type == 1
        self._check("set_access")


def test_remappable_buffer_calls_without_a_gpu(monkeypatch):
    import gc

    from meshrl.generation.transformers_engine import device_memory as dm

    fake = _FakeDriver()
    monkeypatch.setattr(dm, "driver", lambda: fake)
    monkeypatch.setattr(dm.torch.cuda, "synchronize", lambda *a: None)
    base = dm.mapped_bytes(3)
    buf = dm.RemappableBuffer(5 << 20, 3)
    assert buf.nbytes == 6 << 20 and not buf.mapped and fake.log == ["retain", "reserve"]
    addr = buf.address
    buf.map()
    buf.map()  # no-op when mapped
    assert buf.mapped and dm.mapped_bytes(3) == base + (6 << 20) and len(fake.handles) == 1
    buf.unmap()
    assert not buf.mapped and dm.mapped_bytes(3) == base and not fake.handles and buf.address == addr
    assert fake.log[2:] == ["create", "map", "set_access", "unmap", "release"]
    # a failed map leaves nothing behind: the physical memory is released, the mapping undone
    fake.fail["set_access"] = 999
    with pytest.raises(dm.CudaDriverError, match="set_access failed: CUresult 999"):
        buf.map()
    assert not buf.mapped and not fake.handles and fake.log[-3:] == ["set_access", "unmap", "release"]
    del fake.fail["set_access"]
    buf.map()
    buf.close()
    buf.close()
    assert fake.log[-4:] == ["unmap", "release", "free_address", "release_ctx"] and fake.ctx_depth == 0
    assert dm.mapped_bytes(3) == base and not fake.handles
    with pytest.raises(RuntimeError, match="closed"):
        buf.map()
    # a buffer garbage-collected mapped is unmapped and freed
    other = dm.RemappableBuffer(1, 3)
    other.map()
    del other
    gc.collect()
    assert fake.log[-4:] == ["unmap", "release", "free_address", "release_ctx"] and not fake.handles


def test_driver_checks_every_result():
    from meshrl.generation.transformers_engine import device_memory as dm

    def ok(*args):
        return 0

    def oom(*args):
        return 2

    names = [s for _, symbols in dm._SIGNATURES.values() for s in symbols]
    lib = type("Lib", (), {})()
    for s in names:
        setattr(lib, s, type("Fn", (), {"__call__": staticmethod(ok)})())
    lib.cuMemCreate = type("Fn", (), {"__call__": staticmethod(oom)})()
    drv = dm.Driver(lib)  # cuInit ran
    assert drv._fns["cuCtxPushCurrent"] is lib.cuCtxPushCurrent_v2  # cuda.h's name for it
    with pytest.raises(dm.CudaDriverError, match=r"cuMemCreate failed: CUresult 2") as err:
        drv.create(2 << 20, dm.CUmemAllocationProp())
    assert err.value.code == dm.CUDA_ERROR_OUT_OF_MEMORY
    del lib.cuMemMap
    with pytest.raises(OSError, match="no cuMemMap"):
        dm.Driver(lib)


def test_remappable_kv_cache_flag_without_cuda(setup):
    from meshrl.errors import ConfigError
    from meshrl.generation.transformers_engine import TransformersEngineConfig
    from meshrl.generation.transformers_engine.device_memory import vmm_supported

    assert "not a CUDA device" in vmm_supported("cpu")
    with pytest.raises(ConfigError, match="remappable_kv_cache='yes'"):
        TransformersEngineConfig(remappable_kv_cache="yes")  # type: ignore[arg-type]
    engine = setup[0]
    if engine.device.type == "cpu":  # today's cache: a torch tensor, dropped on sleep
        assert not engine.remappable_kv and "not a CUDA device" in engine.kv_vmm_fallback
        assert engine.runner.kv_mapped_bytes == 0
    with pytest.raises(ValueError, match="remappable_kv_cache=True, but on cpu"):  # before the model loads
        TransformersEngine(engine.model_dir, max_model_len=MAX_MODEL_LEN, device="cpu", remappable_kv_cache=True)


@needs_cuda
def test_level1_sleep_keeps_cuda_graphs_over_a_remapped_kv_cache(setup):
    """GPU: a level-1 sleep gives the KV cache's memory back to the device, and the wake-up maps new memory at the
    same addresses: the CUDA graphs replay as they are (no capture), and generation equals the one before. A
    level-2 sleep (from awake, or deepening a level-1 one) drops the graphs (the weights move): they are captured
    again, and generation is still the same."""
    model_dir = setup[0].model_dir
    dev = torch.device("cuda", torch.cuda.current_device())
    # 2048 slots of 256 KiB: a 512 MiB cache, well above what else moves in mem_get_info
    engine = TransformersEngine(
        model_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=2048, kv_cache_memory_bytes=2**29, device=dev
    )
    try:
        assert engine.remappable_kv and engine.kv_vmm_fallback is None, engine.kv_vmm_fallback
        assert engine.use_graphs and engine.kv_cache_bytes == 2**29
        params = SamplingParams(max_tokens=20, temperature=0.9, n=4, seed=77)
        ref_tok, ref_lp = _tokens_and_logprobs(engine.generate(PROMPTS, params, 0))
        assert not engine.graph_failures
        captures = engine.stats["graph_captures"]
        ptr = engine.runner.kv.data_ptr()
        assert captures > 0 and engine.memory()["kv_cache_bytes"] == engine.kv_cache_bytes
        reserved = engine.memory()["reserved_bytes"]
        assert reserved >= torch.cuda.memory_reserved(dev) + engine.kv_cache_bytes  # the VMM cache counted

        torch.cuda.synchronize(dev)
        free_awake = torch.cuda.mem_get_info(dev)[0]
        engine.sleep(1)
        freed = torch.cuda.mem_get_info(dev)[0] - free_awake
        assert freed >= 0.9 * engine.kv_cache_bytes, (freed, engine.kv_cache_bytes)
        assert engine.runner.kv is None and engine.memory()["kv_cache_bytes"] == 0
        assert engine.runner._graphs and engine.runner.logits_buf is not None  # kept for the wake-up
        assert engine.runner.asleep_kept_bytes < 2**30
        engine.wake_up()
        assert engine.runner.kv.data_ptr() == ptr
        tok, lp = _tokens_and_logprobs(engine.generate(PROMPTS, params, 0))
        assert engine.stats["graph_captures"] == captures, "the wake-up recaptured CUDA graphs"
        assert tok == ref_tok and lp == ref_lp

        for levels in ((2,), (1, 2)):
            before = engine.stats["graph_captures"]
            for level in levels:
                engine.sleep(level)
            assert engine.sleep_level == 2 and not engine.runner._graphs
            tok, lp = _tokens_and_logprobs(engine.generate(PROMPTS, params, 0))
            assert engine.stats["graph_captures"] > before and engine.runner.kv.data_ptr() == ptr
            assert tok == ref_tok, levels
            for a, b in zip(lp, ref_lp, strict=True):
                for x, y in zip(a, b, strict=True):
                    torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=ATOL, rtol=0)
    finally:
        engine.shutdown()


class _HostRemappable:
    """A stand-in for `RemappableBuffer` on the host: fixed storage, filled with NaN on every `map()` (what new
    device memory may hold), so the engine's sleep / wake sequencing runs on CPU."""

    def __init__(self, nbytes, device_index):
        self.nbytes, self.mapped, self.maps = nbytes, False, 0
        self.storage = torch.empty(nbytes // 4, dtype=torch.float32)

    def map(self):
        if not self.mapped:
            self.storage.fill_(float("nan"))
            self.mapped, self.maps = True, self.maps + 1

    def unmap(self):
        self.mapped = False

    def tensor(self, shape, dtype):
        assert self.mapped and dtype == torch.float32
        return self.storage[: math.prod(shape)].view(shape)

    def close(self):
        self.mapped = False


def test_sleep_wake_sequencing_over_a_remappable_cache_on_host(setup, monkeypatch):
    """The runner's VMM path (CPU, a host stand-in for the buffer): a level-1 sleep unmaps the cache and keeps the
    decode logits; the wake-up re-maps and zeroes it at the same address (generation equal, despite the NaN the
    new memory held); a level-2 sleep (also deepening a level-1 one) drops the logits too; memory() counts the
    mapped cache and reports 0 while asleep."""
    from meshrl.generation.transformers_engine import model_runner

    monkeypatch.setattr(model_runner, "vmm_supported", lambda device: None)
    monkeypatch.setattr(model_runner, "RemappableBuffer", _HostRemappable)
    engine = TransformersEngine(setup[0].model_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, device="cpu")
    try:
        runner = engine.runner
        assert engine.remappable_kv and engine.kv_vmm_fallback is None
        params = SamplingParams(max_tokens=12, temperature=0.9, n=2, seed=5)
        ref = _tokens_and_logprobs(engine.generate(PROMPTS, params, 0))
        ptr, logits = runner.kv.data_ptr(), runner.logits_buf
        assert engine.memory()["allocated_bytes"] == runner.kv_mapped_bytes == engine.kv_cache_bytes
        engine.sleep(1)
        assert runner.kv is None and not runner._kv_mem.mapped and runner.logits_buf is logits
        assert engine.memory()["kv_cache_bytes"] == 0 == engine.memory()["allocated_bytes"]
        assert _tokens_and_logprobs(engine.generate(PROMPTS, params, 0)) == ref  # woke up first
        assert runner.kv.data_ptr() == ptr and runner.logits_buf is logits and runner._kv_mem.maps == 2
        for levels in ((2,), (1, 2)):
            for level in levels:
                engine.sleep(level)
            assert runner.logits_buf is None and not runner._kv_mem.mapped
            engine.wake_up()
            assert runner.kv.data_ptr() == ptr and not runner.kv.isnan().any()
            assert _tokens_and_logprobs(engine.generate(PROMPTS, params, 0)) == ref
    finally:
        engine.shutdown()
    assert runner._kv_mem is None
