"""Weight sync without a gather (meshrl.weight_sync.shards): each trainer rank packs only what it holds of every
tensor, and the pieces of all ranks put back together equal the whole tensors, for real DTensors on two gloo ranks
(even and uneven Shard(0), Shard(1), Replicate, a rank holding nothing of a tensor) and for chunk sizes that split
tensors; the controller's torchstore sync publishes from every trainer rank."""

from __future__ import annotations

import asyncio
import io
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshrl.weight_sync.shards import assemble, pack, renamed_only


def _whole() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(7, 6, generator=g),  # uneven over 2 ranks: 4 + 3 rows
        "wide": torch.randn(4, 5, generator=g),  # Shard(1)
        "one_row": torch.randn(1, 8, generator=g),  # rank 1 holds nothing of it
        "norm": torch.rand(6, generator=g),  # replicated
        "count": torch.tensor(3),  # a plain tensor: rank 0 publishes it
        "mask": torch.tensor([True, False, True]),
    }


CHUNK_SIZES = (16 * 2**20, 32)  # one chunk for everything; 32-byte chunks that split tensors over many


def _rank_main(rank: int, port: int, out) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    whole = _whole()
    placements = {"embed": Shard(0), "wide": Shard(1), "one_row": Shard(0), "norm": Replicate()}
    sd = {k: distribute_tensor(v, mesh, [placements[k]]) if k in placements else v for k, v in whole.items()}
    packed = {n: pack(sd, rank, torch.bfloat16, n) for n in CHUNK_SIZES}
    buf = io.BytesIO()  # bytes, not tensors: a tensor through a queue is shared memory that dies with this process
    torch.save((rank, packed), buf)
    out.put(buf.getvalue())
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks() -> dict[int, list]:
    """{chunk size: [(rank, table, chunks) of rank 0, of rank 1]}, packed by two real gloo ranks."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    received = [torch.load(io.BytesIO(out.get(timeout=120)), weights_only=False) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    received.sort(key=lambda r: r[0])
    return {n: [(rank, *packed[n]) for rank, packed in received] for n in CHUNK_SIZES}


def _expected() -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in _whole().items()}


@pytest.mark.parametrize("chunk_bytes", CHUNK_SIZES)
def test_two_ranks_pieces_put_back_together_equal_the_whole(two_ranks, chunk_bytes):
    results = two_ranks[chunk_bytes]
    tables = [t for _, t, _ in results]
    chunks = {(rank, i): c for rank, _, cs in results for i, c in enumerate(cs)}
    got = assemble(tables, chunks)
    want = _expected()
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    held = {rank: {p.name for p in t.pieces} for rank, t, _ in results}
    # each rank published only its part: the replicated and plain tensors once, nothing twice
    assert held[0] == {"embed", "wide", "one_row", "norm", "count", "mask"}
    assert held[1] == {"embed", "wide"}
    assert tables[0].nbytes + tables[1].nbytes == sum(v.numel() * v.element_size() for v in want.values())
    if chunk_bytes == 32:  # 32-byte chunks split 'embed' (12 bytes a row in bf16) into several pieces
        assert len({p.chunk for p in tables[0].pieces}) > 3
        assert sum(p.name == "embed" for p in tables[0].pieces) > 1


def test_a_missing_rank_is_an_error_not_a_partial_tensor(two_ranks):
    results = two_ranks[CHUNK_SIZES[0]]
    rank0, table0, chunks0 = results[0]
    with pytest.raises(ValueError, match="embed: the ranks' pieces hold 24 of its 42"):
        assemble([table0], {(rank0, i): c for i, c in enumerate(chunks0)})


def test_one_process_plain_tensors_non_contiguous_and_cast():
    big = torch.randn(64, 48)
    sd = {"t": big.t(), "view": big[:16], "scalar": torch.tensor(2.5), "ids": torch.arange(5)}
    table, chunks = pack(sd, 0, torch.bfloat16, chunk_bytes=1024)
    assert all(c.dtype == torch.uint8 and c.untyped_storage().nbytes() == c.numel() for c in chunks)
    got = assemble([table], {(0, i): c for i, c in enumerate(chunks)})
    for k, v in sd.items():
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert got[k].dtype == want.dtype and torch.equal(got[k], want), k
    # the buffers come back for the next version and are reused
    _, again = pack(sd, 0, torch.bfloat16, chunk_bytes=1024, buffers=chunks)
    assert [c.data_ptr() for c in again] == [c.data_ptr() for c in chunks]


def test_renamed_only():
    a, b = torch.zeros(2), torch.ones(2)
    assert renamed_only({"x": a, "y": b}, {"model.x": a, "model.y": b})
    assert not renamed_only({"x": a, "y": b}, {"xy": torch.cat([a, b])})


@pytest.mark.slow
def test_controller_sync_publishes_from_every_trainer_rank(ctl):
    """The session's Controller has two trainer ranks (FSDP2): over torchstore each publishes its own shards."""
    from meshrl.weight_sync.store import version_tables

    ctl.sync_weights()  # a no-op when an earlier test synced this version: it is still in the store
    assert ctl.weights.transport == "torchstore"
    tables = asyncio.run(version_tables(ctl.weights.last_synced, store_name=ctl.store_name))
    assert [t.rank for t in tables] == [0, 1]
    assert all(t.nbytes > 0 for t in tables)
    # FSDP2 halves every weight: no rank holds much more than half
    total = sum(t.nbytes for t in tables)
    assert max(t.nbytes for t in tables) < 0.6 * total


def test_engine_loads_blocks_straight_into_its_weights(base_model_dir):
    """The transformers engine copies each tensor's blocks into the slices they cover (no whole tensor first): two
    "ranks" holding the first and second half of every weight's rows (FSDP2's Shard(0)), and every weight changed."""
    from meshrl.generation.transformers_engine import TransformersEngine
    from meshrl.weight_sync.shards import whole_tensors

    engine = TransformersEngine(base_model_dir, max_model_len=32, max_num_seqs=2)
    try:
        g = torch.Generator().manual_seed(1)
        seen, new = set(), {}
        for k, v in engine.runner.params.items():  # tied weights (embedding and head) once, as the trainer sends
            if v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                new[k] = torch.randn(v.shape, generator=g).to(v.dtype)
        pieces = {}
        for k, v in new.items():
            cut = (v.shape[0] + 1) // 2
            zeros = (0,) * (v.dim() - 1)
            pieces[k] = (tuple(v.shape), v.dtype, [((0, *zeros), v[:cut]), ((cut, *zeros), v[cut:])])
        before = {k: t.detach().clone() for k, t in engine.runner.params.items()}
        engine.load_weight_pieces(pieces)
        for k, v in new.items():
            assert torch.equal(engine.runner.params[k].detach(), v), k
            assert not torch.equal(before[k], v), k
        assert all(torch.equal(t, new[k]) for k, t in whole_tensors(pieces).items())
    finally:
        engine.shutdown()
