"""A vision-language model on two FSDP2 trainer ranks (issue 34): a rank whose share of a call holds no image (text
rows, padding) still runs the vision tower (a stand-in row, counted 0), so the ranks' collectives match, and the
step equals the same batch on one rank. Real gloo process groups (spawned processes), the real Policy, a tiny
Qwen2.5-VL made in code."""

from __future__ import annotations

import numpy as np
import torch
from procs import free_port, run_ranks

from meshrl.types import LossSpec, OptimParams

LINEAR_ADAM = OptimParams(
    lr=1.0, eps=1e3, grad_clip=0.0
)  # an update linear in the gradient (as in test_deferred_grad_sync)


def _batch(model_dir: str):
    """Two image rows then two text-only rows: split [2, 2], rank 1 gets no image."""
    from PIL import Image

    from meshrl.rollout.images import wire_image
    from meshrl.rollout.render import Renderer
    from meshrl.rollout.row import Row
    from meshrl.types import Datum

    renderer = Renderer.from_model_dir(model_dir)
    out = []
    for k in range(4):
        if k < 2:
            picture = Image.fromarray((np.random.RandomState(k).rand(64, 64, 3) * 255).astype("uint8"))
            prompt = [{"role": "user", "content": [{"type": "image", "image": wire_image(picture)},
                                                   {"type": "text", "text": "How many?"}]}]  # fmt: skip
        else:
            prompt = f"What is {k} + {k}?"
        row = Row(prompt)
        d = Datum.from_completion(renderer.prompt_ids(row), [20 + k, 21, 22], [-1.0] * 3, advantage=1.0 - k / 2)
        d.images = renderer.prompt_images(row) or None
        out.append(d)
    return out


def _step(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from meshrl.models.sharding import full_tensor
    from meshrl.policy import Policy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        policy = Policy.from_options(model_dir, backend="hf")
        data = _batch(model_dir)
        spec = LossSpec("grpo", num_loss_tokens=sum(d.num_loss_tokens for d in data))
        result = policy.forward_backward(data, spec, step=LINEAR_ADAM, split=[len(data) // world] * world)
        weights = {n: full_tensor(p.detach()).clone() for n, p in policy.model.named_parameters()}
        if rank == 0:
            torch.save({"weights": weights, "loss": result.loss}, out)
    finally:
        dist.destroy_process_group()


def test_two_ranks_one_without_images_step_as_one_rank(tmp_path):
    from meshrl.models.tiny_vlm import create_tiny_vlm

    model_dir = str(create_tiny_vlm(tmp_path / "model", "qwen2_5_vl"))
    for world in (1, 2):
        run_ranks(_step, world, world, free_port(), model_dir, str(tmp_path / f"{world}.pt"), timeout_s=300)
    one, two = torch.load(tmp_path / "1.pt"), torch.load(tmp_path / "2.pt")
    assert abs(one["loss"] - two["loss"]) < 1e-5
    visual = [n for n in one["weights"] if ".visual." in n or n.startswith("visual.") or "model.visual" in n]
    assert visual
    for name, w in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], w, atol=1e-5, rtol=1e-4, msg=name)
