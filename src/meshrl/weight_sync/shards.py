"""A weights version as the trainer ranks hold it, packed for the store, and put back together on the generator.

Each trainer rank publishes only what it holds: for a DTensor (FSDP2's Shard(0), or any sharding) its local
shard, with where that shard sits in the whole tensor; a replicated tensor once, from coordinate 0 of its mesh. No
rank gathers the model. A rank's shards are cast to the transfer dtype on their device and packed into a few flat
byte chunks (`pack`), which travel through torchstore as plain tensors (`store.py`); the generator fetches every
rank's chunks and hands each tensor's blocks to its engine (`pieces_of`), which copies them straight into its own
weights (the transformers engine) or puts whole tensors together first (`whole_tensors`; vLLM, whose loader then
takes each worker's slices).

Why chunks of ~16 MiB and not torchstore's per-tensor put (DTensor-aware, one key per tensor and rank): each put
or get is two controller RPCs plus a payload message, and with ~300 tensors of very uneven size that per-message
cost dominates; one 256 MiB message, on the other hand, moves at a fraction of the rate of many mid-sized ones
in flight together. Measured on this 2-core CPU, 256 MiB through torchstore's messages: 16 MiB chunks with 16 in
flight moved 0.7-1.0 GiB/s each way, one 256 MiB tensor 0.1-0.2 GiB/s. (On one host the chunks go through /dev/shm
instead, `torchstore_shm.py`; the chunking still sets how many puts and gets there are.)

No Monarch or torchstore in here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

DEFAULT_CHUNK_BYTES = 16 * 2**20
_ALIGN = 64  # every piece starts 64-byte aligned in its chunk, so its bytes can be viewed as any dtype


@dataclass(frozen=True)
class Piece:
    """One rank's part of tensor `name`: the block at `offsets` of shape `shape`, stored at bytes `start` of chunk
    `chunk`."""

    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    chunk: int
    start: int


@dataclass
class RankTable:
    """What one rank published for a version: every tensor's name, whole shape and dtype (all ranks list all of
    them), its pieces, and the sizes of its chunks."""

    rank: int
    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype]
    pieces: list[Piece] = field(default_factory=list)
    chunk_sizes: list[int] = field(default_factory=list)
    nbytes: int = 0  # payload bytes (without alignment padding)


def local_blocks(
    state_dict: dict[str, torch.Tensor], rank: int
) -> list[tuple[str, tuple[int, ...], torch.Tensor | None, tuple[int, ...]]]:
    """(name, whole shape, the block this rank publishes or None, its offsets) per tensor. A plain tensor counts
    as replicated: rank 0 publishes it."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = []
    for name, t in state_dict.items():
        if not isinstance(t, DTensor):
            out.append((name, tuple(t.shape), t.detach() if rank == 0 else None, (0,) * t.dim()))
            continue
        if any(p.is_partial() for p in t.placements):
            raise ValueError(f"{name}: a Partial DTensor has no whole value to publish (placements {t.placements})")
        coordinate = t.device_mesh.get_coordinate()
        shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local().detach()
        if tuple(local.shape) != tuple(shape):  # e.g. a padded local tensor: the offsets would not describe it
            raise ValueError(f"{name}: local shard {tuple(local.shape)} but its placement says {tuple(shape)}")
        replica = coordinate is None or any(
            p.is_replicate() and c != 0 for p, c in zip(t.placements, coordinate, strict=True)
        )
        out.append((name, tuple(t.shape), None if replica else local, tuple(offsets)))
    return out


