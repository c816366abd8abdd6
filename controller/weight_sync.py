"""The run's weight sync, controller side: one object.

It resolves the transport once the processes run (`meshrl.weight_sync.transport`), makes the trainer's publisher
and the generators' subscribers (`meshrl.weight_sync.pubsub`), hands the shared buffer's handle over once, keeps
track of what each generator was asked to load, frees torchstore versions nobody will load again, and cleans up
at shutdown. `Controller.sync_weights` is this object's `sync`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from meshrl.controller.futures import Pending, _rank0
from meshrl.controller.replicas import ReplicaCall, ReplicaPool
from meshrl.weight_sync.shared_buffer import remove_shared_files
from meshrl.weight_sync.transport import SHARED_BUFFER_TRANSPORTS


@dataclass
class WeightSyncTiming:
    version: int
    push_s: float
    pull_s: float
    bytes: int
    transport: str = "torchstore"


class WeightSync:
    """Trainer → generators, for one Controller. `store_name`: its own torchstore (two Controllers in one process
    never see each other's versions)."""

    def __init__(self, trainer: Any, generators: ReplicaPool, dtype: str, store_name: str, timeout_s: float) -> None:
        self.trainer, self.generators, self.dtype = trainer, generators, dtype
        self.store_name, self.timeout_s = store_name, timeout_s
        self.transport: str | None = None
        self.handle = None  # the shared buffer's handle, once attached (its files are removed at shutdown)
        self.last_synced: int | None = None
        self.loads_in_flight: list[tuple[int, list[ReplicaCall]]] = []  # sync(wait=False) loads, unconfirmed
        self.stored_versions: list[int] = []  # torchstore versions not deleted yet
        self.versions_kept = 2  # torchstore versions kept while loads are queued (the async loop: K + 1)

    def start(self, trainer_identity: str, generator_identities: list[str], requested: str) -> str:
        """Resolve `generator.weight_sync` against where the processes run (trainer rank 0 publishes) and make the
        trainer's publisher. Shared-buffer transports hand the buffer to the generators at the first sync."""
        from meshrl.weight_sync.transport import describe_transport, resolve_transport

        self.transport = resolve_transport(requested, trainer_identity, generator_identities)
        Pending(
            [self.trainer.set_weight_sync.call(self.transport, self.store_name)], _rank0, self.timeout_s,
            "set_weight_sync",
        ).result()  # fmt: skip
        print(f"[meshrl] {describe_transport(self.transport, trainer_identity, generator_identities)}", flush=True)
        return self.transport

    def sync(self, version: int, *, wait: bool = True) -> WeightSyncTiming:
        """Publish `version` and make every generator load it (see `Controller.sync_weights`)."""
        if version == self.last_synced:
            return WeightSyncTiming(version, 0.0, 0.0, 0, self.transport)  # generators already serve it
        t0 = time.perf_counter()
        pushed = Pending(
            [self.trainer.push_weights.call(version, self.dtype, self.store_name)],
            lambda v: sum(v[0].values()),
            self.timeout_s,
            "push_weights",
        ).result()
        if self.transport in SHARED_BUFFER_TRANSPORTS and self.handle is None:
            self._attach_buffer()  # once: the buffer exists from the first push on
        t1 = time.perf_counter()
        load = self.generators.send_all("pull_weights", version, self.store_name)
        self.last_synced = version
        if self.transport == "torchstore":
            self.stored_versions.append(version)
        if not wait:
            self.loads_in_flight.append((version, load))
            self._free_store(keep=self.versions_kept)
            return WeightSyncTiming(version, t1 - t0, 0.0, pushed, self.transport)
        versions = Pending(load, list, self.timeout_s, "pull_weights").result()
        if set(versions) != {version}:
            raise RuntimeError(f"generators report versions {versions} after pulling {version}")
        self.loads_in_flight.clear()  # served in order: every earlier queued load is done
        self._free_store(keep=1)  # the generators have moved on
        return WeightSyncTiming(version, t1 - t0, time.perf_counter() - t1, pushed, self.transport)

    def bring_up(self, i: int) -> None:
        """A replacement generator `i` (controller/replicas.py): the shared buffer's handle, and the weights the
        others were last sent (a load queued before it died is sent to it again, and loads the same version)."""
        actor = self.generators.actor(i)
        if self.handle is not None:
            actor.attach_weight_buffer.call_one(self.handle).get(timeout=self.timeout_s)
        if self.last_synced is not None:
            loaded = actor.pull_weights.call_one(self.last_synced, self.store_name).get(timeout=self.timeout_s)
            if loaded != self.last_synced:
                raise RuntimeError(f"the replacement generator loaded version {loaded}, not {self.last_synced}")

    def take_loads_in_flight(self) -> list[tuple[int, list[ReplicaCall]]]:
        """The loads queued since the last confirmation: a generate call sent now runs after them on every
        generator, and waits on them with its own result (so a failed load fails it)."""
        loads, self.loads_in_flight = self.loads_in_flight, []
        return loads

    @staticmethod
    def check_loaded(loads: list[tuple[int, list[ReplicaCall]]], values: list[Any]) -> None:
        """`values`: the loads' results, in order (one per replica and load)."""
        at = 0
        for version, calls in loads:
            loaded, at = values[at : at + len(calls)], at + len(calls)
            if set(loaded) != {version}:
                raise RuntimeError(f"generators report versions {loaded} after pulling {version}")

    def _free_store(self, keep: int) -> None:
        """Delete all but the newest `keep` versions from torchstore (a queued load may still need the newer ones)."""
        from meshrl.weight_sync.store import delete_weights

        while len(self.stored_versions) > keep:
            asyncio.run(delete_weights(self.stored_versions.pop(0), store_name=self.store_name))

    def _attach_buffer(self) -> None:
        handles = Pending(
            [self.trainer.weight_buffer.call()], lambda v: list(v[0].values()), self.timeout_s, "weight_buffer"
        ).result()
        (handle,) = [h for h in handles if h is not None]  # rank 0's
        self.handle = handle
        Pending(
            self.generators.send_all("attach_weight_buffer", handle), list, self.timeout_s, "attach_weight_buffer"
        ).result()

    def after_shutdown(self) -> None:
        """The trainer unlinks the buffer's files on a clean exit; a killed trainer never does (same host)."""
        if self.handle is not None:
            remove_shared_files(self.handle)
