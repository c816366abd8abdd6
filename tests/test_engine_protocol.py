"""Both engines behind one `Engine` protocol, each with its config passed whole; the transformers engine's sleep mode
(free the KV cache, re-allocate it) leaves generation unchanged; memory is reported per process. CPU, a tiny random
Qwen3 made here (no hub access)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from meshrl.config import ConfigError, GeneratorConfig  # noqa: E402
from meshrl.generation import TransformersEngineConfig, VLLMEngineConfig  # noqa: E402
from meshrl.generation.base import DEFAULT_CPU_KV_CACHE_BYTES, Engine  # noqa: E402
from meshrl.generation.transformers_engine import TransformersEngine  # noqa: E402
from meshrl.types import SamplingParams  # noqa: E402

torch.set_num_threads(1)

VOCAB = 48
MAX_LEN = 512
PROMPTS = [[5, 6, 7], [20, 21, 22, 23], [3], [40, 2, 17, 9, 33]]
MEMORY_KEYS = {"device", "allocated_bytes", "reserved_bytes", "rss_bytes", "sleep_level"}


def _model(seed: int):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=MAX_LEN, tie_word_embeddings=True,
        initializer_range=0.3, eos_token_id=1, pad_token_id=0, bos_token_id=None,
    )  # fmt: skip
    return transformers.Qwen3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_qwen3_protocol"))
    _model(0).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    # kv_cache_memory_bytes=None: 64 MiB on CPU; max_num_seqs=None: 256, lowered to what 64 MiB holds.
    engine = TransformersEngine(model_dir, max_model_len=MAX_LEN)
    yield engine
    engine.shutdown()


def _tokens(groups):
    return [[c.token_ids for c in g] for g in groups]


def _logprobs(groups):
    return [[c.logprobs for c in g] for g in groups]


def test_transformers_engine_satisfies_the_protocol_and_resolves_cpu_defaults(engine):
    assert isinstance(engine, Engine)
    assert not engine.loads_in_workers and engine.supports_sleep and engine.sleep_level == 0
    assert engine.device == torch.device("cpu")
    per_slot = 2 * 2 * 2 * MAX_LEN * 32 * 4  # K and V x layers x kv heads x positions x head_dim x fp32
    assert engine.num_slots == DEFAULT_CPU_KV_CACHE_BYTES // per_slot == 128  # not 256: the 64 MiB default binds
    assert engine.kv_cache_bytes == DEFAULT_CPU_KV_CACHE_BYTES
    # TransformersEngineConfig's None / 'auto' on CPU: matmul attention, the model's own norms, no CUDA graphs.
    assert (engine.attn_impl, engine.fused_norm, engine.use_graphs) == ("matmul", False, False)
    mem = engine.memory()
    assert MEMORY_KEYS | {"kv_cache_bytes"} <= set(mem)
    assert mem["device"] == "cpu" and mem["allocated_bytes"] == mem["reserved_bytes"] == 0  # torch's CUDA counters
    assert mem["rss_bytes"] > 2**20 and mem["kv_cache_bytes"] == DEFAULT_CPU_KV_CACHE_BYTES


def test_sleep_then_wake_generates_the_same(engine):
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    sampled = SamplingParams(max_tokens=12, temperature=0.9, n=3, seed=11)
    ref_g, ref_s = engine.generate(PROMPTS, greedy, 0), engine.generate(PROMPTS, sampled, 0)

    engine.sleep(1)
    assert engine.sleep_level == 1 and engine.runner.kv is None
    assert engine.memory()["kv_cache_bytes"] == 0 and engine.memory()["sleep_level"] == 1
    engine.wake_up()
    assert engine.sleep_level == 0 and engine.memory()["kv_cache_bytes"] == engine.kv_cache_bytes
    got_g, got_s = engine.generate(PROMPTS, greedy, 0), engine.generate(PROMPTS, sampled, 0)
    assert _tokens(got_g) == _tokens(ref_g) and _tokens(got_s) == _tokens(ref_s)
    assert _logprobs(got_g) == _logprobs(ref_g) and _logprobs(got_s) == _logprobs(ref_s)

    # generate on a sleeping engine (either level) wakes it first; level 2 keeps the weights (in host memory).
    for level in (1, 2):
        engine.sleep(level)
        assert engine.sleep_level == level
        assert _tokens(engine.generate(PROMPTS, sampled, 0)) == _tokens(ref_s)
        assert engine.sleep_level == 0
    seqs = [p + c.token_ids for p, (c,) in zip(PROMPTS, ref_g, strict=True)]
    ref_lp = engine.prompt_logprobs(seqs)
    engine.sleep(2)
    assert engine.prompt_logprobs(seqs) == ref_lp and engine.sleep_level == 0  # scoring wakes it too
    with pytest.raises(ValueError, match="sleep level 3"):
        engine.sleep(3)


@pytest.mark.parametrize("level", [1, 2])
def test_weights_load_while_asleep(engine, level):
    """Colocated RL: the engine sleeps while the trainer trains, the new weights arrive, then it generates."""
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    model_a, model_b = _model(0), _model(1)
    before = engine.generate(PROMPTS, greedy, 0)
    engine.sleep(level)
    try:
        engine.load_weights({k: v for k, v in model_b.state_dict().items() if k != "lm_head.weight"})
        assert engine.sleep_level == level  # loading does not wake it
        engine.wake_up()
        after = engine.generate(PROMPTS, greedy, 1)
        assert _tokens(after) != _tokens(before)
        for p, g in zip(PROMPTS, after, strict=True):  # exactly model B's greedy continuation
            ids = torch.tensor([p])
            ref = model_b.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
            assert g[0].token_ids == ref[0, len(p) :].tolist()
    finally:
        engine.load_weights(model_a.state_dict())
    assert _tokens(engine.generate(PROMPTS, greedy, 2)) == _tokens(before)


def test_load_weights_ipc_from_a_shared_buffer(engine):
    from meshrl.weight_sync.shared_buffer import SharedBufferSender

    base = {k: v.clone() for k, v in engine.model.state_dict().items()}
    new = {k: v + 0.25 for k, v in base.items() if k != "lm_head.weight"}
    sender = SharedBufferSender.for_state_dict(new, "cpu", dtype=torch.float32)
    try:
        sender.publish(new, 3)
        engine.sleep(1)
        assert engine.load_weights_ipc(sender.handle(), 3) == 3
        params = engine.model.state_dict()
        assert all(torch.equal(params[k], v) for k, v in new.items())
    finally:
        engine.load_weights(base)
        engine.wake_up()
        sender.close()


def test_configs_name_the_flag():
    cases = [
        (lambda: TransformersEngineConfig(attn_impl="flash"), "generator.transformers.attn_impl='flash'"),  # type: ignore[arg-type]
        (lambda: TransformersEngineConfig(sync_every=0), "generator.transformers.sync_every=0"),
        (lambda: VLLMEngineConfig(gpu_memory_utilization=1.5), r"generator.vllm.gpu_memory_utilization=1.5"),
        (lambda: VLLMEngineConfig(tensor_parallel_size=0), "generator.vllm.tensor_parallel_size=0"),
        (lambda: GeneratorConfig(kv_cache_memory_bytes=0), "generator.kv_cache_memory_bytes=0"),
        (lambda: GeneratorConfig(max_num_seqs=0), "generator.max_num_seqs=0"),
        (lambda: GeneratorConfig(vllm=VLLMEngineConfig(max_num_batched_tokens=0)), "max_num_batched_tokens=0"),
    ]
    for make, message in cases:
        with pytest.raises(ConfigError, match=message):
            make()
    with pytest.warns(DeprecationWarning, match="generator.vllm.gpu_memory_utilization"):
        cfg = GeneratorConfig(gpu_memory_utilization=0.7)
    assert cfg.vllm.gpu_memory_utilization == 0.7
    # Engines take their config whole, and its fields as keyword overrides.
    base = TransformersEngineConfig(cuda_graphs=False)
    assert dataclasses.replace(base, attn_impl="sdpa") == TransformersEngineConfig(cuda_graphs=False, attn_impl="sdpa")


def test_cli_reaches_the_engine_configs():
    from meshrl.config import GRPORunConfig
    from meshrl.controller.cli import parse_run_config

    cfg = parse_run_config(
        GRPORunConfig,
        argv=[
            "--generator.vllm.enforce-eager", "True", "--generator.vllm.tensor-parallel-size", "2",
            "--generator.transformers.attn-impl", "sdpa", "--generator.transformers.no-cuda-graphs",
            "--generator.max-num-seqs", "32",
        ],
    )  # fmt: skip
    g = cfg.generator
    assert g.vllm.enforce_eager is True and g.vllm.tensor_parallel_size == 2
    assert g.transformers.attn_impl == "sdpa" and g.transformers.cuda_graphs is False and g.max_num_seqs == 32


def test_settings_of_the_engine_not_used_are_named():
    """--generator.transformers.* with the vllm engine (and the reverse) does nothing: a warning says which
    settings and the flag that would use them."""
    import warnings

    with pytest.warns(UserWarning, match=r"transformers.kv_cache_dtype='fp8' set, but generator.engine='vllm'.*"
                      r"--generator.engine transformers"):  # fmt: skip
        GeneratorConfig(transformers=TransformersEngineConfig(kv_cache_dtype="fp8"))
    with pytest.warns(UserWarning, match=r"vllm.tensor_parallel_size=2 set, but generator.engine='transformers'"):
        GeneratorConfig(engine="transformers", vllm=VLLMEngineConfig(tensor_parallel_size=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GeneratorConfig(engine="transformers", transformers=TransformersEngineConfig(kv_cache_dtype="fp8"))


def test_vllm_engine_satisfies_the_protocol_on_cpu(model_dir):
    """The one vLLM build of this file: CPU defaults (eager, 64 MiB cache, no sleep mode), sleep / wake no-ops."""
    pytest.importorskip("vllm")
    from meshrl.generation.vllm_engine import VLLMEngine

    with pytest.raises(ConfigError, match="generator.vllm.enable_sleep_mode=True"):
        VLLMEngine(model_dir, enable_sleep_mode=True)  # refused before vLLM is even imported
    engine = VLLMEngine(model_dir, VLLMEngineConfig(), max_model_len=64, max_num_seqs=8)
    try:
        assert isinstance(engine, Engine)
        assert engine.loads_in_workers and not engine.supports_sleep and engine.device == torch.device("cpu")
        vcfg = engine.llm.llm_engine.vllm_config
        assert vcfg.model_config.enforce_eager is True
        assert vcfg.cache_config.kv_cache_memory_bytes == DEFAULT_CPU_KV_CACHE_BYTES
        assert vcfg.scheduler_config.max_num_seqs == 8
        greedy = SamplingParams(max_tokens=6, temperature=0.0)
        ref = engine.generate(PROMPTS, greedy, 0)
        engine.sleep(1)  # a documented no-op on CPU
        assert engine.sleep_level == 0 and MEMORY_KEYS <= set(engine.memory())
        engine.wake_up()
        assert _tokens(engine.generate(PROMPTS, greedy, 0)) == _tokens(ref)
    finally:
        engine.shutdown()


def test_generator_actor_sleep_wake_memory(model_dir):
    from monarch.actor import this_host

    from meshrl.actors.generator import Generator

    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        cfg = GeneratorConfig(engine="transformers", max_model_len=64, max_tokens=8)
        gen = procs.spawn("protocol_generator", Generator, model_dir, cfg, 0)
        info = gen.setup.call_one().get(timeout=120)
        assert info["supports_sleep"] is True and info["device_identity"].startswith("cpu")
        greedy = SamplingParams(max_tokens=8, temperature=0.0)
        ref = gen.generate.call_one(PROMPTS, greedy).get(timeout=60)
        awake = gen.memory.call_one().get(timeout=60)
        asleep = gen.sleep.call_one(1).get(timeout=60)
        assert MEMORY_KEYS <= set(awake) and awake["kv_cache_bytes"] > 0
        assert asleep["sleep_level"] == 1 and asleep["kv_cache_bytes"] == 0
        # generate wakes the engine by itself
        assert _tokens(gen.generate.call_one(PROMPTS, greedy).get(timeout=60)) == _tokens(ref)
        assert gen.memory.call_one().get(timeout=60)["sleep_level"] == 0
        gen.sleep.call_one(2).get(timeout=60)
        assert gen.wake_up.call_one().get(timeout=60)["sleep_level"] == 0
    finally:
        procs.stop().get(timeout=60)
