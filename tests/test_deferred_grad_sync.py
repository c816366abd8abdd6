"""--trainer.defer-grad-sync (issue 33, item 1): two FSDP2 ranks accumulate a step's gradients unsharded and
reduce-scatter them once, in the last call. k calls on 2 ranks, deferred or not, equal one call of the whole batch
to float rounding (that one call equals one rank's big batch: tests/test_trainer_endpoints.py). A real gloo process
group of 2 ranks (spawned processes) and the real Policy."""

from __future__ import annotations

import pytest
import torch
from conftest import random_data
from procs import free_port, run_ranks

from meshrl.types import LossSpec, OptimParams

# Adam with a huge eps is SGD with lr/eps: the update is linear in the gradient, so comparing weights after one step
# compares the accumulated gradients themselves.
LINEAR_ADAM = OptimParams(lr=1.0, eps=1e3, grad_clip=0.0)
CALLS, PER_CALL = 4, 2


def _train(rank: int, port: int, model_dir: str, out: str) -> None:
    """On each of 2 ranks: the step as one call, as CALLS calls, and as CALLS calls with the sync deferred."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from meshrl.models.sharding import full_tensor
    from meshrl.policy import Policy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        data = random_data(CALLS * PER_CALL, seed=5)
        spec = LossSpec("grpo", num_loss_tokens=sum(d.num_loss_tokens for d in data))
        runs = {}
        for name, calls, defer in (("one_call", 1, False), ("each_call", CALLS, False), ("deferred", CALLS, True)):
            policy = Policy.from_options(model_dir, backend="hf", defer_grad_sync=defer)
            step = OptimParams(**{**LINEAR_ADAM.__dict__, "num_micro_batches": calls})
            size = len(data) // calls
            synced_early = None
            for c in range(calls):
                part = data[c * size : (c + 1) * size]
                last = c == calls - 1
                result = policy.forward_backward(part, spec, step=step if last else None, split=[size // 2] * 2)
                if c == 0 and not last:  # reduce-scattered into sharded (DTensor) grads already, or still whole?
                    synced_early = any(isinstance(p.grad, DTensor) for p in policy.model.parameters())
            weights = {n: full_tensor(p.detach()).clone() for n, p in policy.model.named_parameters()}
            runs[name] = {"weights": weights, "grad_norm": result.optim.grad_norm, "synced_early": synced_early}
        if rank == 0:
            torch.save(runs, out)
    finally:
        dist.destroy_process_group()


def test_deferred_sync_on_two_ranks_equals_one_batch(base_model_dir, tmp_path):
    out = str(tmp_path / "runs.pt")
    run_ranks(_train, 2, free_port(), base_model_dir, out, timeout_s=300)
    runs = torch.load(out)
    one = runs["one_call"]
    # Deferred: nothing reached the sharded gradients after the first call; not deferred: it did.
    assert runs["deferred"]["synced_early"] is False and runs["each_call"]["synced_early"] is True
    moved = max((one["weights"][n] - w).abs().max().item() for n, w in _initial(base_model_dir).items())
    assert moved > 1e-4  # the step moved the weights: the comparisons below are not vacuous
    for name in ("each_call", "deferred"):
        run = runs[name]
        assert run["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5), name
        for key, w in one["weights"].items():
            torch.testing.assert_close(run["weights"][key], w, rtol=1e-5, atol=1e-7, msg=lambda m, k=key: f"{k}: {m}")


def _initial(model_dir: str) -> dict[str, torch.Tensor]:
    from meshrl.models.qwen3 import load_hf_state_dict

    return load_hf_state_dict(model_dir)
