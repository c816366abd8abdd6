"""Device memory shared by a trainer and a generator on one GPU: handed to whichever phase runs, and recorded.

In the synchronous loop the generator's KV cache sits idle while the trainer trains, and the trainer's AdamW state
sits idle while the generator generates. `MemoryHandoff` moves that memory between them at the phase boundaries:

    handoff = MemoryHandoff(ctl, sleep_level=1, offload_optimizer=True)
    batch = sample(...)              # generation: the generator holds its cache
    handoff.to_trainer()             # generator sleeps (level 1: KV cache freed; 2: weights too)
    train_step(...)                  # the trainer's token budget sees the freed memory
    handoff.to_generator()           # trainer's cached blocks (and AdamW state) freed, generator wakes
    ctl.sync_weights()

and `record(phase)` reads every process's memory (allocated / reserved now, peak since the last reading) into the
step's metrics (`memory/<phase>/<process>_<what>_gib`), on CPU runs too (resident set size), so that the CPU tests go
through the same calls as a GPU run.

The asynchronous loop (`asynchronous=True`) never waits on a generator here: an actor serves its calls in order, and
when a step's batch is taken the generators are already sampling the next rounds, so a reading would wait for a whole
round and the trainer would idle through it (issue 32: 1.48 s of a 3.42 s step). The generators' reading is sent
instead and reported when it has come back — one step later, answered between rounds: the peak of the round
that step trained on. The trainer's reading waits: the trainer has no work queued at these points.
"""

from __future__ import annotations

from typing import Any

from meshrl.controller.api import Controller


class MemoryHandoff:
    def __init__(
        self, ctl: Controller, *, sleep_level: int = 0, offload_optimizer: bool = False, asynchronous: bool = False
    ) -> None:
        if asynchronous and sleep_level:
            raise ValueError("the asynchronous loop generates while the trainer trains: generators cannot sleep then")
        self.ctl, self.sleep_level, self.offload_optimizer = ctl, sleep_level, offload_optimizer
        self.asynchronous = asynchronous
        self.generators_asleep = False
        self._generator_readings: list[Any] | None = None  # asynchronous: sent, not yet reported

    @property
    def active(self) -> bool:
        return bool(self.sleep_level or self.offload_optimizer)

    def to_trainer(self) -> None:
        """After generation: the generators release their cache (sleep) before the trainer's calls are planned."""
        if self.sleep_level and self.ctl.generators is not None and not self.generators_asleep:
            self.ctl.sleep_generators(self.sleep_level)
            self.generators_asleep = True

    def to_generator(self) -> None:
        """After the optimiser step: the trainer's AdamW state goes to the host (it comes back on the trainer's next
        call by itself), and the generators wake, ready for the weight load and the next generation."""
        if self.offload_optimizer and self.ctl.trainer is not None:
            self.ctl.offload_optimizer_state().result()
        if self.generators_asleep:
            if self.ctl.trainer is not None:  # the step's activations stay cached in the trainer's allocator
                self.ctl.release_trainer_memory()
            self.ctl.wake_generators()
            self.generators_asleep = False

    def record(self, phase: str) -> dict[str, float]:
        """Every trainer rank's and generator's memory (GiB), peak since the previous reading. Asynchronous: the
        generators' readings are those sent at an earlier call, if they have come back (see the module's doc)."""
        readings: list[tuple[str, dict[str, Any]]] = []
        if self.ctl.trainer is not None:
            readings += [(f"trainer{r}", m) for r, m in enumerate(self.ctl.trainer_memory())]
        if self.ctl.generators is not None:
            readings += [(f"generator{r}", m) for r, m in enumerate(self._generator_memory(phase))]
        out: dict[str, float] = {}
        for name, reading in readings:
            for key, value in reading.items():
                if isinstance(value, bool) or not isinstance(value, int | float):
                    continue  # e.g. the engine's device name
                if key.endswith("_bytes"):
                    key, value = key.removesuffix("_bytes") + "_gib", value / 2**30
                out[f"memory/{phase}/{name}_{key}"] = round(float(value), 3)
        return out

    def _generator_memory(self, phase: str) -> list[dict[str, Any]]:
        if not self.asynchronous:
            return self.ctl.generator_memory()
        if phase != "generate":  # one reading per step, taken where the step's batch is
            return []
        sent, done = self._generator_readings, []
        if sent is not None and all(call.ready() for call in sent):
            done = [call.get(timeout=self.ctl.timeout_s) for call in sent]  # already here: no wait
            sent = None
        if sent is None:
            self._generator_readings = self.ctl.generators.send_all("memory")
        return done
