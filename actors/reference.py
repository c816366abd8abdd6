"""ReferenceModel: a frozen copy of the policy, forward only (per-token logprobs for KL terms). One actor per
rank; the weights are FSDP-sharded over its own mesh exactly like the trainer's (same `meshrl.policy.Policy`
code), but nothing is ever trained: no gradients, and no optimiser state is ever allocated."""

from __future__ import annotations

import os

import torch
from monarch.actor import Actor, endpoint

from meshrl.types import Datum


class ReferenceModel(Actor):
    def __init__(self, model_dir: str, model_cfg, trainer_cfg, pad_id: int = 0) -> None:
        torch.set_num_threads(trainer_cfg.num_threads)
        self.model_dir, self.model_cfg, self.trainer_cfg, self.pad_id = model_dir, model_cfg, trainer_cfg, pad_id
        self.policy = None

    @endpoint
    async def setup(self) -> dict:
        from meshrl.policy import policy_from_env

        self.policy = policy_from_env(self.model_dir, self.model_cfg, self.trainer_cfg, self.pad_id)
        for p in self.policy.model.parameters():
            p.requires_grad_(False)
        # Eval mode, as the trainer's (HFBackend keeps its model there): the reference logprobs of a model with
        # dropout must be the deterministic ones the KL term compares against, not a dropped-out sample.
        self.policy.model.eval()
        from meshrl.devices import freeze_startup_heap

        freeze_startup_heap()
        return {"rank": self.policy.rank, "world_size": self.policy.world_size, "pid": os.getpid()}

    @endpoint
    async def forward(self, data: list[Datum], temperature: float = 1.0) -> list[list[float]]:
        """Per-datum logprobs of the target tokens (`len(tokens) - 1` each), no gradient."""
        if self.policy is None:
            raise RuntimeError("ReferenceModel.setup() was not called")
        return self.policy.forward(data, temperature)
