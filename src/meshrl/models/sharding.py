"""What both trainer backends decide the same way about FSDP2: whether to shard at all, in which dtype to reduce
gradients, and how to read a whole tensor back."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def use_fsdp(param_dtype: str, master_dtype: str) -> bool:
    """FSDP2 is needed with more than one rank, or to cast fp32 master weights to the compute dtype. On one rank
    with nothing to cast it shards nothing and only adds copies (an all-gather of the parameters per forward, a
    reduce-scatter of the gradients per backward, DTensor dispatch in the optimiser): the model runs as is."""
    return dist.get_world_size() > 1 or param_dtype != master_dtype


def reduce_dtype(master_dtype: str) -> str:
    """Gradients are summed over ranks in float32; on one rank nothing is summed, and with bf16 master weights a
    float32 'reduction' would only cast the gradients there and back."""
    return master_dtype if dist.get_world_size() == 1 else "float32"


def full_tensor(t: torch.Tensor, *, snapshot: bool = True) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) DTensor. `snapshot=False` allows returning the live parameter
    itself when one rank holds all of it (no all-gather copy): valid only until the next optimiser step."""
    if not isinstance(t, DTensor):
        return t
    if not snapshot and t.device_mesh.size() == 1:
        return t.to_local()
    return t.full_tensor()
