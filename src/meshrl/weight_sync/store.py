"""Versioned policy-weight exchange over torchstore (trainer ranks push their shards, generators pull).

Layout in the store (``prefix`` defaults to "policy"; `shards.py` packs and unpacks the chunks)::

    policy/v3/rank<r>/chunk<i>   flat uint8 CPU tensors: what trainer rank r holds of every tensor (its local
                                 DTensor shards), cast to the generator dtype, packed back to back
    policy/v3/rank<r>/__table__  where each of rank r's pieces sits (tensor, offsets, chunk, byte offset)
    policy/v3/__manifest__       {"version", "tables", "nbytes"}; written after every rank's chunks and table,
                                 so "manifest present" == "v3 complete"
    policy/__latest__            int, the highest complete version; written last

No rank gathers the model: each publishes its own shards (in parallel, to the storage volume of its own rank,
`init_weight_store(num_volumes=...)`), and a generator fetches every rank's chunks and puts whole tensors back
together. Readers go through the manifest, so a reader never sees a version whose chunks are not all
written, and ``pull_weights(v)`` only ever reads keys of ``v``.

Who calls what:

* the controller calls :func:`init_weight_store` once (it spawns torchstore's storage-volume
  process and its Controller actor) and :func:`shutdown_weight_store` at the end;
* any process - the controller or an actor's ``async`` endpoint on any mesh spawned from the
  controller - may then call :func:`push_weights` / :func:`pull_weights` / ... directly. Nothing
  has to be called first in actor processes: each function applies the torchstore/monarch
  compat patch (idempotent) and finds the store by name through monarch's
  ``get_or_spawn_controller`` registry, which lives in the controller process.

Functions are coroutines; from synchronous code use ``asyncio.run(...)``. They are not
thread-safe against each other in one process beyond what torchstore's client provides.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch

from meshrl.weight_sync.shards import DEFAULT_CHUNK_BYTES, WeightPieces, pack, pieces_of, whole_tensors
from meshrl.weight_sync.torchstore_compat import apply_torchstore_compat
from meshrl.weight_sync.transport import DEFAULT_STORE

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "policy"
_MANIFEST = "__manifest__"
_TABLE = "__table__"
_LATEST = "__latest__"
# Chunks in flight per push/pull: each put/get is two small RPCs plus the payload message, and Monarch moves
# several mid-sized messages at once much faster than one after the other (shards.py's docstring has the figures).
_CONCURRENCY = 16

# Storage-volume proc meshes this process spawned in init_weight_store (stopped on shutdown).
_owned_meshes: dict[str, Any] = {}
_initialized: set[str] = set()


class WeightVersionNotFound(LookupError):
    """The requested weights version is not (or no longer, or not yet fully) in the store."""


class WeightStoreNotInitialized(RuntimeError):
    """The torchstore named ``store_name`` was never initialized (or was shut down)."""


def weights_key(version: int, prefix: str = DEFAULT_PREFIX) -> str:
    """Key under which all tensors of ``version`` live, e.g. ``"policy/v3"``."""
    if int(version) != version or version < 0:
        raise ValueError(f"version must be a non-negative int, got {version!r}")
    return f"{prefix}/v{int(version)}"


def _manifest_key(version: int, prefix: str) -> str:
    return f"{weights_key(version, prefix)}/{_MANIFEST}"


def _latest_key(prefix: str) -> str:
    return f"{prefix}/{_LATEST}"


def _is_missing_key_error(e: BaseException) -> bool:
    # torchstore's Controller.locate_volumes raises KeyError("Unable to locate ..."); it reaches
    # us wrapped (ActorError -> KeyError(str(...))) so only the text is reliable.
    return "Unable to locate" in str(e)


async def _client(store_name: str):
    apply_torchstore_compat()
    import torchstore

    try:
        return await torchstore.client(store_name)
    except Exception as e:  # ActorError from the controller's assert_initialized, etc.
        if "initialize" in str(e):
            raise WeightStoreNotInitialized(
                f"weight store {store_name!r} is not initialized: the controller must call "
                "`await meshrl.weight_sync.init_weight_store()` before any push/pull"
            ) from e
        raise


async def _get_object_or_none(client, key: str):
    try:
        return await client.get(key)
    except KeyError as e:
        if _is_missing_key_error(e):
            return None
        raise


# --------------------------------------------------------------------------------------------
# controller side


async def init_weight_store(
    store_name: str = DEFAULT_STORE, *, mesh: Any = None, host: Any = None, num_volumes: int = 1
) -> None:
    """Create the store (controller side, once per run; repeated calls in one process are no-ops).

    Spawns ``num_volumes`` torchstore StorageVolume actors - on ``mesh`` (a ProcMesh of that many processes) if
    given, else on new processes on ``host`` (a Monarch host mesh; default: this host), which
    :func:`shutdown_weight_store` stops again - and torchstore's Controller actor (in this process, via monarch's
    controller registry). With several volumes, trainer rank r puts into volume r % num_volumes
    (`torchstore_compat.RankVolumes`): give one per trainer rank, on the trainer's host, and the ranks' pushes
    land in parallel, each in a process of its own host.
    """
    if store_name in _initialized:
        return
    apply_torchstore_compat()
    import torchstore

    from meshrl.weight_sync.torchstore_compat import RankVolumes

    if mesh is None:
        if host is None:
            from monarch.actor import this_host

            host = this_host()
        mesh = host.spawn_procs(per_host={"procs": num_volumes})
        _owned_meshes[store_name] = mesh
    strategy = RankVolumes(num_volumes) if num_volumes > 1 else None
    await torchstore.initialize(num_storage_volumes=num_volumes, strategy=strategy, store_name=store_name, mesh=mesh)
    _initialized.add(store_name)


async def shutdown_weight_store(store_name: str = DEFAULT_STORE) -> None:
    """Drop all stored data and stop the storage-volume process this process spawned.

    End-of-run only: clients cached in other processes are not reset, so re-initializing the
    same ``store_name`` while actors that already used it are still alive is not supported.
    """
    if store_name not in _initialized:
        return
    import torchstore

    try:
        await torchstore.shutdown(store_name)
    finally:
        _initialized.discard(store_name)
        mesh = _owned_meshes.pop(store_name, None)
        if mesh is not None:
            await mesh.stop()
            from meshrl.weight_sync.shared_buffer import remove_stale_files

            remove_stale_files()  # the stopped volumes' chunks in /dev/shm (torchstore_shm.py), if any were left


# --------------------------------------------------------------------------------------------
# trainer / generator side


async def _bounded_gather(coros_fn, items, limit: int = _CONCURRENCY) -> list:
    sem = asyncio.Semaphore(limit)

    async def one(item):
        async with sem:
            return await coros_fn(item)

    return await asyncio.gather(*(one(i) for i in items))


def _chunk_key(base: str, rank: int, i: int) -> str:
    return f"{base}/rank{rank}/chunk{i}"


def _table_key(base: str, rank: int) -> str:
    return f"{base}/rank{rank}/{_TABLE}"


async def put_rank(
    state_dict: dict[str, torch.Tensor],
    version: int,
    *,
    rank: int = 0,
    dtype: torch.dtype | None = None,
    store_name: str = DEFAULT_STORE,
    prefix: str = DEFAULT_PREFIX,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    buffers: list[torch.Tensor] | None = None,
) -> tuple[int, list[torch.Tensor]]:
    """Store this trainer rank's part of ``version``: what it holds of each tensor (a DTensor's local shard; a
    plain tensor on rank 0 only), cast to ``dtype`` (floating point only), packed into chunks (`shards.pack`).
    Returns the payload bytes and the chunk buffers (pass them back as ``buffers`` next time to reuse them). The
    version is not visible until :func:`finish_version` runs, after every rank's ``put_rank``."""
    client = await _client(store_name)
    if await _get_object_or_none(client, _manifest_key(version, prefix)) is not None:
        raise ValueError(f"weights {weights_key(version, prefix)} already pushed; delete_weights() first")
    if any(n in (_MANIFEST, _TABLE) for n in state_dict):
        raise ValueError(f"parameter names {_MANIFEST!r} and {_TABLE!r} are reserved")
    table, chunks = pack(state_dict, rank, dtype, chunk_bytes, buffers)
    base = weights_key(version, prefix)

    async def put_one(i: int) -> None:
        await client.put(_chunk_key(base, rank, i), chunks[i])

    await _bounded_gather(put_one, range(len(chunks)))
    await client.put(_table_key(base, rank), table)
    return table.nbytes, chunks


