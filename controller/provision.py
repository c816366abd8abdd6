"""Where the run's processes start: the one place that spawns process meshes (the `Controller` asks it by role).

'local': this machine (`this_host()`). 'hosts': Monarch workers that were started beforehand, one per host
(`python -m meshrl.controller.worker --address tcp://HOST:PORT`, by hand, by `srun`, or as a Kubernetes pod's
command); the controller attaches to them through Monarch (`attach_to_workers`) and spawns each role's processes
on the host `PlacementConfig` names for it. Nothing here opens a connection of its own: Monarch carries every
message, weight sync through torchstore included.
"""

from __future__ import annotations

from typing import Any

from meshrl.config import PlacementConfig

ROLES = ("trainer", "generator", "reward", "reference")


class Provisioner:
    def __init__(self, cfg: PlacementConfig | None = None) -> None:
        self.cfg = cfg or PlacementConfig()
        self._hosts: Any = None

    def host(self, role: str) -> Any:
        """The Monarch host mesh (one host) that `role`'s processes start on."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; one of {ROLES}")
        if self.cfg.kind == "local":
            from monarch.actor import this_host

            return this_host()
        if self._hosts is None:
            from monarch.actor import attach_to_workers

            # TLS between controller and workers is not plumbed in this Monarch (attach_to_workers raises for it):
            # run the workers on a private network, as a Slurm or Kubernetes job's nodes are.
            self._hosts = attach_to_workers(ca="trust_all_connections", workers=self.cfg.worker_addresses)
        # The reference model goes beside the trainer: it computes the same batches' logprobs.
        index = getattr(self.cfg, f"{'trainer' if role == 'reference' else role}_host")
        return self._hosts.slice(hosts=index % len(self.cfg.worker_addresses))

    def procs(self, role: str, num: int) -> Any:
        """A mesh of `num` new processes for `role`."""
        return self.host(role).spawn_procs(per_host={"procs": num})

    def describe(self) -> str:
        if self.cfg.kind == "local":
            return "every process on this machine"
        hosts = self.cfg.worker_addresses
        where = {
            role: hosts[getattr(self.cfg, f"{role}_host") % len(hosts)] for role in ("trainer", "generator", "reward")
        }
        return "; ".join(f"{role}s on {address}" for role, address in where.items())
