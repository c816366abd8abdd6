"""Trainer model backend 'hf': any transformers causal LM, built on the meta device, FSDP2-sharded
(`fully_shard` per decoder layer + the root, mixed precision; not on one rank with nothing to cast:
`sharding.use_fsdp`), materialised on the rank's device, HF
checkpoints in and out under the model's own names.

Same interface as `TorchtitanBackend` (attributes `model`, `hf_config`, `max_seq_len`, `vocab_size`; methods
`logits`, `hf_state_dict`, `load_hf`), so `meshrl.policy.Policy` runs the same endpoint and loss code on top.
Nothing here imports torchtitan or vLLM: this path runs on the GPU machine's preinstalled torch.

Gradient semantics: Policy divides each rank's loss by the GLOBAL token count, so FSDP must SUM gradients over
ranks (`set_gradient_divide_factor(1.0)`; on CPU gloo lacks PREMUL_SUM, hence force-sum reduction).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from meshrl.models import qwen3
from meshrl.models.hf_config import max_positions
from meshrl.models.logprobs import LogprobHead, target_logprobs
from meshrl.models.sharding import full_tensor, reduce_dtype, use_fsdp
from meshrl.models.vision import VisionInputs, is_vision_checkpoint

if TYPE_CHECKING:
    from meshrl.models.config import ModelConfig, TrainerConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_ATTN = {"sdpa": "sdpa", "flex": "flex_attention", "eager": "eager"}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformers model (the classes it lists in `_no_split_modules`), in order;
    failing that, the children of its longest `nn.ModuleList`."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    found = [m for m in model.modules() if type(m).__name__ in names]
    if found:
        return found
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard them")
    return list(max(lists, key=len))


def checkpoint_names(model: nn.Module) -> dict[str, str]:
    """State-dict name -> the name `save_pretrained` writes, where transformers renames (vision-language models keep
    their checkpoints' older layout: `model.language_model.layers.0...` is saved as `model.layers.0...`, and
    `model.visual...` as `visual...`). Exports then load in older loaders too, and the names are the checkpoint's,
    as for every other model. Only renames are followed: a conversion that merges or splits tensors is refused."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without weight conversions renames nothing
        return {}
    names = [k for k in model.state_dict()]
    marks = {k: torch.empty(0) for k in names}
    reverted = revert_weight_conversion(model, dict(marks))
    by_id = {id(v): k for k, v in reverted.items()}
    out = {}
    for k, v in marks.items():
        saved = by_id.get(id(v))
        if saved is None:
            raise ValueError(f"{type(model).__name__} converts {k!r} on saving beyond a rename; not supported")
        if saved != k:
            out[k] = saved
    return out


def is_vision_weight(name: str) -> bool:
    """A weight of a vision-language model's vision tower or its projector (by the names transformers uses)."""
    parts = name.split(".")
    return any(p in ("visual", "vision_tower", "vision_model", "multi_modal_projector", "vision_embed") for p in parts)


def init_non_persistent_buffers(model: nn.Module) -> None:
    """Recompute buffers that are not in checkpoints (RoPE `inv_freq`, ...) after `to_empty`.

    transformers itself materialises models from the meta device and re-initialises exactly these modules
    with `PreTrainedModel._init_weights`; we call it on modules that own buffers but no parameters, so no
    weight is touched (weights come from the checkpoint)."""
    init_fn = getattr(model, "_init_weights", None)
    for m in model.modules():
        has_buffers = any(b is not None for b in m.buffers(recurse=False))
        if has_buffers and not any(True for _ in m.parameters(recurse=False)):
            if init_fn is None:
                raise ValueError(f"{type(model).__name__} has no _init_weights to rebuild the buffers of {m}")
            with torch.no_grad():
                init_fn(m)


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """{alias name: canonical name} for state-dict entries that are the same Parameter (tied embeddings)."""
    seen: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            aliases[name] = seen[id(t)]
        else:
            seen[id(t)] = name
    return aliases


def retie(model: nn.Module, aliases: dict[str, str]) -> None:
    """Make each alias the same Parameter as its canonical entry again (after `to_empty`)."""
    for alias, canonical in aliases.items():
        owner, _, attr = alias.rpartition(".")
        param = model.get_parameter(canonical)
        if model.get_parameter(alias) is not param:
            setattr(model.get_submodule(owner), attr, param)


