"""Trainer model backend 'torchtitan': Qwen3 built on the meta device, FSDP2 through torchtitan's
parallelize (unless one rank has nothing to shard or cast: `sharding.use_fsdp`), materialised on the rank's
device, HF weights in and out through the state-dict adapter.

A backend owns the (sharded) module and the conversion to and from HF tensors; `meshrl.policy.Policy` owns
the optimiser and the endpoint math, whatever the backend.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from meshrl.models import qwen3
from meshrl.models.hf_config import check_backend_supports, max_positions
from meshrl.models.logprobs import LogprobHead, target_logprobs
from meshrl.models.sharding import full_tensor, reduce_dtype, use_fsdp
from meshrl.models.titan_import import compile_deferred_kernels

if TYPE_CHECKING:
    from meshrl.models.config import ModelConfig, TrainerConfig

__all__ = ["TorchtitanBackend", "full_tensor", "load_full_state_dict"]


def load_full_state_dict(model: torch.nn.Module, full: dict[str, torch.Tensor], *, source: str) -> None:
    """Copy full (unsharded) tensors into a possibly FSDP-sharded module; every rank passes the same tensors."""
    current = model.state_dict()
    missing, unexpected = current.keys() - full.keys(), full.keys() - current.keys()
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {source} does not match the model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    with torch.no_grad():
        for name, param in current.items():
            value = full[name].to(device=param.device, dtype=param.dtype)
            if isinstance(param, DTensor):
                value = distribute_tensor(value, param.device_mesh, param.placements)  # keep this rank's shard
            param.copy_(value)


def document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """Boolean [B, 1, L, L] mask for packed rows: causal, and no attention across documents (a document starts
    wherever its position restarts at 0)."""
    doc = torch.cumsum(positions == 0, dim=1)
    L = positions.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=positions.device).tril()
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]


# Unmasked (causal) rows: cuDNN's fused attention first, as torchtitan orders it. torch's own default order
# (flash, efficient, math, cuDNN last) leaves the H100 on FA2. CPU builds skip what they lack.
CAUSAL_SDPA_BACKENDS = [
    SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH
]  # fmt: skip


class DocumentMaskedSDPA(torch.nn.Module):
    """torchtitan's SDPA inner attention refuses masks; this one takes the document mask of packed rows (and is
    plain causal SDPA without one). Parameter-free, so it can replace the built module on the meta device."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, is_causal=True, **_):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, L, N, H) -> (B, N, L, H)
        if attention_masks is None:
            with sdpa_kernel(CAUSAL_SDPA_BACKENDS, set_priority=True):
                out = F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=is_causal, enable_gqa=enable_gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_masks, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