async def finish_version(
    version: int, num_ranks: int, *, store_name: str = DEFAULT_STORE, prefix: str = DEFAULT_PREFIX
) -> int:
    """Make ``version`` visible once all ``num_ranks`` ranks' ``put_rank`` returned (one caller, e.g. rank 0 after
    a barrier): its manifest (every rank's table), then the "latest" marker (only raised). Returns the payload
    bytes of the whole version."""
    client = await _client(store_name)
    base = weights_key(version, prefix)
    tables = []
    for rank in range(num_ranks):
        table = await _get_object_or_none(client, _table_key(base, rank))
        if table is None:
            raise RuntimeError(f"{base}: trainer rank {rank} has not stored its part")
        tables.append(table)
    nbytes = sum(t.nbytes for t in tables)
    manifest = {"version": int(version), "tables": tables, "nbytes": nbytes}
    await client.put(_manifest_key(version, prefix), manifest)
    current = await _get_object_or_none(client, _latest_key(prefix))
    if current is None or int(version) > current:
        await client.put(_latest_key(prefix), int(version))
    return nbytes


async def push_weights(
    state_dict: dict[str, torch.Tensor],
    version: int,
    *,
    dtype: torch.dtype | None = None,
    store_name: str = DEFAULT_STORE,
    prefix: str = DEFAULT_PREFIX,
) -> int:
    """Store ``state_dict`` (one process holding every tensor) as ``version``; return the bytes pushed (after
    the cast). Floating-point tensors are cast to ``dtype`` if given. Pushing a version that is already complete
    raises ``ValueError`` (call :func:`delete_weights` first). Trainer ranks holding shards call
    :func:`put_rank` each, then one of them :func:`finish_version`."""
    await put_rank(state_dict, version, dtype=dtype, store_name=store_name, prefix=prefix)
    return await finish_version(version, 1, store_name=store_name, prefix=prefix)