class HFBackend:
    """A transformers causal LM under FSDP2, as `ModelConfig` and `TrainerConfig` say. With LoRA
    (`ModelConfig.lora_options`) only the adapters train, and `hf_state_dict()` returns the merged weights under the
    base model's names.

    Speed levers (all off by default): `activation_checkpointing` (each decoder layer is recomputed in backward),
    `compile` (each decoder layer's forward goes through torch.compile), `logprob_chunk_size` (> 0: target
    logprobs through `meshrl.models.logprobs.chunked_linear_logprobs`, never the full float32 logits;
    `logprob_keep_logits`: its compute-dtype logits kept for backward instead of recomputed)."""

    name = "hf"
    supports_packing = True

    def __init__(
        self, model_dir: str, model_cfg: ModelConfig, trainer_cfg: TrainerConfig, *, device: torch.device
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        attn_backend, param_dtype, master_dtype = model_cfg.attn_backend, model_cfg.dtype, trainer_cfg.master_dtype
        lora, seed = model_cfg.lora_options(), model_cfg.seed
        compile, activation_checkpointing = trainer_cfg.compile, trainer_cfg.activation_checkpointing
        logprob_chunk_size, logprob_keep_logits = trainer_cfg.logprob_chunk_size, trainer_cfg.logprob_keep_logits

        if attn_backend not in _ATTN:
            raise ValueError(f"attn_backend={attn_backend!r}; use one of {sorted(_ATTN)}")
        for what, value in (("param_dtype", param_dtype), ("master_dtype", master_dtype)):
            if value not in _DTYPES:
                raise ValueError(f"{what}={value!r}; use one of {sorted(_DTYPES)}")
        self.device = torch.device(device)
        self.model_dir = str(model_dir)
        self.hf_config: dict[str, Any] = qwen3.read_hf_config(model_dir)
        config = AutoConfig.from_pretrained(model_dir)
        text = config.get_text_config()
        self.max_seq_len = max_positions(text)  # GPT-2: n_positions
        self.vocab_size = int(text.vocab_size)
        self.seed = seed
        with torch.device("meta"):
            # Master weights in `master_dtype` (fp32 by default); FSDP's mixed-precision policy casts to
            # `param_dtype` for compute.
            # A vision-language checkpoint (a `vision_config`) is an image-text-to-text model: its language model
            # is the causal LM the trainer scores, its vision tower turns Datum.images into the image tokens.
            auto = AutoModelForImageTextToText if is_vision_checkpoint(model_dir) else AutoModelForCausalLM
            model = auto.from_config(config, dtype=_DTYPES[master_dtype], attn_implementation=_ATTN[attn_backend])
        model.config.use_cache = False
        self.base_model = model  # the transformers model (inside the peft wrapper when LoRA is on)
        self.vision = VisionInputs.from_model_dir(model_dir, model)
        self._checkpoint_names = checkpoint_names(model)
        if self.vision is not None and model_cfg.freeze_vision:
            for name, p in model.named_parameters():
                if is_vision_weight(name):
                    p.requires_grad_(False)
        self.lora_config = None
        if lora:
            from peft import LoraConfig, get_peft_model

            self.lora_config = LoraConfig(**{"task_type": "CAUSAL_LM", "lora_dropout": 0.0, **lora})
            model = get_peft_model(model, self.lora_config)
        self.model = model
        layers = self._wrap_layers(decoder_layers(self.base_model), activation_checkpointing, compile)
        if use_fsdp(param_dtype, master_dtype):
            self._shard(layers, _DTYPES[param_dtype], _DTYPES[reduce_dtype(master_dtype)])
        tied = tied_aliases(self.model)  # before materialising: without FSDP, to_empty unties shared Parameters
        self.model.to_empty(device=self.device)
        retie(self.model, tied)
        init_non_persistent_buffers(self.base_model)
        self._aliases = {self._hf_name(a): self._hf_name(c) for a, c in tied_aliases(self.model).items()}
        if logprob_chunk_size < 0:
            raise ValueError(f"logprob_chunk_size={logprob_chunk_size} must be >= 0 (0: full logits)")
        head = self.base_model.get_output_embeddings()
        self.logprob_head = (
            LogprobHead(head, logprob_chunk_size, fused=compile, keep_logits=logprob_keep_logits)
            if logprob_chunk_size
            else None
        )
        # A vision-language model's image placeholders are not tokens it may write (the generators never sample
        # them: meshrl.generation, `placeholder_ids`), so the trainer's distribution leaves them out too, exactly.
        self.suppress = None
        if self.vision is not None:
            width = self.base_model.get_output_embeddings().weight.shape[0]  # the logits' width (global shape)
            self.suppress = torch.zeros(width, device=self.device)
            self.suppress[list(self.vision.placeholder_ids)] = float("-inf")
            self._placeholders = torch.tensor(self.vision.placeholder_ids, device=self.device)
            if self.logprob_head is not None:
                self.logprob_head.suppress = self.suppress
        self.model.eval()  # no dropout, ever: see `_no_dropout`

    # ---- dropout --------------------------------------------------------------------------------------------
    def _no_dropout(self) -> None:
        """The model runs in eval mode, in training too. A module built with `from_config` starts in train mode,
        and models with dropout (GPT-2: 0.1 on embeddings, attention and residuals; any config with
        `attention_dropout` > 0) would then drop activations in every forward: the trainer's logprobs would not be
        those of the policy the generator samples from (measured: ~3 nats apart on GPT-2), so importance ratios,
        KL terms and the reference model's logprobs would all be noise. RL trainers run without dropout (TRL's
        `disable_dropout` zeroes every dropout probability); eval mode is the one switch that covers every dropout a
        model has, `nn.Dropout` modules and the functional `dropout=... if self.training` of attention, without
        touching the config (an export keeps the checkpoint's dropout settings). Gradients are unaffected (eval mode
        does not disable autograd). Set at the end of `__init__` (after the peft, checkpoint and FSDP wrapping),
        after `load_hf`, and checked before every forward in case user code called `model.train()`."""
        if self.model.training:
            self.model.eval()

    # ---- build ----------------------------------------------------------------------------------------------
    def _shard(self, layers: list[nn.Module], param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        # On one rank, resharding after forward frees only the compute-dtype copies and costs a second
        # "all-gather" (cast + copy) per layer in backward: keep them.
        reshard = dist.get_world_size() > 1
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(self.model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                # Sum (not average) gradients over ranks: each rank's loss is already divided by the global
                # token count, so the sum is exactly the gradient of one big batch.
                m.set_gradient_divide_factor(1.0)
                if self.device.type == "cpu":
                    m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM

    def _wrap_layers(self, layers: list[nn.Module], activation_checkpointing: bool, compile: bool) -> list[nn.Module]:
        """Per decoder layer: activation checkpointing (the layer is recomputed in backward) and/or torch.compile
        (the layer's forward compiled in place). State-dict names do not change (checkpoint_wrapper strips its
        own prefix). Returns the blocks to shard (the wrappers when checkpointing)."""
        if activation_checkpointing:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                CheckpointImpl,
                checkpoint_wrapper,
            )

            targets = {id(m) for m in layers}
            wrapped_layers = []
            for parent in list(self.model.modules()):
                for child_name, child in list(parent.named_children()):
                    if id(child) in targets:
                        wrapped = checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
                        parent.register_module(child_name, wrapped)
                        wrapped_layers.append(wrapped)
            layers = wrapped_layers
        if compile:
            # torch's automatic dynamic shapes: the first shape compiles static, a second one recompiles once with
            # the changed dims symbolic. Token-budget micro-batches vary their packed row count every call: with
            # dynamic=False each new count recompiled, until dynamo's limit of 8, and later shapes ran eager (seen on
            # the GPU: the first step's training 50 s, later steps up to 1.7x slower).
            for layer in layers:
                layer.compile(dynamic=None)
        return layers

    # ---- forward --------------------------------------------------------------------------------------------
    def logits(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, pixels: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        self._no_dropout()
        # Packed rows: transformers reads the documents from `position_ids` when no attention mask is given (a
        # position that does not follow its predecessor starts a document) and masks attention across them.
        # `pixels`: the image processor's tensors of the rows' images (meshrl.models.vision), in token order.
        return self.model(input_ids=tokens, position_ids=positions, use_cache=False, **(pixels or {})).logits

    def target_logprobs(
        self,
        tokens: torch.Tensor,
        temperature: float = 1.0,
        positions: torch.Tensor | None = None,
        pixels: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """log p(tokens[:, i+1] | tokens[:, :i+1]), float32 `[B, L-1]`, chunked when `logprob_chunk_size` > 0;
        `positions`: per-document positions of packed rows; `pixels`: the rows' image inputs."""
        if self.logprob_head is None:
            out = target_logprobs(self.logits(tokens, positions, pixels), tokens, temperature, self.suppress)
        else:
            with self.logprob_head.armed(tokens, temperature):
                out = self.logits(tokens, positions, pixels)  # the head returned logprobs
        if self.suppress is not None:
            # An image token as a target (in a prompt: its loss mask is 0) has log p = -inf once suppressed, and
            # -inf · 0 is NaN in the masked sums: it is given 0 instead, as every other masked target is.
            placeholder = torch.isin(tokens[:, 1:], self._placeholders)
            out = out.masked_fill(placeholder, 0.0)
        return out

    # ---- names: our module's state-dict names <-> the HF checkpoint's names ---------------------------------
    def _hf_name(self, name: str) -> str:
        """Module state-dict name -> checkpoint name (drops peft's and checkpoint_wrapper's prefixes; renames what
        transformers renames on saving, e.g. Qwen2.5-VL's `model.language_model.` -> `model.`)."""
        for prefix in ("base_model.model.",):
            if name.startswith(prefix):
                name = name[len(prefix) :]
        name = name.replace("._checkpoint_wrapped_module", "").replace(".base_layer.", ".")
        return self._checkpoint_names.get(name, name)

    def _is_adapter(self, name: str) -> bool:
        return self.lora_config is not None and (".lora_" in name or "modules_to_save" in name)

    # ---- weights out ----------------------------------------------------------------------------------------
    def hf_state_dict(self, *, snapshot: bool = True) -> dict[str, torch.Tensor]:
        """Full weights under the checkpoint's names (tied aliases left out, as `save_pretrained` does).
        With LoRA the adapters are merged in: W + scaling · B @ A. Collective: every rank must call it.
        `snapshot=False`: on one rank, the live parameters themselves (copy them before the next step)."""
        if not snapshot and self.lora_config is None and dist.get_world_size() == 1:
            return self._live_state_dict()
        sd = {k: full_tensor(v, snapshot=snapshot) for k, v in self.model.state_dict().items()}
        out: dict[str, torch.Tensor] = {}
        for name, t in sd.items():
            if self._is_adapter(name):
                continue
            hf = self._hf_name(name)
            if hf in self._aliases:
                continue
            out[hf] = t
        if self.lora_config is not None:
            for prefix, (a, b, scaling, transposed) in self._lora_factors(sd).items():
                w = out[f"{prefix}.weight"]
                delta = scaling * (b.float() @ a.float())  # [out, in]
                out[f"{prefix}.weight"] = (w.float() + (delta.T if transposed else delta)).to(w.dtype)
        return out

    def hf_shards(self, *, live: bool = False) -> dict[str, torch.Tensor] | None:
        """What this rank holds of each weight (FSDP2 DTensors, or whole tensors on one rank unsharded) under the
        checkpoint's names, without gathering anything; None with LoRA, whose merge W + scaling · B @ A needs
        whole factors (publish `hf_state_dict` then). `live`: the parameters themselves, not a detached DTensor of
        each (two DTensor dispatches per weight, ~300 per call, in `state_dict()` and here): read them only, before
        the next step."""
        if self.lora_config is not None:
            return None
        out = {}
        for name, t in self.model.state_dict(keep_vars=live).items():
            hf = self._hf_name(name)
            if hf not in self._aliases:
                out[hf] = t if live else t.detach()
        return out

    def _live_state_dict(self) -> dict[str, torch.Tensor]:
        """One rank, no LoRA: the parameters' own local tensors under HF names, without a state_dict() pass or
        DTensor dispatch per tensor (~300 of them; this is the per-version cost of same-GPU weight sync). The
        Parameter objects are cached; their local tensors are read on every call (FSDP may swap them)."""
        if not hasattr(self, "_live_params"):
            live = []
            for name, t in self.model.state_dict(keep_vars=True).items():
                hf = self._hf_name(name)
                if hf not in self._aliases:
                    live.append((hf, t))
            self._live_params = live
        return {hf: (t._local_tensor if isinstance(t, DTensor) else t).detach() for hf, t in self._live_params}

    def _lora_factors(self, sd: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor, float, bool]]:
        """{module's checkpoint name: (A, B, scaling, transposed)} of every active adapter. `transposed`: the base
        weight is stored [in, out] (GPT-2's `Conv1D`; peft's `fan_in_fan_out`), so the delta B @ A goes in as its
        transpose."""
        from peft.tuners.lora import LoraLayer

        factors = {}
        for mod_name, m in self.model.named_modules():
            if not isinstance(m, LoraLayer):
                continue
            base = m.get_base_layer()
            if not isinstance(base, nn.Linear) and type(base).__name__ != "Conv1D":
                raise NotImplementedError(
                    f"LoRA merge supports linear layers (nn.Linear, GPT-2's Conv1D) only, not {type(base).__name__} "
                    f"({mod_name}); name linear modules in model.lora_target_modules"
                )
            transposed = bool(getattr(m, "fan_in_fan_out", False)) or type(base).__name__ == "Conv1D"
            for adapter in m.active_adapters:
                a = sd[f"{mod_name}.lora_A.{adapter}.weight"]
                b = sd[f"{mod_name}.lora_B.{adapter}.weight"]
                factors[self._hf_name(mod_name + ".")[:-1]] = (a, b, float(m.scaling[adapter]), transposed)
        return factors

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """Full adapter tensors under peft's file names (what `PeftModel.from_pretrained` reads). Collective."""
        if self.lora_config is None:
            raise ValueError("adapter_state_dict: this model has no LoRA adapters (model.lora_rank=0)")
        from peft.utils import get_peft_model_state_dict

        sd = {k: full_tensor(v) for k, v in self.model.state_dict().items() if self._is_adapter(k)}
        return get_peft_model_state_dict(self.model, state_dict=sd)

    def save_adapter(self, path: str) -> str | None:
        """Adapter-only checkpoint (adapter_model.safetensors + adapter_config.json), written by rank 0,
        atomically. Collective. Returns the path on rank 0."""
        import os
        import shutil
        import tempfile

        from safetensors.torch import save_file

        sd = self.adapter_state_dict()
        out = None
        if dist.get_rank() == 0:
            target = Path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
            try:
                save_file(
                    {k: v.detach().contiguous().cpu() for k, v in sd.items()}, str(tmp / "adapter_model.safetensors")
                )
                cfg = self.lora_config.to_dict()
                cfg["base_model_name_or_path"] = self.model_dir
                cfg = {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}
                (tmp / "adapter_config.json").write_text(json.dumps(cfg, indent=2, default=str))
                if target.exists():
                    shutil.rmtree(target)
                os.replace(tmp, target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            out = str(target)
        dist.barrier()
        return out

    # ---- weights in -----------------------------------------------------------------------------------------
    def load_hf(self, path: str) -> None:
        """Load an HF checkpoint (collective; every rank reads it and keeps its shard). With LoRA the base
        weights are replaced and the adapters restart from their initialisation (B = 0: the model equals the
        checkpoint)."""
        hf_cfg = qwen3.read_hf_config(path)
        for key in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads"):
            if hf_cfg.get(key) != self.hf_config.get(key):
                raise ValueError(
                    f"checkpoint {path} has {key}={hf_cfg.get(key)} but the trainer's model has "
                    f"{self.hf_config.get(key)}: it is a different architecture"
                )
        ckpt = qwen3.load_hf_state_dict(path)
        for alias, canonical in self._aliases.items():
            if alias not in ckpt and canonical in ckpt:
                ckpt[alias] = ckpt[canonical]
            elif canonical not in ckpt and alias in ckpt:
                ckpt[canonical] = ckpt[alias]
        current = self.model.state_dict()
        wanted = {self._hf_name(k) for k in current if not self._is_adapter(k)}
        missing = wanted - ckpt.keys()
        unexpected = ckpt.keys() - wanted
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {path} does not match the model: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
        with torch.no_grad():
            for name, param in current.items():
                if self._is_adapter(name):
                    continue
                _copy_full(param, ckpt[self._hf_name(name)])
        if self.lora_config is not None:
            self.reset_adapters()
        self._no_dropout()

    def reset_adapters(self) -> None:
        """LoRA's initialisation, the same on every rank (seeded): A ~ kaiming-uniform, B = 0."""
        g = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            for name, param in self.model.state_dict().items():
                if ".lora_A." in name:
                    full = torch.empty(param.shape)
                    bound = 1.0 / (param.shape[1] ** 0.5)  # kaiming_uniform_(a=sqrt(5)), as nn.Linear / peft
                    full.uniform_(-bound, bound, generator=g)
                    _copy_full(param, full)
                elif ".lora_B." in name or ".lora_embedding_B." in name:
                    _copy_full(param, torch.zeros(param.shape))


def _copy_full(param: torch.Tensor, value: torch.Tensor) -> None:
    value = value.to(device=param.device, dtype=param.dtype)
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"shape mismatch: checkpoint {tuple(value.shape)} vs model {tuple(param.shape)}")
    if isinstance(param, DTensor):
        value = distribute_tensor(value, param.device_mesh, param.placements)  # keep this rank's shard
    param.copy_(value)
