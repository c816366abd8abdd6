"""One collective per weight version for the shared buffer (`shared_buffer.py`) when the trainer is FSDP2-sharded
over several ranks: every rank packs its shards into one flat send buffer, one `all_gather_into_tensor` (or a
gather to rank 0) brings every rank's buffer to rank 0, and rank 0 copies each tensor's pieces into its place in
the shared flat buffer.

Why: gathering tensor by tensor (`DTensor.full_tensor()` per weight) is ~300 collectives per version for a
Qwen3-0.6B-sized model, each with its own launch, allocation and synchronisation; measured on 4x H100 that took
146 ms (2 ranks) to 209 ms (4 ranks) for 0.44B parameters, against 6-12 ms for one rank's copy. One collective of
the whole model moves the same bytes at the link's rate.

The layout of a rank's send buffer (`GatherPlan`), the same on every rank since it depends only on the whole
shapes, dtypes and the number of ranks: for each tensor sharded on dim 0, in the state dict's order, a piece of
`chunk_rows` rows (the largest rank's shard, FSDP2 shards as `torch.chunk` does: ceil(rows / ranks) rows each, the
last shards short or empty), cast to the buffer's dtype, each piece aligned to `ALIGN` bytes so that it can be
viewed as any dtype. A rank whose shard is short leaves the rest of its piece unwritten (never read). After the
gather the receive buffer holds `num_ranks` such buffers one after the other, so tensor i of rank r sits at
`r * send_nbytes + offset_i`: a [ranks, chunk_rows, row] strided view, copied into the tensor's [rows, row] view
of the slot in one copy (two when the last non-empty shard is short). Tensors that are not sharded (plain
tensors, replicated DTensors) are copied by rank 0 from its own copy.

Bitwise the same as gathering whole tensors and casting them: a cast is element by element, so casting each
shard before the gather gives the same bytes as casting the whole tensor after it.

Memory: the send buffer (about 1/ranks of the model in the buffer's dtype) on every rank, and the receive buffer
(the whole model) on rank 0 — on every rank with `all_gather`, whose output every rank receives; allocated once and
kept, as the per-tensor gathers' blocks stayed in the caching allocator before.

No Monarch in here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshrl.weight_sync.shared_buffer import ALIGN, FlatLayout, TensorSpec, _dtype

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

Collective = Literal["all_gather", "gather"]
DEFAULT_COLLECTIVE: Collective = "all_gather"
"""`all_gather_into_tensor` is NCCL's ring collective; 'gather' (point-to-point receives on rank 0, a send buffer
only on the other ranks) saves the receive buffer on ranks other than 0."""


def shard_rows(rows: int, num_shards: int, index: int) -> tuple[int, int]:
    """[start, stop) of the dim-0 rows that shard `index` of `num_shards` holds, as FSDP2's Shard(0) splits a tensor
    (`torch.chunk`): ceil(rows / num_shards) rows each, so the last non-empty shard may be short and the shards
    after it empty (7 rows over 3: 3, 3, 1; 4 rows over 3: 2, 2, 0; 1 row over 2: 1, 0)."""
    chunk = -(-rows // num_shards)
    start = min(index * chunk, rows)
    return start, min(start + chunk, rows)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class ShardedTensor:
    """A tensor sharded on dim 0: where it goes in a slot (`spec`), and its piece in each rank's send buffer."""

    spec: TensorSpec
    rows: int  # dim 0 of the whole tensor
    row_numel: int  # elements of one dim-0 row
    chunk_rows: int  # rows of the largest shard: every rank's piece has room for this many
    send_offset: int  # bytes from the start of a rank's send buffer

    @property
    def piece_nbytes(self) -> int:
        return self.chunk_rows * self.row_numel * _dtype(self.spec.dtype).itemsize


