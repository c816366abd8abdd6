"""The run's weight sync, controller side: one object.

It owns the run's torchstore (opened before the generators start, closed at shutdown), resolves the transport once
the processes run (`meshrl.weight_sync.transport`), makes the trainer's publisher and the generators' subscribers
(`meshrl.weight_sync.pubsub`), hands the shared buffer's handle over once, keeps track of what each generator was
asked to load, frees torchstore versions nobody will load again, and cleans up at shutdown.
`Controller.sync_weights` is this object's `sync`.

    weights = WeightSync(generator_cfg, store_name, timeout_s, versions_kept=K + 1)   # K: --grpo.max-staleness
    weights.open_store(host=provision.host("trainer"), num_volumes=trainer_cfg.num_procs)
    ...                                                   # the trainer and the generators start
    weights.start(trainer, generators, trainer_identity, generator_identities)
    weights.sync(version)                                 # every step; wait=False: the asynchronous loop
    weights.close_store(timeout_s)                        # at shutdown; after_shutdown() once the processes are gone
"""

from __future__ import annotations

import asyncio
import sys
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
    """Trainer → generators, for one Controller. `cfg`: the GeneratorConfig (`weight_sync`: the transport asked for,
    `dtype`: what travels). `store_name`: its own torchstore (two Controllers in one process never see each other's
    versions). `versions_kept`: torchstore versions kept while generators' loads are queued (the asynchronous loop
    with max_staleness K keeps K + 1)."""

    def __init__(self, cfg: Any, store_name: str, timeout_s: float, *, versions_kept: int = 2) -> None:
        self.requested, self.dtype = cfg.weight_sync, cfg.dtype
        self.store_name, self.timeout_s, self.versions_kept = store_name, timeout_s, versions_kept
        self.trainer: Any = None  # the trainer's (watched) actor mesh and the generators' pool, from `start`
        self.generators: ReplicaPool | None = None
        self.transport: str | None = None
        self.handle = None  # the shared buffer's handle, once attached (its files are removed at shutdown)
        self.last_synced: int | None = None
        self.loads_in_flight: list[tuple[int, list[ReplicaCall]]] = []  # sync(wait=False) loads, unconfirmed
        self.stored_versions: list[int] = []  # torchstore versions not deleted yet

    def open_store(self, *, host: Any, num_volumes: int) -> None:
        """The run's torchstore, unless the transport asked for is a shared buffer ('auto' may end up needing it):
        `num_volumes` storage volumes on `host` (one per trainer rank, on the trainer's host: each rank puts its own
        shards into a process of its own, next to it, and generators fetch from all of them; weight_sync/store.py).
        Before the generators start."""
        if self.requested not in SHARED_BUFFER_TRANSPORTS:
            # Imported here: torchstore and DTensor cost a controller ~1 s of start-up that a shared buffer never needs.
            from meshrl.weight_sync.store import init_weight_store

            asyncio.run(init_weight_store(self.store_name, host=host, num_volumes=num_volumes))

    def start(
        self, trainer: Any, generators: ReplicaPool, trainer_identity: str, generator_identities: list[str],
        num_params: int | None = None,
    ) -> str:  # fmt: skip
        """Resolve `generator.weight_sync` against where the processes run (trainer rank 0 publishes) and make the
        trainer's publisher. Shared-buffer transports hand the buffer to the generators at the first sync.
        `num_params`: the model's, to check at launch that /dev/shm can hold a shared buffer of the weights."""
        from meshrl.weight_sync.transport import describe_transport, resolve_transport, weight_nbytes

        self.trainer, self.generators = trainer, generators
        weight_bytes = None if num_params is None else weight_nbytes(num_params, self.dtype)
        self.transport = resolve_transport(
            self.requested, trainer_identity, generator_identities, weight_bytes=weight_bytes
        )
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
        pushed = self._push(version)
        if self.transport in SHARED_BUFFER_TRANSPORTS and self.handle is None and not self._attach_buffer():
            pushed = self._push(version)  # the buffer could not be opened: 'auto' pushes again over torchstore
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
        if self.generators is None:  # not started (no trainer): nothing was sent to the generators
            return
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

    def _push(self, version: int) -> int:
        return Pending(
            [self.trainer.push_weights.call_collective(version, self.dtype, self.store_name)],
            lambda v: sum(v[0].values()),
            self.timeout_s,
            "push_weights",
        ).result()

    def _attach_buffer(self) -> bool:
        """Send the shared buffer's handle to every generator (once, after the first push). False where a generator
        could not open it and 'auto' went back to torchstore: two GPUs without peer access (a generator on another
        GPU than the trainer's maps the buffer's memory peer to peer)."""
        handle = self.handle = self._buffer_handle()
        try:
            Pending(
                self.generators.send_all("attach_weight_buffer", handle), list, self.timeout_s, "attach_weight_buffer"
            ).result()
            return True
        except Exception as e:  # noqa: BLE001 - an IPC handle that cannot be opened; said and handled below
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            if self.requested != "auto":
                raise RuntimeError(
                    f"generator.weight_sync={self.requested!r}: a generator could not open trainer rank 0's weight "
                    f"buffer ({why}); GPUs without peer access cannot share it: use --generator.weight-sync "
                    "torchstore (or auto, which falls back by itself)"
                ) from e
        print(f"[meshrl] weight sync: a generator could not open trainer rank 0's buffer ({why}); 'auto' goes on "
              "with torchstore", flush=True)  # fmt: skip
        Pending(self.generators.send_all("attach_weight_buffer", None), list, self.timeout_s, "detach").result()
        Pending(
            [self.trainer.set_weight_sync.call("torchstore", self.store_name)], _rank0, self.timeout_s,
            "set_weight_sync",
        ).result()  # fmt: skip
        self.transport, self.handle = "torchstore", None  # the trainer removed the buffer's files with it
        return False

    def _buffer_handle(self) -> Any:
        """Trainer rank 0's shared-buffer handle (the other ranks answer None)."""
        handles = Pending(
            [self.trainer.weight_buffer.call()], lambda v: list(v[0].values()), self.timeout_s, "weight_buffer"
        ).result()
        (handle,) = [h for h in handles if h is not None]
        return handle

    def close_store(self, timeout_s: float) -> None:
        """Drop the torchstore and stop its volumes (best effort, at shutdown, before the processes stop)."""
        store = sys.modules.get("meshrl.weight_sync.store")
        if store is None:  # never imported in this process, so it made no store to drop (open_store imports it)
            return
        try:
            asyncio.run(asyncio.wait_for(store.shutdown_weight_store(self.store_name), timeout_s))
        except Exception:  # noqa: BLE001 - best effort at exit
            pass

    def after_shutdown(self) -> None:
        """The trainer unlinks the buffer's files on a clean exit; a killed trainer never does (same host)."""
        if self.handle is not None:
            remove_shared_files(self.handle)
