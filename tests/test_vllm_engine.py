"""VLLMEngine against transformers on a tiny random Qwen3 (CPU, fp32, no hub access).

One engine is started for the whole module (start-up dominates the cost). The weight-update test restores the
original weights before it returns, so test order does not matter.

That engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the CPU default here), where
`collective_rpc` args are passed as they are. One test starts a multiprocess engine in a fresh interpreter (the
GPU default: args cross to the engine-core process as untyped msgpack, then pickled to the worker process) so
the weight loads go through the real serialisation path.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from meshrl.generation.vllm_engine import VLLMEngine  # noqa: E402
from meshrl.generation.vllm_worker_ext import decode_object, decode_weights, encode_object, encode_weights  # noqa: E402
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

    engine = VLLMEngine(model_dir, max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=64 * 2**20)
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


# ---- collective_rpc payloads: what survives vLLM's multiprocess engine ------------------------------------------


def _untyped_msgpack_roundtrip(args: tuple) -> list:
    """What a multiprocess engine core receives for `collective_rpc(method, args=args)`: the utility call goes
    through vLLM's MsgpackEncoder and an untyped MsgpackDecoder."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    frames = MsgpackEncoder().encode((0, 1, "collective_rpc", ("m", None, args, None)))
    return MsgpackDecoder().decode(frames)[3][2]


def test_weight_payload_round_trips_exactly_through_untyped_msgpack():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(64, 32, generator=g)
    weights = {
        "bf16": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "fp32": torch.randn(3, generator=g),
        "fp16.t": torch.randn(4, 6, generator=g).half().t(),  # non-contiguous
        "int": torch.arange(10, dtype=torch.int64),
        "scalar": torch.tensor(2.5, dtype=torch.bfloat16),
        "view": big[10:12],  # a view of a larger storage: only its own bytes travel
    }
    blobs = encode_weights(weights.items(), chunk_bytes=200)  # small chunks: several blobs, one tensor each
    assert len(blobs) > 1 and all(isinstance(b, bytes) for b in blobs)
    assert sum(map(len, blobs)) < big.numel() * 4  # the view did not drag its whole storage along
    (received,) = _untyped_msgpack_roundtrip((blobs,))
    got = list(decode_weights(received))
    assert [n for n, _ in got] == list(weights)
    for (_, t), ref in zip(got, weights.values(), strict=True):
        assert t.dtype == ref.dtype and t.shape == ref.shape and t.device.type == "cpu"
        assert torch.equal(t, ref)
    assert len(encode_weights(weights.items())) == 1  # default chunking: one blob for a small model
    # Already-decoded pairs (a caller inside the worker) pass through unchanged.
    assert list(decode_weights(weights.items())) == list(weights.items())

    # The bug this guards against: raw tensors do not survive the same trip.
    (raw,) = _untyped_msgpack_roundtrip(([("bf16", weights["bf16"])],))
    assert not isinstance(raw[0][1], torch.Tensor)


def test_ipc_handle_round_trips_through_untyped_msgpack():
    from meshrl.weight_sync.shared_buffer import SharedBufferHandle, SharedBufferSender

    sd = {"a": torch.randn(4, 4).to(torch.bfloat16), "b": torch.arange(3)}
    sender = SharedBufferSender.for_state_dict(sd, "cpu", dtype=torch.bfloat16)
    try:
        handle = sender.handle()
        blob, version = _untyped_msgpack_roundtrip((encode_object(handle), 4))
        got = decode_object(blob)
        assert isinstance(got, SharedBufferHandle) and got == handle and version == 4
        assert got.layout.specs[0].dtype == "bfloat16" and got.buffer[0] == "shm"
        assert decode_object(handle) is handle  # an unencoded handle passes through
        (dict_handle, _) = _untyped_msgpack_roundtrip((handle, 4))
        assert isinstance(dict_handle, dict)  # the bug: a dataclass arrives as a dict
    finally:
        sender.close()