def _split_rows(block: torch.Tensor, offsets: tuple[int, ...], max_bytes: int):
    """The block in dim-0 slices of at most `max_bytes` (one row at least), with their offsets."""
    if block.dim() == 0 or block.numel() * block.element_size() <= max_bytes:
        yield block, offsets
        return
    row_bytes = max(1, block[0].numel() * block.element_size())
    rows = max(1, max_bytes // row_bytes)
    for r in range(0, block.shape[0], rows):
        yield block[r : r + rows], (offsets[0] + r, *offsets[1:])


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def pack(
    state_dict: dict[str, torch.Tensor],
    rank: int,
    dtype: torch.dtype | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    buffers: list[torch.Tensor] | None = None,
) -> tuple[RankTable, list[torch.Tensor]]:
    """This rank's table and chunks (CPU uint8 tensors, each its own storage, so a chunk pickles alone).
    Floating-point blocks are cast to `dtype` on their device first (half the copy for bf16). `buffers`: chunks of
    an earlier call to write into again when the sizes match (pinned when the blocks are on a GPU, so the copies
    run asynchronously); pass the returned list back next time."""
    blocks = local_blocks(state_dict, rank)
    table = RankTable(rank, [b[0] for b in blocks], [b[1] for b in blocks], [])
    placed: list[tuple[torch.Tensor, Piece]] = []
    used = 0  # bytes used in the current chunk
    for name, _shape, block, offsets in blocks:
        source_dtype = block.dtype if block is not None else state_dict[name].dtype
        target = dtype if dtype is not None and source_dtype.is_floating_point else source_dtype
        table.dtypes.append(target)
        if block is None or block.numel() == 0:
            continue
        block = block.to(target)
        for part, part_offsets in _split_rows(block, offsets, chunk_bytes):
            size = part.numel() * part.element_size()
            start = _aligned(used)
            if not table.chunk_sizes or (used and start + size > chunk_bytes):  # a new chunk
                table.chunk_sizes.append(0)
                start = 0
            placed.append((part, Piece(name, part_offsets, tuple(part.shape), len(table.chunk_sizes) - 1, start)))
            used = start + size
            table.chunk_sizes[-1] = used
            table.nbytes += size
    chunks = _chunk_buffers(table.chunk_sizes, buffers, pinned=any(p.is_cuda for p, _ in placed))
    for part, piece in placed:
        dst = chunks[piece.chunk][piece.start : piece.start + part.numel() * part.element_size()]
        dst.copy_(part.contiguous().reshape(-1).view(torch.uint8), non_blocking=part.is_cuda)
        table.pieces.append(piece)
    if any(p.is_cuda for p, _ in placed):
        torch.cuda.synchronize()  # the chunks are read by the put right after
    return table, chunks


def _chunk_buffers(sizes: list[int], buffers: list[torch.Tensor] | None, pinned: bool) -> list[torch.Tensor]:
    if buffers is not None and [b.numel() for b in buffers] == sizes:
        return buffers
    return [torch.empty(n, dtype=torch.uint8, pin_memory=pinned) for n in sizes]


WeightPieces = dict[str, tuple[tuple[int, ...], torch.dtype, list[tuple[tuple[int, ...], torch.Tensor]]]]
"""{name: (whole shape, dtype, [(offsets, block), ...])}: the blocks cover the whole tensor exactly."""


def pieces_of(
    tables: list[RankTable], chunks: dict[tuple[int, int], torch.Tensor], device: torch.device | None = None
) -> WeightPieces:
    """Every tensor's blocks from every rank's table and chunks (`chunks[(rank, i)]`), in the first table's order,
    each a view of its chunk. `device`: a GPU to move the chunks to first, one copy per chunk (they then take the
    model's size in device memory until loaded). Raises if the blocks do not cover a tensor exactly (a rank
    missing, or two ranks publishing the same block)."""
    if device is not None and torch.device(device).type == "cuda":
        chunks = {k: c.to(device, non_blocking=True) for k, c in chunks.items()}
    first = tables[0]
    dtype_of = dict(zip(first.names, first.dtypes, strict=True))
    out: WeightPieces = {n: (shape, dtype_of[n], []) for n, shape in zip(first.names, first.shapes, strict=True)}
    for table in tables:
        if table.names != first.names or table.shapes != first.shapes:
            raise ValueError(f"rank {table.rank} published other tensors than rank {first.rank}")
        for piece in table.pieces:
            dtype = dtype_of[piece.name]
            nbytes = math.prod(piece.shape) * dtype.itemsize
            raw = chunks[(table.rank, piece.chunk)][piece.start : piece.start + nbytes]
            out[piece.name][2].append((piece.offsets, raw.view(dtype).view(piece.shape)))
    for name, (shape, _, blocks) in out.items():
        covered = sum(b.numel() for _, b in blocks)
        if covered != math.prod(shape):
            raise ValueError(f"{name}: the ranks' pieces hold {covered} of its {math.prod(shape)} elements")
    return out


def block_slices(offsets: tuple[int, ...], block: torch.Tensor) -> tuple[slice, ...]:
    """Where `block` sits in its whole tensor, as an index."""
    return tuple(slice(o, o + n) for o, n in zip(offsets, block.shape, strict=True))


def whole_tensors(pieces: WeightPieces) -> dict[str, torch.Tensor]:
    """Whole tensors from their blocks: a tensor that one block holds whole is that block (no copy); the others
    are copied together (on the blocks' device)."""
    out = {}
    for name, (shape, dtype, blocks) in pieces.items():
        if len(blocks) == 1 and tuple(blocks[0][1].shape) == tuple(shape):
            out[name] = blocks[0][1]
            continue
        device = blocks[0][1].device if blocks else None
        whole = torch.empty(shape, dtype=dtype, device=device)
        for offsets, block in blocks:
            whole[block_slices(offsets, block)].copy_(block)
        out[name] = whole
    return out


def assemble(
    tables: list[RankTable], chunks: dict[tuple[int, int], torch.Tensor], device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """Whole tensors from every rank's table and chunks (`pieces_of`, then `whole_tensors`)."""
    return whole_tensors(pieces_of(tables, chunks, device))


def renamed_only(source: dict[str, torch.Tensor], renamed: dict[str, torch.Tensor]) -> bool:
    """Whether a name conversion (e.g. a state-dict adapter's to_hf) only renamed tensors: every value it returned
    is one of its inputs. Then the shards can be published under the new names as they are; a conversion that
    fuses, splits or permutes needs whole tensors."""
    ids = {id(v) for v in source.values()}
    return all(id(v) in ids for v in renamed.values())
