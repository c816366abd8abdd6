"""Weight sync into the shared buffer with one collective (meshrl.weight_sync.flat_gather): FSDP2 ranks pack their
shards into one flat buffer, one all-gather (or gather) brings them to rank 0, which copies each tensor's pieces
into the shared buffer. The buffer's bytes must equal what publishing the whole tensors gives, bitwise: checked on
real FSDP2 (`fully_shard`) shards over 2 and 3 gloo ranks (uneven chunks, ranks holding nothing of a tensor, a
plain buffer) into real CPU-backed SharedBufferSenders, in bf16 and fp32, and through `Policy.publish_weights_ipc`;
and in one process, the index arithmetic of packing and unpacking against `torch.chunk`'s shards."""

from __future__ import annotations

import pytest
import torch
from procs import free_port, run_ranks

from meshrl.weight_sync.flat_gather import GatherPlan, shard_rows
from meshrl.weight_sync.shared_buffer import ALIGN, FlatLayout

DTYPES = (torch.bfloat16, torch.float32)


def _whole(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": torch.randn(7, 5, generator=g),  # 2 ranks: 4 + 3 rows; 3 ranks: 3 + 3 + 1
        "two_rows": torch.randn(2, 3, generator=g),  # 3 ranks: 1 + 1 + 0
        "four_rows": torch.randn(4, 6, generator=g),  # 3 ranks: 2 + 2 + 0 (torch.chunk makes two chunks)
        "one_row": torch.randn(1, generator=g),  # fewer rows than ranks: rank 0 holds all of it
        "vec": torch.randn(11, generator=g),
        "cube": torch.randn(5, 2, 3, generator=g),  # 3-D: rows of 6 elements
        "count": torch.tensor([3, 1, 4]),  # not floating point: keeps its dtype
        "scale": torch.rand(3, generator=g),  # not sharded: rank 0 copies its own
    }


