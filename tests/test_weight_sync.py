"""Weight sync over torchstore with real Monarch processes (2-proc actor mesh + storage volume).

The controller (this pytest process) owns the store; rank 0 of the mesh plays the trainer
(pushes), rank 1 the generator (pulls), so every round trip crosses processes.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import cloudpickle
import pytest
import torch
from monarch.actor import Actor, endpoint, this_host

from meshrl.weight_sync import (
    WeightVersionNotFound,
    delete_weights,
    init_weight_store,
    latest_version,
    list_versions,
    pull_weights,
    push_weights,
    shutdown_weight_store,
    weights_key,
)

pytestmark = pytest.mark.slow

# pytest imports this file as a top-level module the spawned processes cannot import;
# ship the actor class by value instead of by reference.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

STORE = "meshrl-test"
T = 60  # seconds; every remote wait is bounded so a broken actor fails instead of hanging


def make_state_dict(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(64, 48, generator=g)
    return {
        "embed.weight": torch.randn(100, 32, generator=g),
        "layers.0.attn.q_proj.weight": torch.randn(32, 32, generator=g),
        "layers.0.norm.weight": torch.rand(32, generator=g) + 0.5,
        "layers.0.mlp.weight_t": big.t(),  # non-contiguous view
        "layers.0.mlp.half": big[:16],  # view into a larger storage
        "step": torch.tensor(seed, dtype=torch.int64),  # non-float: never cast
    }


def cast(sd: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in sd.items()}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k


class WeightSyncTester(Actor):
    def __init__(self) -> None:
        torch.set_num_threads(1)

    @endpoint
    async def push(self, seed: int, version: int, dtype: torch.dtype | None, prefix: str) -> int:
        return await push_weights(make_state_dict(seed), version, dtype=dtype, store_name=STORE, prefix=prefix)

    @endpoint
    async def pull(self, version: int, prefix: str) -> dict[str, torch.Tensor]:
        return await pull_weights(version, store_name=STORE, prefix=prefix)

    @endpoint
    async def pull_error(self, version: int, prefix: str) -> tuple[str, str]:
        try:
            await pull_weights(version, store_name=STORE, prefix=prefix)
        except Exception as e:
            return type(e).__name__, str(e)
        return "", ""

    @endpoint
    async def push_error(self, seed: int, version: int, prefix: str) -> tuple[str, str]:
        try:
            await push_weights(make_state_dict(seed), version, store_name=STORE, prefix=prefix)
        except Exception as e:
            return type(e).__name__, str(e)
        return "", ""

    @endpoint
    async def latest(self, prefix: str) -> int | None:
        return await latest_version(store_name=STORE, prefix=prefix)

    @endpoint
    async def versions(self, prefix: str) -> list[int]:
        return await list_versions(store_name=STORE, prefix=prefix)

    @endpoint
    async def delete(self, version: int, prefix: str) -> None:
        await delete_weights(version, store_name=STORE, prefix=prefix)


@pytest.fixture(scope="module")
def ranks():
    procs = this_host().spawn_procs(per_host={"procs": 2})
    try:
        mesh = procs.spawn("weight_sync_tester", WeightSyncTester)
        asyncio.run(asyncio.wait_for(init_weight_store(STORE), T))
        yield mesh.slice(procs=0), mesh.slice(procs=1)
    finally:
        try:
            asyncio.run(asyncio.wait_for(shutdown_weight_store(STORE), T))
        finally:
            procs.stop().get(timeout=T)


def test_weights_key():
    assert weights_key(3) == "policy/v3"
    assert weights_key(0, prefix="ref") == "ref/v0"
    with pytest.raises(ValueError):
        weights_key(-1)


def test_bf16_roundtrip_across_processes(ranks):
    trainer, generator = ranks
    want = cast(make_state_dict(1), torch.bfloat16)
    nbytes = trainer.push.call_one(1, 1, torch.bfloat16, "rt").get(timeout=T)
    assert nbytes == sum(v.numel() * v.element_size() for v in want.values())
    got = generator.pull.call_one(1, "rt").get(timeout=T)
    assert_same(got, want)
    assert got["embed.weight"].dtype == torch.bfloat16 and got["step"].dtype == torch.int64
    # the controller process can pull too
    assert_same(asyncio.run(asyncio.wait_for(pull_weights(1, store_name=STORE, prefix="rt"), T)), want)


def test_versions(ranks):
    trainer, generator = ranks
    assert generator.latest.call_one("ver").get(timeout=T) is None
    trainer.push.call_one(10, 1, torch.bfloat16, "ver").get(timeout=T)
    assert generator.latest.call_one("ver").get(timeout=T) == 1
    trainer.push.call_one(20, 2, None, "ver").get(timeout=T)  # no cast: stays fp32
    assert generator.latest.call_one("ver").get(timeout=T) == 2
    assert_same(generator.pull.call_one(2, "ver").get(timeout=T), make_state_dict(20))
    assert_same(generator.pull.call_one(1, "ver").get(timeout=T), cast(make_state_dict(10), torch.bfloat16))
    assert generator.versions.call_one("ver").get(timeout=T) == [1, 2]
    # re-pushing a complete version is refused (a reader could otherwise see a mix)
    err, msg = trainer.push_error.call_one(30, 2, "ver").get(timeout=T)
    assert err == "ValueError" and "already pushed" in msg


def test_missing_version_raises_fast(ranks):
    _, generator = ranks
    t0 = time.perf_counter()
    err, msg = generator.pull_error.call_one(12345, "rt").get(timeout=T)
    assert err == WeightVersionNotFound.__name__ and "rt/v12345" in msg
    assert time.perf_counter() - t0 < 5
    with pytest.raises(WeightVersionNotFound):
        asyncio.run(asyncio.wait_for(pull_weights(777, store_name=STORE, prefix="nothing-here"), T))


def _shm_files() -> int:
    """Chunks the storage volume holds in /dev/shm (meshrl.weight_sync.torchstore_shm: one file per chunk)."""
    from meshrl.weight_sync.shared_buffer import shm_dir

    return len([n for n in os.listdir(shm_dir()) if n.startswith("meshrl-wsync-") and "-ts-" in n])


def test_delete(ranks):
    trainer, generator = ranks
    files = _shm_files()
    trainer.push.call_one(5, 1, None, "del").get(timeout=T)
    trainer.push.call_one(6, 2, None, "del").get(timeout=T)
    assert _shm_files() == files + 2  # one chunk each, through shared memory between the processes
    trainer.delete.call_one(1, "del").get(timeout=T)
    trainer.delete.call_one(1, "del").get(timeout=T)  # idempotent
    assert _shm_files() == files + 1  # a deleted version's files go with it
    assert generator.versions.call_one("del").get(timeout=T) == [2]
    err, _ = generator.pull_error.call_one(1, "del").get(timeout=T)
    assert err == WeightVersionNotFound.__name__
    assert_same(generator.pull.call_one(2, "del").get(timeout=T), make_state_dict(6))
    # the deleted version can be pushed again
    trainer.push.call_one(7, 1, None, "del").get(timeout=T)
    assert_same(generator.pull.call_one(1, "del").get(timeout=T), make_state_dict(7))
    assert generator.latest.call_one("del").get(timeout=T) == 2  # the marker is never lowered
