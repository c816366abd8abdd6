"""Policy weight sync (trainer -> generators): over torchstore (``store.py``) or, trainer and generator on one
GPU, over CUDA IPC (``shared_buffer.py``; on CPU the same buffer in /dev/shm). ``transport.py`` picks one per run.

The torchstore names are resolved lazily: importing this package (e.g. for ``meshrl.weight_sync.shared_buffer``)
must not import Monarch or torchstore, which a generator or benchmark process may not have.
"""

from __future__ import annotations

from typing import Any

_STORE_NAMES = (
    "DEFAULT_PREFIX",
    "DEFAULT_STORE",
    "WeightStoreNotInitialized",
    "WeightVersionNotFound",
    "delete_weights",
    "init_weight_store",
    "latest_version",
    "list_versions",
    "pull_weights",
    "push_weights",
    "shutdown_weight_store",
    "version_tables",
    "weights_key",
)

__all__ = list(_STORE_NAMES)


def __getattr__(name: str) -> Any:
    if name in _STORE_NAMES:
        from meshrl.weight_sync import store

        return getattr(store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