def test_shard_rows_are_torch_chunks():
    for rows in range(0, 12):
        for ranks in range(1, 5):
            chunks = [c.numel() for c in torch.arange(rows).chunk(ranks)] if rows else []
            chunks += [0] * (ranks - len(chunks))  # torch.chunk may make fewer chunks; FSDP2 pads with empty shards
            got = [shard_rows(rows, ranks, r) for r in range(ranks)]
            assert [b - a for a, b in got] == chunks, (rows, ranks)
            assert all(a <= b for a, b in got) and (not got or got[-1][1] == rows)
            assert all(got[r][1] == got[r + 1][0] for r in range(ranks - 1))


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_and_unpack_put_uneven_chunks_back_in_place(ranks, dtype):
    """In one process: each 'rank' packs its torch.chunk shards, the send buffers are laid end to end as the
    all-gather lays them, and the unpacked slot equals FlatLayout.pack of the whole tensors, byte for byte."""
    whole = _whole()
    sharded = [k for k in whole if k not in ("count", "scale")]
    layout = FlatLayout.of(whole, dtype)
    plan = GatherPlan.build(layout, sharded, ranks)
    itemsize = dtype.itemsize
    for p in plan.sharded:
        assert p.chunk_rows == -(-p.rows // ranks) and p.send_offset % ALIGN == 0
        assert p.piece_nbytes == p.chunk_rows * p.row_numel * itemsize
    assert plan.sharded[-1].spec.name == "cube" and plan.sharded[-1].row_numel == 6
    assert [s.name for s in plan.whole] == ["count", "scale"]
    assert plan.send_nbytes == len(sharded) * ALIGN  # every piece here fits in one aligned block
    sends = []
    for r in range(ranks):
        send = torch.full((plan.send_nbytes,), 0xAB, dtype=torch.uint8)  # padding that must never be read
        local = {}
        for k in sharded:
            a, b = shard_rows(whole[k].shape[0], ranks, r)
            local[k] = whole[k][a:b]
        plan.pack(send, local, r)
        sends.append(send)
    recv = torch.cat(sends)
    got = torch.full((layout.nbytes,), 0x5A, dtype=torch.uint8)
    want = got.clone()
    plan.unpack(recv, got, {k: whole[k] for k in ("count", "scale")})
    layout.pack(want, whole)
    assert torch.equal(got, want)
    views = layout.views(got)
    for k, v in whole.items():
        assert torch.equal(views[k], v.to(dtype) if v.is_floating_point() else v), k
    wrong = {k: whole[k][:1] if k == "emb" else whole[k] for k in sharded}
    with pytest.raises(ValueError, match="emb: shard 0"):
        plan.pack(sends[0], wrong, 0)


def _fsdp_model(mesh) -> torch.nn.Module:
    """The tensors of `_whole` as a model's parameters (and two buffers), sharded by FSDP2 as the hf backend does:
    `fully_shard` on a block and on the root."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    whole = _whole()
    block, model = nn.Module(), nn.Module()
    for k in ("emb", "two_rows", "four_rows", "cube"):
        block.register_parameter(k, nn.Parameter(whole[k].clone()))
    model.block = block
    for k in ("one_row", "vec"):
        model.register_parameter(k, nn.Parameter(whole[k].clone()))
    model.register_buffer("count", whole["count"].clone())
    model.register_buffer("scale", whole["scale"].clone())
    fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _rank_main(rank: int, ranks: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from meshrl.models.sharding import full_tensor
    from meshrl.weight_sync.flat_gather import FlatGather
    from meshrl.weight_sync.shared_buffer import SharedBufferSender

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    results: dict[str, object] = {}
    senders = []

    def same_slot(sender: SharedBufferSender, ref: SharedBufferSender, version: int) -> bool:
        return torch.equal(sender.slot(sender.control.find(version)), ref.slot(ref.control.find(version)))

    try:
        model = _fsdp_model(init_device_mesh("cpu", (ranks,)))
        sd = model.state_dict()
        results["shard_rows"] = {
            k.rpartition(".")[2]: v.to_local().shape[0] for k, v in sd.items() if isinstance(v, DTensor)
        }
        for dtype in DTYPES:
            for collective in ("all_gather", "gather"):
                gather = FlatGather.for_shards({k: v.detach() for k, v in sd.items()}, dtype, collective=collective)
                assert gather is not None
                for version in (1, 2):
                    if version == 2:  # new weights, the same buffers
                        with torch.no_grad():
                            for p in model.parameters():
                                p.mul_(-1.5)
                    # the parameters themselves (Policy's `weight_shards(live=True)`) or detached DTensors
                    live = collective == "all_gather"
                    shards = {k: v if live else v.detach() for k, v in model.state_dict(keep_vars=live).items()}
                    assert gather.matches(shards, dtype)
                    gather.gather(shards)
                    full = {k: full_tensor(v) for k, v in shards.items()}  # the per-tensor path, for reference
                    if rank == 0:
                        if version == 1:
                            sender = SharedBufferSender(gather.plan.layout, "cpu")
                            ref = SharedBufferSender.for_state_dict(full, "cpu", dtype=dtype)
                            senders += [sender, ref]
                        sender.publish_with(lambda slot, g=gather, s=shards: g.unpack_into(slot, s), version)
                        ref.publish(full, version)
                        results[f"{dtype}/{collective}/v{version}"] = same_slot(sender, ref, version)
                with torch.no_grad():  # back to the first weights
                    for p in model.parameters():
                        p.div_(-1.5)

        if ranks == 2:  # (3 processes building a Policy each take over a minute on a 2-core machine)
            _publish_from_policy(rank, model_dir, results, senders, same_slot)
        if rank == 0:
            torch.save(results, out)
    finally:
        for s in senders:
            s.close()
        dist.destroy_process_group()


def _publish_from_policy(rank: int, model_dir: str, results: dict, senders: list, same_slot) -> None:
    """The real thing: Policy.publish_weights_ipc takes the flat path on several ranks (fp32 weights, bf16 buffer),
    over the tiny model, whose embedding's 13 rows 2 ranks split 7 + 6."""
    from torch.distributed.tensor import DTensor

    from meshrl.policy import Policy
    from meshrl.weight_sync.shared_buffer import SharedBufferSender

    policy = Policy.from_options(model_dir, backend="hf")
    gathers = []
    for version in (1, 2):
        if version == 2:  # new weights (in place, as the optimiser changes them)
            with torch.no_grad():
                for p in policy.model.parameters():
                    p.mul_(-1.5)
        handle = policy.publish_weights_ipc(version, torch.bfloat16)
        gathers.append(getattr(policy, "_ipc_gather", None))
        hf = policy.hf_state_dict()
        if rank == 0:
            if version == 1:
                ref = SharedBufferSender.for_state_dict(hf, "cpu", dtype=torch.bfloat16)
                senders.append(ref)
            ref.publish(hf, version)
            results[f"policy/v{version}"] = handle is not None and same_slot(policy._ipc_sender, ref, version)
    results["policy_flat_path"] = gathers[0] is not None and gathers[1] is gathers[0]  # built once, kept
    shards = policy.weight_shards().values()
    results["policy_uneven"] = any(v.shape[0] % 2 for v in shards if isinstance(v, DTensor))
    if rank == 0:
        senders.append(policy._ipc_sender)


@pytest.mark.parametrize("ranks", [2, 3])
def test_fsdp_ranks_publish_the_bytes_of_the_whole_tensors(base_model_dir, tmp_path, ranks):
    out = str(tmp_path / "results.pt")
    run_ranks(_rank_main, ranks, ranks, free_port(), base_model_dir, out, timeout_s=240)
    results = torch.load(out)
    # FSDP2 split them as the plan assumes: rank 0 holds ceil(rows / ranks) rows
    sharded = {k: v for k, v in _whole().items() if k not in ("count", "scale")}
    assert results.pop("shard_rows") == {k: shard_rows(v.shape[0], ranks, 0)[1] for k, v in sharded.items()}
    expected = [f"{d}/{c}/v{v}" for d in DTYPES for c in ("all_gather", "gather") for v in (1, 2)]
    if ranks == 2:
        expected += ["policy/v1", "policy/v2", "policy_flat_path", "policy_uneven"]
    assert sorted(results) == sorted(expected)
    assert all(results.values()), {k: v for k, v in results.items() if not v}
