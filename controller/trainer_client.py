"""The trainer mesh — `PolicyTrainer` × `trainer.num_procs` ranks, FSDP over them — as futures-returning calls.

    trainer = TrainerClient(provision, model_dir, model_cfg, trainer_cfg, pad_id, timeout_s=600, heartbeat_s=20,
                            failures=[])      # spawned; the model loads while the caller starts its other meshes
    trainer.wait_ready()
    result = trainer.forward_backward(data, loss, step=params).result()
    trainer.weight_buffer.call()              # any other PolicyTrainer endpoint (a subclass's own too), watched

Not replaceable (its ranks hold the optimiser state), but watched: a frozen rank ends the run named as frozen within
`heartbeat_s` of a call waiting on it (controller/replicas.py). `policy_version` follows every result that reports
one.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from meshrl.actors import PolicyTrainer
from meshrl.controller.futures import Pending, _rank0
from meshrl.controller.provision import Provisioner
from meshrl.controller.replicas import WatchedMesh, process_state
from meshrl.devices import machine_identity
from meshrl.types import Datum, ForwardBackwardResult, LossSpec, OptimParams, OptimResult


class TrainerClient:
    def __init__(
        self,
        provision: Provisioner,
        model_dir: str,
        model_cfg: Any,
        cfg: Any,
        pad_id: int,
        *,
        timeout_s: float,
        heartbeat_s: float,
        failures: list[str],
    ) -> None:
        from monarch.spmd import setup_torch_elastic_env

        from meshrl.actors.heartbeat import Heartbeat

        self.cfg, self.timeout_s, self.failures = cfg, timeout_s, failures
        self.procs = provision.procs("trainer", cfg.num_procs)
        setup_torch_elastic_env(self.procs)  # RANK/WORLD_SIZE/MASTER_ADDR for torch.distributed
        self.actors = WatchedMesh(
            self.procs.spawn("trainer", PolicyTrainer, model_dir, model_cfg, cfg, pad_id),
            self.procs.spawn("heartbeat", Heartbeat),
            what=f"a trainer process ({cfg.num_procs} ranks)",
            heartbeat_s=heartbeat_s,
            on_frozen=self.kill,
            dead=self.dead_ranks,
            on_wedged=lambda: self.kill("trainer rank failed inside a collective call"),
        )
        self.mesh = self.actors.mesh  # the actors, unwatched
        self._ready = Pending(  # unwatched: its heartbeat may still be starting while the model loads
            [self.mesh.setup.call()], lambda v: list(v[0].values()), timeout_s, "PolicyTrainer.setup"
        )
        self.info: dict[str, Any] = {"policy_version": 0}  # rank 0's `info()` once ready
        self.pids: list[int] = []
        self.elsewhere = False  # a rank on another machine (its pid is not ours to kill)
        self.policy_version = 0

    def __getattr__(self, endpoint: str) -> Any:
        """Any other PolicyTrainer endpoint, watched: `trainer.push_weights.call(version, dtype)`."""
        if endpoint.startswith("_") or "actors" not in self.__dict__:
            raise AttributeError(endpoint)
        return getattr(self.actors, endpoint)

    def wait_ready(self) -> dict[str, Any]:
        """Wait for every rank's model (sent at construction); returns rank 0's info."""
        infos = self._ready.result()
        self.info, self.pids = infos[0], [i["pid"] for i in infos]
        self.elsewhere = any(i.get("machine") != machine_identity() for i in infos)
        self.policy_version = self.info["policy_version"]
        return self.info

    def dead_ranks(self) -> str | None:
        """The trainer ranks whose processes are gone ("trainer rank 1 of 2 (pid 4242)"; None: none of this machine's,
        or their pids are not known yet). A rank on another machine is named by Monarch's message only."""
        if self.elsewhere or not self.pids:
            return None
        n = len(self.pids)
        gone = [
            f"trainer rank {r} of {n} (pid {pid})"
            for r, pid in enumerate(self.pids)
            if process_state(pid) in (None, "Z")
        ]
        return " and ".join(gone) or None

    def kill(self, why: str = "trainer frozen") -> None:
        """A frozen trainer rank cannot stop itself, and the others wait for it in a collective (so do the ranks
        that stayed in a call in which one rank raised): kill them all (the run ends; its checkpoints are on
        disk)."""
        self.failures.append(why)
        if self.elsewhere:
            # Its pids are another machine's: Monarch's host agents there stop the processes (not waited on).
            self.procs.stop()
            return
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # ---- training ---------------------------------------------------------------------------------------------
    def forward_backward(
        self, data: list[Datum], loss: LossSpec, step: OptimParams | None = None, split: list[int] | None = None
    ) -> Pending[ForwardBackwardResult]:
        """`step`: this call ends an optimiser step and takes it (result in `.optim`; see Policy.forward_backward).
        `split`: how many of `data` (rank-major) each trainer rank computes; None: an even split."""

        def done(values: list[Any]) -> ForwardBackwardResult:
            result: ForwardBackwardResult = _rank0(values)
            if result.optim is not None:
                self.policy_version = result.optim.policy_version
            return result

        return Pending(
            [self.actors.forward_backward.call_collective(data, loss, step, split)],
            done,
            self.timeout_s,
            "forward_backward",
            self.dead_ranks,
        )

    def forward(
        self, data: list[Datum], temperature: float = 1.0, split: list[int] | None = None
    ) -> Pending[list[list[float]]]:
        return Pending(
            [self.actors.forward.call_collective(data, temperature, split)],
            _rank0,
            self.timeout_s,
            "forward",
            self.dead_ranks,
        )

    def optim_step(self, params: OptimParams) -> Pending[OptimResult]:
        def done(values: list[Any]) -> OptimResult:
            result: OptimResult = _rank0(values)
            self.policy_version = result.policy_version
            return result

        return Pending(
            [self.actors.optim_step.call_collective(params)], done, self.timeout_s, "optim_step", self.dead_ranks
        )

    def token_budget(self) -> int:
        """Tokens per trainer rank and `forward_backward` call: trainer.max_tokens_per_micro_batch, or when unset what
        the tightest rank's device can hold now (Policy.token_budget)."""
        if self.cfg.max_tokens_per_micro_batch is not None:
            return self.cfg.max_tokens_per_micro_batch
        budgets = Pending(
            [self.actors.token_budget.call()],
            lambda v: list(v[0].values()),
            self.timeout_s,
            "token_budget",
            self.dead_ranks,
        )
        return min(budgets.result())

    def micro_batch_plan(self, lengths: list[int], max_seqs: int | None = None) -> list[list[list[int]]]:
        """Sequences (by length) -> `forward_backward` calls -> per-rank indices, under `token_budget()` and at most
        `max_seqs` sequences per call (meshrl.batching.plan_micro_batches; `split=rank_sizes(call)`)."""
        from meshrl.batching import plan_micro_batches

        tc = self.cfg
        return plan_micro_batches(
            lengths, num_ranks=tc.num_procs, max_tokens=self.token_budget(), max_seqs=max_seqs,
            pack=tc.pack_sequences, row_len=tc.pack_row_len,
        )  # fmt: skip

    # ---- memory -----------------------------------------------------------------------------------------------
    def memory(self) -> list[dict[str, float]]:
        """Each trainer rank's device memory (GiB): allocated / reserved now, peak since the last call."""
        return Pending(
            [self.actors.memory.call()], lambda v: list(v[0].values()), self.timeout_s, "memory", self.dead_ranks
        ).result()

    def release_memory(self) -> int:
        """Every trainer rank's cached allocator blocks back to the device (bytes released, summed)."""
        call = self.actors.release_cached_memory.call()
        return Pending(
            [call], lambda v: sum(v[0].values()), self.timeout_s, "release_cached_memory", self.dead_ranks
        ).result()

    def offload_optimizer_state(self) -> Pending[int]:
        """The trainer's AdamW state to host memory until its next forward_backward / optim_step (bytes moved)."""
        return Pending(
            [self.actors.offload_optimizer_state.call()],
            lambda v: sum(v[0].values()),
            self.timeout_s,
            "offload",
            self.dead_ranks,
        )

    def peak_memory_gib(self) -> float | None:
        """The largest peak device memory of any trainer rank since it started (None for trainers on CPU)."""
        infos = Pending(
            [self.actors.info.call()], lambda v: list(v[0].values()), self.timeout_s, "info", self.dead_ranks
        ).result()
        peaks = [i["peak_memory_gib"] for i in infos if i["peak_memory_gib"] is not None]
        return max(peaks) if peaks else None

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        """The trainer's full state (model + optimiser, torch DCP) into `path` (see meshrl.checkpoint for the
        atomic run checkpoints that also hold the controller's state)."""
        Pending(
            [self.actors.save_checkpoint.call(path)], _rank0, self.timeout_s, "save_checkpoint", self.dead_ranks
        ).result()

    def load_checkpoint(self, path: str) -> int:
        """Restore the trainer's full state, or — for an HF checkpoint dir — just its weights. Returns the policy
        version now held by the trainer."""
        from meshrl.checkpoint import is_hf_dir

        endpoint = self.actors.load_hf if is_hf_dir(path) else self.actors.load_checkpoint
        self.policy_version = Pending(
            [endpoint.call(path)], _rank0, self.timeout_s, "load_checkpoint", self.dead_ranks
        ).result()
        return self.policy_version

    def export_hf(self, path: str, dtype: str | None = None) -> str:
        """The trainer's weights as an HF checkpoint (config, safetensors, tokenizer), written atomically."""
        return Pending(
            [self.actors.export_hf.call(path, dtype)], _rank0, self.timeout_s, "export_hf", self.dead_ranks
        ).result()