async def pull_weights(
    version: int, *, store_name: str = DEFAULT_STORE, prefix: str = DEFAULT_PREFIX, device: Any = None
) -> dict[str, torch.Tensor]:
    """Fetch exactly ``version`` as whole ``{name: tensor}`` (in the pushed order and dtype), put together from
    every trainer rank's chunks (:func:`pull_weight_pieces`, then `shards.whole_tensors`).

    Raises :class:`WeightVersionNotFound` at once if that version was never (fully) pushed or was
    deleted, including while this pull was running. Never returns another version's tensors.
    """
    pieces = await pull_weight_pieces(version, store_name=store_name, prefix=prefix, device=device)
    return whole_tensors(pieces)


async def pull_weight_pieces(
    version: int, *, store_name: str = DEFAULT_STORE, prefix: str = DEFAULT_PREFIX, device: Any = None
) -> WeightPieces:
    """Fetch exactly ``version`` as each tensor's blocks, as the trainer ranks published them (`shards.pieces_of`):
    an engine copies them into its weights directly, with no whole tensor put together first. On ``device`` when
    it is a GPU (one copy per chunk), else views of the fetched chunks. Raises as :func:`pull_weights` does."""
    client = await _client(store_name)
    base = weights_key(version, prefix)
    manifest = await _get_object_or_none(client, _manifest_key(version, prefix))
    if manifest is None:
        latest = await _get_object_or_none(client, _latest_key(prefix))
        raise WeightVersionNotFound(
            f"weights {base} not in store {store_name!r} (not pushed, not complete yet, or deleted); "
            f"latest complete version: {latest}"
        )
    assert manifest["version"] == int(version), (manifest["version"], version)
    wanted = [(t.rank, i, size) for t in manifest["tables"] for i, size in enumerate(t.chunk_sizes)]

    async def get_one(item: tuple[int, int, int]) -> torch.Tensor:
        rank, i, size = item
        try:
            chunk = await client.get(_chunk_key(base, rank, i))
        except KeyError as e:
            if _is_missing_key_error(e):
                raise WeightVersionNotFound(f"weights {base} were deleted while being pulled") from e
            raise
        if chunk.numel() != size or chunk.dtype != torch.uint8:
            raise RuntimeError(f"{_chunk_key(base, rank, i)}: got {chunk.numel()} {chunk.dtype}, expected {size} bytes")
        return chunk

    chunks = await _bounded_gather(get_one, wanted)
    by_key = {(rank, i): c for (rank, i, _), c in zip(wanted, chunks, strict=True)}
    return pieces_of(manifest["tables"], by_key, device)