@dataclass(frozen=True)
class GatherPlan:
    """Where each rank packs its shards (`pack`) and where rank 0 copies them from after the gather (`unpack`), for
    `layout` (the shared buffer's) over `num_ranks` ranks. Plain data, the same on every rank."""

    layout: FlatLayout
    num_ranks: int
    sharded: tuple[ShardedTensor, ...]
    whole: tuple[TensorSpec, ...]  # not sharded: rank 0 copies its own
    send_nbytes: int  # bytes of one rank's send buffer (a multiple of ALIGN)

    @classmethod
    def build(cls, layout: FlatLayout, sharded: Collection[str], num_ranks: int) -> GatherPlan:
        """`sharded`: names of the layout's tensors that are split on dim 0 over `num_ranks` ranks."""
        if num_ranks < 1:
            raise ValueError(f"num_ranks={num_ranks} must be >= 1")
        unknown = set(sharded) - set(layout.names)
        if unknown:
            raise ValueError(f"sharded tensors not in the layout: {sorted(unknown)[:5]}")
        pieces, whole, offset = [], [], 0
        for spec in layout.specs:
            if spec.name not in sharded:
                whole.append(spec)
                continue
            if not spec.shape:
                raise ValueError(f"{spec.name}: a scalar cannot be sharded on dim 0")
            rows = spec.shape[0]
            row_numel = 1
            for s in spec.shape[1:]:
                row_numel *= s
            piece = ShardedTensor(spec, rows, row_numel, -(-rows // num_ranks), offset)
            pieces.append(piece)
            offset += _aligned(piece.piece_nbytes)
        return cls(layout, num_ranks, tuple(pieces), tuple(whole), max(offset, ALIGN))

    def pack(self, send: torch.Tensor, local: Mapping[str, torch.Tensor], index: int) -> None:
        """Copy (cast to the layout's dtypes) shard `index`'s rows of every sharded tensor, `local[name]` (plain
        tensors), into `send` (1-D uint8 of `send_nbytes`). Asynchronous on CUDA, in the current stream."""
        _check_flat(send, self.send_nbytes, "send buffer")
        dst, src = [], []
        with torch.no_grad():
            for p in self.sharded:
                t = local[p.spec.name]
                start, stop = shard_rows(p.rows, self.num_ranks, index)
                if tuple(t.shape) != (stop - start, *p.spec.shape[1:]):
                    # FSDP2's shards are torch.chunk's; anything else would be put back in the wrong rows.
                    raise ValueError(
                        f"{p.spec.name}: shard {index} of {self.num_ranks} has shape {tuple(t.shape)}, expected rows "
                        f"[{start}, {stop}) of {p.spec.shape}"
                    )
                if t.numel() == 0:
                    continue
                nbytes = t.numel() * _dtype(p.spec.dtype).itemsize
                view = send[p.send_offset : p.send_offset + nbytes].view(_dtype(p.spec.dtype)).view(t.shape)
                if t.device == send.device:
                    dst.append(view)
                    src.append(t)
                else:
                    view.copy_(t)
            if dst:  # multi-tensor copies where dtypes allow; per tensor (casting) where they differ
                torch._foreach_copy_(dst, src, non_blocking=True)

    def unpack(self, recv: torch.Tensor, slot: torch.Tensor, whole: Mapping[str, torch.Tensor]) -> None:
        """Rank 0: copy every sharded tensor from the gathered `recv` (1-D uint8, `num_ranks` send buffers one after
        the other) and every other tensor from `whole` (name -> the whole tensor, any device and dtype) into `slot`
        (1-D uint8, laid out as `layout`). Asynchronous on CUDA, in the current stream: synchronise before
        publishing (`SharedBufferSender.publish_with` does)."""
        _check_flat(recv, self.num_ranks * self.send_nbytes, "receive buffer")
        views = self.layout.views(slot)
        ranks = recv[: self.num_ranks * self.send_nbytes].view(self.num_ranks, self.send_nbytes)
        dst, src = [], []
        with torch.no_grad():
            for p in self.sharded:
                if p.rows == 0 or p.row_numel == 0:
                    continue
                dtype = _dtype(p.spec.dtype)
                # [ranks, chunk_rows, row]: rank r's piece of this tensor (stride send_nbytes between ranks)
                pieces = ranks[:, p.send_offset : p.send_offset + p.piece_nbytes].view(dtype)
                pieces = pieces.view(self.num_ranks, p.chunk_rows, p.row_numel)
                out = views[p.spec.name].view(p.rows, p.row_numel)
                full = p.rows // p.chunk_rows  # ranks with a whole chunk; the next holds the rest (maybe nothing)
                dst.append(out[: full * p.chunk_rows].view(full, p.chunk_rows, p.row_numel))
                src.append(pieces[:full])
                rest = p.rows - full * p.chunk_rows
                if rest:
                    dst.append(out[full * p.chunk_rows :])
                    src.append(pieces[full, :rest])
            for spec in self.whole:
                t = whole[spec.name]
                if tuple(t.shape) != spec.shape:
                    raise ValueError(f"{spec.name}: shape {tuple(t.shape)}, layout {spec.shape}")
                if t.device == slot.device:
                    dst.append(views[spec.name])
                    src.append(t)
                else:  # across devices: a plain copy per tensor, as FlatLayout.pack does
                    views[spec.name].copy_(t)
            if dst:
                torch._foreach_copy_(dst, src, non_blocking=True)


def _check_flat(t: torch.Tensor, nbytes: int, what: str) -> None:
    if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() < nbytes:
        raise ValueError(f"the {what} is a 1-D uint8 tensor of >= {nbytes} bytes, got {t.dtype} {tuple(t.shape)}")


# ---------------------------------------------------------------------------------------------------------------
# FSDP2 state dicts: which entries are sharded, and the collective


Signature = tuple[tuple[str, tuple[int, ...], torch.dtype, bool], ...]


def _is_dim0_shard(t: DTensor) -> bool | None:
    """True: Shard(0) over a 1-D mesh of several ranks; False: whole on every rank (replicated, or a mesh of one);
    None: a placement this module does not put back together (Shard(1), _StridedShard, Partial, 2-D meshes)."""
    mesh, placements = t.device_mesh, t.placements
    if all(isinstance(p, Replicate) for p in placements) or mesh.size() == 1:
        return False
    if mesh.ndim != 1 or t.dim() == 0:
        return None
    p = placements[0]
    return True if type(p) is Shard and p.dim == 0 else None  # _StridedShard subclasses Shard


def describe(shards: Mapping[str, torch.Tensor]) -> tuple[Signature, DeviceMesh | None] | None:
    """(name, whole shape, dtype, sharded on dim 0) per entry and the mesh of the sharded ones (None if none is),
    or None when some entry is sharded in a way `GatherPlan` does not handle, or over two meshes."""
    entries, mesh = [], None
    for name, t in shards.items():
        sharded = _is_dim0_shard(t) if isinstance(t, DTensor) else False
        if sharded is None:
            return None
        if sharded:
            if mesh is None:
                mesh = t.device_mesh
            elif t.device_mesh is not mesh and t.device_mesh != mesh:
                return None
        entries.append((name, tuple(t.shape), t.dtype, sharded))
    return tuple(entries), mesh


def _local(t: torch.Tensor) -> torch.Tensor:
    # The DTensor's own local tensor, without `to_local()`'s autograd function per tensor (~300 per publish).
    return t._local_tensor if isinstance(t, DTensor) else t


class FlatGather:
    """One rank's side of the flat gather of an FSDP2 state dict into the shared buffer's layout: the plan, the send
    buffer and (on rank 0, or everywhere with `all_gather`) the receive buffer, allocated once.

        shards = policy.weight_shards(live=True)
        gather = FlatGather.for_shards(shards, torch.bfloat16)   # None: gather per tensor
        gather.gather(shards)                                  # every rank (collective)
        sender.publish_with(lambda slot: gather.unpack_into(slot, shards), v)    # rank 0
    """

    def __init__(
        self,
        plan: GatherPlan,
        signature: Signature,
        dtype: torch.dtype,
        group: dist.ProcessGroup,
        device: torch.device,
        *,
        collective: Collective = DEFAULT_COLLECTIVE,
    ) -> None:
        if collective not in ("all_gather", "gather"):
            raise ValueError(f"collective={collective!r}; use 'all_gather' or 'gather'")
        self.plan, self.signature, self.dtype, self.group = plan, signature, dtype, group
        self.collective = collective
        self.index = dist.get_rank(group)  # this rank's shard (a 1-D mesh's group is in mesh order)
        self.root = dist.get_global_rank(group, 0)
        # Zeroed once: the unwritten tail of a short shard's piece then carries zeros, not stale device memory.
        self.send = torch.zeros(plan.send_nbytes, dtype=torch.uint8, device=device)
        receives = collective == "all_gather" or self.index == 0
        self.recv = (
            torch.empty(plan.num_ranks * plan.send_nbytes, dtype=torch.uint8, device=device) if receives else None
        )

    @classmethod
    def for_shards(
        cls, shards: Mapping[str, torch.Tensor], dtype: torch.dtype, *, collective: Collective = DEFAULT_COLLECTIVE
    ) -> FlatGather | None:
        """For a state dict of FSDP2 shards (`Policy.weight_shards()`), cast to `dtype` (floating-point tensors):
        None when no tensor is sharded over more than one rank (one rank: copy the tensors as they are), or when
        some is sharded otherwise than on dim 0 of one 1-D mesh of all ranks (gather per tensor then). The same
        answer on every rank: it depends only on shapes and placements."""
        described = describe(shards)
        if described is None or described[1] is None:
            return None
        signature, mesh = described
        if dist.get_world_size() != mesh.size() or mesh.mesh.flatten().tolist() != list(range(mesh.size())):
            return None  # the published rank 0 must be the mesh's first shard; other meshes: per tensor
        layout = FlatLayout.of(shards, dtype)
        plan = GatherPlan.build(layout, [name for name, _, _, sharded in signature if sharded], mesh.size())
        device = next(_local(shards[name]).device for name, _, _, sharded in signature if sharded)
        return cls(plan, signature, dtype, mesh.get_group(0), device, collective=collective)

    def matches(self, shards: Mapping[str, torch.Tensor], dtype: torch.dtype) -> bool:
        """Whether this plan still describes `shards` cast to `dtype` (else build a new one: `for_shards`)."""
        if dtype != self.dtype or len(shards) != len(self.signature):
            return False
        described = describe(shards)
        return described is not None and described[0] == self.signature

    def gather(self, shards: Mapping[str, torch.Tensor]) -> None:
        """Collective over the mesh's ranks: pack this rank's shards and gather every rank's into `recv` (rank 0's,
        or every rank's with `all_gather`). On CUDA the current stream waits for the collective."""
        local = {p.spec.name: _local(shards[p.spec.name]) for p in self.plan.sharded}
        self.plan.pack(self.send, local, self.index)
        if self.collective == "all_gather":
            dist.all_gather_into_tensor(self.recv, self.send, group=self.group)
        else:
            parts = list(self.recv.view(self.plan.num_ranks, -1).unbind(0)) if self.recv is not None else None
            dist.gather(self.send, gather_list=parts, dst=self.root, group=self.group)

    def unpack_into(self, slot: torch.Tensor, shards: Mapping[str, torch.Tensor]) -> None:
        """Rank 0, after `gather`: fill `slot` (the shared buffer's, laid out as `plan.layout`) from the gathered
        pieces, and the tensors that are not sharded from this rank's own `shards`."""
        if self.recv is None or self.index != 0:
            raise RuntimeError("only the mesh's first rank receives the gathered shards")
        whole = {spec.name: _local(shards[spec.name]) for spec in self.plan.whole}
        self.plan.unpack(self.recv, slot, whole)


__all__ = ["DEFAULT_COLLECTIVE", "FlatGather", "GatherPlan", "ShardedTensor", "describe", "shard_rows"]
