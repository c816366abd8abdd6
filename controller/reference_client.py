"""The reference model — `ReferenceModel` × num_procs, a frozen forward-only copy of the policy, FSDP-sharded — for
the KL term. Only programs with a KL term start one (`Controller.start_reference`).

    reference = ReferenceClient(provision, "runs/r1/reference_model", model_cfg, trainer_cfg, pad_id, num_procs=1,
                                timeout_s=600)
    reference.wait_ready()
    logprobs = reference.logprobs(data).result()
"""

from __future__ import annotations

from typing import Any

from meshrl.controller.futures import Pending, _rank0
from meshrl.controller.provision import Provisioner
from meshrl.types import Datum


class ReferenceClient:
    """Spawns the processes that load `model_dir` (an HF checkpoint dir) with the trainer's model and trainer
    configs; `wait_ready` waits for them."""

    def __init__(
        self,
        provision: Provisioner,
        model_dir: str,
        model_cfg: Any,
        trainer_cfg: Any,
        pad_id: int,
        *,
        num_procs: int = 1,
        timeout_s: float,
    ) -> None:
        from monarch.spmd import setup_torch_elastic_env

        from meshrl.actors.reference import ReferenceModel

        self.num_procs, self.timeout_s = num_procs, timeout_s
        self.procs = provision.procs("reference", num_procs)
        setup_torch_elastic_env(self.procs)
        self.actors = self.procs.spawn("reference", ReferenceModel, str(model_dir), model_cfg, trainer_cfg, pad_id)

    def wait_ready(self) -> None:
        Pending([self.actors.setup.call()], _rank0, self.timeout_s, "ReferenceModel.setup").result()

    def logprobs(self, data: list[Datum], temperature: float = 1.0) -> Pending[list[list[float]]]:
        """Reference-model logprobs of every datum's targets (any batch size: padded to the mesh, then dropped)."""
        n = len(data)
        padded = list(data) + [data[-1]] * ((-n) % self.num_procs)
        fut = self.actors.forward.call(padded, temperature)
        return Pending([fut], lambda v: _rank0(v)[:n], self.timeout_s, "ReferenceModel.forward")
