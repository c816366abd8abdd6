"""Policy weight sync (trainer -> generators) over torchstore; see ``store.py``."""

from meshrl.weight_sync.store import (
    DEFAULT_PREFIX,
    DEFAULT_STORE,
    WeightStoreNotInitialized,
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

__all__ = [
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
    "weights_key",
]
