"""Versioned policy-weight exchange over torchstore (trainer pushes, generators pull).

Layout in the store (``prefix`` defaults to "policy", one key per tensor)::

    policy/v3/<param name>      full (non-DTensor) CPU tensors, already cast to the generator dtype
    policy/v3/__manifest__      {"version", "names", "shapes", "dtypes", "nbytes"}; written after
                                every tensor of v3, so "manifest present" == "v3 complete"
    policy/__latest__           int, the highest complete version; written last

Readers go through the manifest, so a reader never sees a version whose tensors are not all
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

from meshrl.weight_sync.pubsub import DEFAULT_STORE
from meshrl.weight_sync.torchstore_compat import apply_torchstore_compat

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "policy"
_MANIFEST = "__manifest__"
_LATEST = "__latest__"
# Tensors in flight per push/pull. Each put/get is two small RPCs plus the payload message;
# overlapping a few hides the per-RPC latency without holding many casted copies at once.
_CONCURRENCY = 8

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


async def init_weight_store(store_name: str = DEFAULT_STORE, *, mesh: Any = None) -> None:
    """Create the store (controller side, once per run; repeated calls in one process are no-ops).

    Spawns one torchstore StorageVolume actor - on ``mesh`` (a 1-proc ProcMesh) if given, else on
    a new 1-proc mesh on this host, which :func:`shutdown_weight_store` stops again - and
    torchstore's Controller actor (in this process, via monarch's controller registry).
    """
    if store_name in _initialized:
        return
    apply_torchstore_compat()
    import torchstore

    if mesh is None:
        from monarch.actor import this_host

        mesh = this_host().spawn_procs(per_host={"procs": 1})
        _owned_meshes[store_name] = mesh
    await torchstore.initialize(num_storage_volumes=1, store_name=store_name, mesh=mesh)
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


# --------------------------------------------------------------------------------------------
# trainer / generator side


def _prepare(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        raise TypeError("push_weights takes full tensors; call .full_tensor() on DTensors first")
    t = t.detach()
    target = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
    t = t.to(device="cpu", dtype=target)
    # Pickling a tensor ships its whole storage: compact views / non-contiguous tensors first.
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.contiguous().clone()
    return t


async def _bounded_gather(coros_fn, items, limit: int = _CONCURRENCY) -> list:
    sem = asyncio.Semaphore(limit)

    async def one(item):
        async with sem:
            return await coros_fn(item)

    return await asyncio.gather(*(one(i) for i in items))


async def push_weights(
    state_dict: dict[str, torch.Tensor],
    version: int,
    *,
    dtype: torch.dtype | None = None,
    store_name: str = DEFAULT_STORE,
    prefix: str = DEFAULT_PREFIX,
) -> int:
    """Store ``state_dict`` as ``version``; return the bytes pushed (after the cast).

    Floating-point tensors are cast to ``dtype`` (the generator's dtype) if given; integer/bool
    tensors keep their dtype. Everything is moved to CPU. Tensors go first, then the version's
    manifest, then the "latest" marker (only raised, never lowered). Pushing a version that is
    already complete raises ``ValueError`` (call :func:`delete_weights` first).
    """
    client = await _client(store_name)
    mkey = _manifest_key(version, prefix)
    if await _get_object_or_none(client, mkey) is not None:
        raise ValueError(f"weights {weights_key(version, prefix)} already pushed; delete_weights() first")
    base = weights_key(version, prefix)
    names = list(state_dict)
    if any(n == _MANIFEST for n in names):
        raise ValueError(f"parameter name {_MANIFEST!r} is reserved")

    async def put_one(name: str):
        t = _prepare(state_dict[name], dtype)
        await client.put(f"{base}/{name}", t)
        return tuple(t.shape), t.dtype, t.numel() * t.element_size()

    metas = await _bounded_gather(put_one, names)
    nbytes = sum(m[2] for m in metas)
    manifest = {
        "version": int(version),
        "names": names,
        "shapes": [m[0] for m in metas],
        "dtypes": [m[1] for m in metas],
        "nbytes": nbytes,
    }
    await client.put(mkey, manifest)
    current = await _get_object_or_none(client, _latest_key(prefix))
    if current is None or int(version) > current:
        await client.put(_latest_key(prefix), int(version))
    return nbytes


async def pull_weights(
    version: int, *, store_name: str = DEFAULT_STORE, prefix: str = DEFAULT_PREFIX
) -> dict[str, torch.Tensor]:
    """Fetch exactly ``version`` as ``{name: CPU tensor}`` (in the pushed order and dtype).

    Raises :class:`WeightVersionNotFound` at once if that version was never (fully) pushed or was
    deleted, including while this pull was running. Never returns another version's tensors.
    """
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

    async def get_one(i: int):
        name = manifest["names"][i]
        try:
            t = await client.get(f"{base}/{name}")
        except KeyError as e:
            if _is_missing_key_error(e):
                raise WeightVersionNotFound(f"weights {base} were deleted while being pulled") from e
            raise
        if tuple(t.shape) != tuple(manifest["shapes"][i]) or t.dtype != manifest["dtypes"][i]:
            raise RuntimeError(
                f"{base}/{name}: got {tuple(t.shape)} {t.dtype}, manifest says "
                f"{tuple(manifest['shapes'][i])} {manifest['dtypes'][i]}"
            )
        return t

    tensors = await _bounded_gather(get_one, range(len(manifest["names"])))
    return dict(zip(manifest["names"], tensors, strict=True))


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
    """Free ``version``'s tensors (no-op if it is not there).

    The manifest goes first, so new pulls of ``version`` fail cleanly while tensors are being
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

    async def del_one(name: str):
        try:
            await client.delete(f"{base}/{name}")
        except Exception as e:  # already gone (concurrent delete): fine
            if not _is_missing_key_error(e):
                raise

    await _bounded_gather(del_one, manifest["names"])