def _multiprocess_child(model_dir: str, workdir: str) -> None:
    """Runs in a fresh interpreter with VLLM_ENABLE_V1_MULTIPROCESSING=1 (see the test below)."""
    from meshrl.weight_sync.shared_buffer import SharedBufferSender

    data = torch.load(os.path.join(workdir, "in.pt"))
    engine = VLLMEngine(model_dir, max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=64 * 2**20)
    out: dict = {"client": type(engine.llm.llm_engine.engine_core).__name__}
    seqs = data["seqs"]
    out["a0"] = engine.prompt_logprobs(seqs)
    engine.load_weights(data["sd_b"])  # host path: tensors through collective_rpc
    out["b_host"] = engine.prompt_logprobs(seqs)
    sender = SharedBufferSender.for_state_dict(data["sd_a"], "cpu", dtype=torch.float32)  # 'shm' transport
    try:
        sender.publish(data["sd_a"], 5)
        out["v_latest"] = engine.load_weights_ipc(sender.handle())
        out["a_ipc"] = engine.prompt_logprobs(seqs)
        sender.publish(data["sd_b"], 6)
        out["v_6"] = engine.load_weights_ipc(sender.handle(), 6)
        out["b_ipc"] = engine.prompt_logprobs(seqs)
    finally:
        sender.close()
        engine.shutdown()
    torch.save(out, os.path.join(workdir, "out.pt"))


@pytest.mark.slow
def test_multiprocess_engine_loads_weights_through_collective_rpc(setup, tmp_path):
    """A multiprocess engine (engine core and worker in their own processes, as on GPU): `load_weights` and
    `load_weights_ipc` over the 'shm' shared buffer both reach the worker intact and change its logprobs."""
    engine, model_a, eos = setup
    model_b = _make_model(1, eos_token_id=eos)
    tied = lambda m: {k: v for k, v in m.state_dict().items() if k != "lm_head.weight"}  # noqa: E731
    g = torch.Generator().manual_seed(3)
    seqs = [[5, 6, 7, 8, 9, 10, 11], torch.randint(0, VOCAB, (40,), generator=g).tolist()]
    torch.save({"sd_a": tied(model_a), "sd_b": tied(model_b), "seqs": seqs}, tmp_path / "in.pt")
    ref_a = [_hf_logprobs(model_a, s[:1], s[1:]) for s in seqs]
    ref_b = [_hf_logprobs(model_b, s[:1], s[1:]) for s in seqs]

    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import sys; sys.path.insert(0, {here!r}); import test_vllm_engine as t; t._multiprocess_child(*sys.argv[1:])"
    )
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, engine.model_dir, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = torch.load(tmp_path / "out.pt")
    assert out["client"] == "SyncMPClient"  # really the multiprocess engine
    assert (out["v_latest"], out["v_6"]) == (5, 6)
    for key, ref in (("a0", ref_a), ("b_host", ref_b), ("a_ipc", ref_a), ("b_ipc", ref_b)):
        for lp, r in zip(out[key], ref, strict=True):
            torch.testing.assert_close(torch.tensor(lp), r, atol=ATOL, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
    assert max(abs(x - y) for x, y in zip(out["a0"][1], out["b_host"][1], strict=True)) > 0.1


def test_seeded_batch_larger_than_one_scheduler_step(setup):
    """More prompt tokens than vLLM schedules in one step (4096 on CPU): with chunked prefill a seeded request would
    be prefilled in parts, and vLLM-CPU's sampler then crashes rewinding its generator ('CPU Generator does not use
    offset'). The engine schedules whole prompts only, so such a batch samples, reproducibly."""
    engine, _, _ = setup
    prompts = [[4 + (i + j) % (VOCAB - 4) for j in range(MAX_MODEL_LEN - 8)] for i in range(24)]
    params = SamplingParams(max_tokens=4, temperature=1.0, n=8, seed=7)
    assert len(prompts) * params.n * len(prompts[0]) > 4096
    out = engine.generate(prompts, params, policy_version=0)
    assert [len(c) for c in out] == [8] * 24 and all(c.token_ids for group in out for c in group)
    again = engine.generate(prompts, params, policy_version=0)
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in out]