async def version_tables(version: int, *, store_name: str = DEFAULT_STORE, prefix: str = DEFAULT_PREFIX) -> list:
    """Every trainer rank's `shards.RankTable` of ``version`` (what each rank published), or raise
    WeightVersionNotFound."""
    client = await _client(store_name)
    manifest = await _get_object_or_none(client, _manifest_key(version, prefix))
    if manifest is None:
        raise WeightVersionNotFound(f"weights {weights_key(version, prefix)} not in store {store_name!r}")
    return manifest["tables"]


async def latest_version(store_name: str = DEFAULT_STORE, prefix: str = DEFAULT_PREFIX) -> int | None:
    """Highest completely pushed version, or None if nothing was pushed under ``prefix``."""
    client = await _client(store_name)
    return await _get_object_or_none(client, _latest_key(prefix))


async def list_versions(store_name: str = DEFAULT_STORE, prefix: str = DEFAULT_PREFIX) -> list[int]:
    """Complete versions currently stored under ``prefix``, ascending (scans all keys)."""
    client = await _client(store_name)
    # torchstore's prefix filter splits keys on "." (param names contain dots), so filter here.
    head, tail = f"{prefix}/v", f"/{_MANIFEST}"
    out = []
    for k in await client.keys():
        if k.startswith(head) and k.endswith(tail) and k[len(head) : -len(tail)].isdigit():
            out.append(int(k[len(head) : -len(tail)]))
    return sorted(out)


async def delete_weights(version: int, *, store_name: str = DEFAULT_STORE, prefix: str = DEFAULT_PREFIX) -> None:
    """Free ``version``'s chunks (no-op if it is not there).

    The manifest goes first, so new pulls of ``version`` fail cleanly while chunks are being
    removed; a pull already past the manifest fails with WeightVersionNotFound. The "latest"
    marker is not changed: do not delete the version generators are about to pull.
    """
    client = await _client(store_name)
    mkey = _manifest_key(version, prefix)
    manifest = await _get_object_or_none(client, mkey)
    if manifest is None:
        return
    await client.delete(mkey)
    base = weights_key(version, prefix)
    keys = [_table_key(base, t.rank) for t in manifest["tables"]]
    keys += [_chunk_key(base, t.rank, i) for t in manifest["tables"] for i in range(len(t.chunk_sizes))]

    async def del_one(key: str):
        try:
            await client.delete(key)
        except Exception as e:  # already gone (concurrent delete): fine
            if not _is_missing_key_error(e):
                raise

    await _bounded_gather(del_one, keys)
