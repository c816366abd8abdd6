"""Shared fixtures. Monarch process meshes are expensive on 2 cores, so one Controller (2 FSDP trainer
processes, 1 vLLM generator, 1 reward actor) is spawned per test session and reused."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no downloads at run time: a missing local file must fail, not fetch
# Actor processes inherit PYTHONPATH: user-written losses in tests/ (e.g. custom_algorithms.py) reach the trainer
# by name ('custom_algorithms:my_loss'), as a user's own module would.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")) if p
)
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    from meshrl.tokenizer import CharTokenizer

    return CharTokenizer("abcdefgh=")


@pytest.fixture(scope="session")
def base_model_dir(tmp_path_factory, tokenizer) -> str:
    from meshrl.models.qwen3 import create_random_checkpoint

    return str(
        create_random_checkpoint(tmp_path_factory.mktemp("base") / "model", flavor="tiny", tokenizer=tokenizer, seed=0)
    )


@pytest.fixture(scope="session")
def ctl(base_model_dir, tokenizer):
    from meshrl.config import GeneratorConfig, ModelConfig, TrainerConfig
    from meshrl.controller.api import Controller

    c = Controller(
        model_dir=base_model_dir,
        model_cfg=ModelConfig(),
        trainer_cfg=TrainerConfig(num_procs=2, micro_batch_size=4),
        generator_cfg=GeneratorConfig(max_model_len=48, max_tokens=8),
        tokenizer=tokenizer,
        reward_weights={"char_match": 1.0},
        call_timeout_s=120,
    )
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-rank gloo group for a `Policy` built in the test process (made before any vLLM engine, which then leaves
    it alone on shutdown)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def random_data(n: int, *, seed: int = 0, vocab: int = 13, prompt_len: int = 3, with_old: bool = True):
    """n Datum of varied lengths with random tokens, advantages and generator logprobs."""
    from meshrl.types import Datum

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        n_resp = 2 + (i * 3) % 6
        toks = torch.randint(4, vocab, (prompt_len + n_resp,), generator=g).tolist()
        old = (-torch.rand(n_resp, generator=g) * 3).tolist() if with_old else None
        adv = float(torch.randn(1, generator=g))
        out.append(Datum.from_completion(toks[:prompt_len], toks[prompt_len:], old, adv))
    return out