class TorchtitanBackend:
    """torchtitan Qwen3 under torchtitan's parallelize, as `ModelConfig` (attention kernel, compute dtype) and
    `TrainerConfig` say. Speed levers (off by default): `activation_checkpointing`
    (torchtitan's full AC per block), `compile` (torchtitan's per-block torch.compile), `logprob_chunk_size`
    (> 0: chunked target logprobs, never the full float32 logits; see `meshrl.models.logprobs`; with
    `logprob_keep_logits` its compute-dtype logits kept for backward instead of recomputed), `master_dtype`
    ('bfloat16': pure bf16 weights and optimiser state instead of fp32 masters)."""

    name = "torchtitan"
    supports_packing = True

    def __init__(
        self, model_dir: str, model_cfg: ModelConfig, trainer_cfg: TrainerConfig, *, device: torch.device
    ) -> None:
        attn_backend, param_dtype, master_dtype = model_cfg.attn_backend, model_cfg.dtype, trainer_cfg.master_dtype
        compile, activation_checkpointing = trainer_cfg.compile, trainer_cfg.activation_checkpointing
        logprob_chunk_size, logprob_keep_logits = trainer_cfg.logprob_chunk_size, trainer_cfg.logprob_keep_logits
        if logprob_chunk_size < 0:
            raise ValueError(f"logprob_chunk_size={logprob_chunk_size} must be >= 0 (0: full logits)")
        self.device, self.attn_backend = device, attn_backend
        self.activation_checkpointing, self.compile = activation_checkpointing, compile
        check_backend_supports(model_dir, "torchtitan")  # a clear ConfigError for a Llama/GPT-2/... checkpoint
        self.hf_config = qwen3.read_hf_config(model_dir)
        self.titan_config = qwen3.titan_config_from_hf(self.hf_config, attn_backend=attn_backend)
        if attn_backend != "sdpa" or compile:
            # Flex attention calls torchtitan's compiled kernels, and dynamo traces a compiled model into them:
            # make them now, as torchtitan would have at import (meshrl.models.titan_import).
            compile_deferred_kernels()
        self.max_seq_len = max_positions(self.hf_config)
        self.vocab_size = int(self.hf_config["vocab_size"])
        self.model = self._build_fsdp_model(param_dtype, master_dtype)
        self.logprob_head = (
            LogprobHead(self.model.lm_head, logprob_chunk_size, fused=compile, keep_logits=logprob_keep_logits)
            if logprob_chunk_size
            else None
        )

    def _build_fsdp_model(self, param_dtype: str, master_dtype: str) -> torch.nn.Module:
        import torchtitan.distributed.parallel_dims as parallel_dims_mod
        from torch.distributed.fsdp import FSDPModule
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed.activation_checkpoint import FullAC
        from torchtitan.models.qwen3 import parallelize_qwen3

        if self.device.type == "cpu":
            # torchtitan assumes an accelerator; on CPU its meshes must be built for "cpu" (gloo).
            parallel_dims_mod.device_type = "cpu"
        # On one rank, resharding after forward only frees the compute-dtype copies and costs a second
        # all-gather-equivalent copy in backward (the hf backend does the same; measured there: +6 % tok/s).
        parallelism = ParallelismConfig(
            spmd_backend="partial_dtensor",
            data_parallel_shard_degree=-1,
            fsdp_reshard_after_forward="never" if dist.get_world_size() == 1 else "default",
        )
        parallel_dims = ParallelDims.from_config(parallelism, dist.get_world_size())
        parallel_dims.build_mesh()
        model = qwen3.build_model_on_meta(self.titan_config)
        if master_dtype != "float32":
            # Parameters only (in place: tied weights stay one Parameter); the RoPE cache keeps its own dtype.
            for param in model.parameters():
                param.data = param.data.to(getattr(torch, master_dtype))
        if self.attn_backend == "sdpa":
            for block in model.layers.values():
                block.attention.inner_attention = DocumentMaskedSDPA()
        parallelize_qwen3(
            model,
            parallel_dims=parallel_dims,
            training=TrainingConfig(
                mixed_precision_param=param_dtype, mixed_precision_reduce=reduce_dtype(master_dtype)
            ),
            parallelism=parallelism,
            compile_config=CompileConfig(enable=self.compile, components=["model"]),
            ac_config=FullAC.Config() if self.activation_checkpointing else None,
            dump_folder=os.devnull,
            skip_dp=not use_fsdp(param_dtype, master_dtype),
        )
        for m in model.modules():
            if isinstance(m, FSDPModule):
                # Sum (not average) gradients over ranks: each rank's loss is already divided by the global
                # token count, so the sum is exactly the gradient of one big batch.
                m.set_gradient_divide_factor(1.0)
                if self.device.type == "cpu":
                    m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_states(buffer_device=self.device)  # RoPE buffers; weights are loaded next
        return model

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            if self.attn_backend != "flex":
                return self.model(tokens)
            # torchtitan's FlexAttention needs a BlockMask on every call: plain causal (one document per row),
            # built once per batch shape.
            key = tuple(tokens.shape)
            if getattr(self, "_causal_mask_key", None) != key:
                rows = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
                self._causal_mask, self._causal_mask_key = self.model.get_attention_masks(rows), key
            return self.model(tokens, attention_masks=self._causal_mask)
        if self.attn_backend == "sdpa":
            masks = document_causal_mask(positions)
        else:  # flex: torchtitan's block-causal document mask
            masks = self.model.get_attention_masks(positions)
        return self.model(tokens, positions=positions, attention_masks=masks)

    def target_logprobs(
        self, tokens: torch.Tensor, temperature: float = 1.0, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """log p(tokens[:, i+1] | tokens[:, :i+1]), float32 `[B, L-1]`, chunked when `logprob_chunk_size` > 0."""
        if self.logprob_head is None:
            return target_logprobs(self.logits(tokens, positions), tokens, temperature)
        with self.logprob_head.armed(tokens, temperature):
            return self.logits(tokens, positions)  # the head returned logprobs

    def hf_state_dict(self, *, snapshot: bool = True) -> dict[str, torch.Tensor]:
        """Full weights under HF names. Collective: every rank must call it. `snapshot=False`: on one rank, the
        live parameters themselves (copy them before the next step)."""
        full = {k: full_tensor(v, snapshot=snapshot) for k, v in self.model.state_dict().items()}
        return qwen3.titan_to_hf(full, self.titan_config)

    def hf_shards(self, *, live: bool = False) -> dict[str, torch.Tensor] | None:
        """What this rank holds of each weight (its FSDP2 DTensors) under HF names, without gathering anything;
        None when the state-dict adapter does more than rename (fusing or permuting needs whole tensors). `live`:
        the parameters themselves, not a detached DTensor of each: read them only, before the next step."""
        from meshrl.weight_sync.shards import renamed_only

        if live:
            sd = dict(self.model.state_dict(keep_vars=True))
        else:
            sd = {k: v.detach() for k, v in self.model.state_dict().items()}
        with torch.no_grad():  # an adapter that computes (and is then refused) records no graph
            hf = qwen3.titan_to_hf(sd, self.titan_config)
        return hf if renamed_only(sd, hf) else None

    def load_hf(self, path: str) -> None:
        hf_cfg = qwen3.read_hf_config(path)
        for key in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads"):
            if hf_cfg.get(key) != self.hf_config.get(key):
                raise ValueError(
                    f"checkpoint {path} has {key}={hf_cfg.get(key)} but the trainer's model has "
                    f"{self.hf_config.get(key)}: it is a different architecture"
                )
        titan_sd = qwen3.hf_to_titan(qwen3.load_hf_state_dict(path), self.titan_config)
        load_full_state_dict(self.model, titan_sd, source=path)
