"""vLLM worker extension that reloads weights in place.

vLLM mixes this class into its worker class when the engine is built with
``worker_extension_cls="meshrl.generation.vllm_worker_ext.WeightUpdateExtension"``; its methods are then
reachable from the driver through ``LLM.collective_rpc("meshrl_update_weights", args=(...))``, both with the
in-process engine (CPU here) and with multiprocess / tensor-parallel workers (GPU). Each worker receives the
full HF-named weights and vLLM's own weight loaders shard them.

Method names must not collide with attributes of vLLM's worker (vLLM asserts this when it mixes the class in),
hence the ``meshrl_`` prefix.

This module must stay importable without Monarch; it imports vLLM only inside the method (it is only ever
called inside a vLLM worker, where vLLM is already imported).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class WeightUpdateExtension:
    """Mixed into vLLM's worker; ``self`` is the worker (has ``model_runner`` and ``vllm_config``)."""

    def meshrl_update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named checkpoint tensors into the running model, in place. Returns how many were sent.

        Plain ``model.load_weights`` is not enough: on CPU, linear weights are repacked for oneDNN after
        loading, so the kernels would keep using the old packed copy. ``reload_weights`` (vLLM's layerwise
        in-place reload) re-runs that post-processing for every layer it loads into.
        """
        from vllm.config import set_current_vllm_config

        pairs = [(str(name), tensor) for name, tensor in weights]
        runner = self.model_runner  # type: ignore[attr-defined]
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            runner.reload_weights(weights_iterator=iter(pairs), is_checkpoint_format=True)

            # Tied lm_head trap: with tied embeddings the weights usually have no lm_head.weight, so the
            # layerwise reload never "loads" the lm_head module and never re-runs its post-processing. Its
            # weight shares storage with embed_tokens (so it holds the new values), but on CPU the packed GEMM
            # handle built from the old values is kept and the logits come out of the OLD head. Re-run it.
            model = runner.get_model()
            hf_config = self.vllm_config.model_config.hf_config  # type: ignore[attr-defined]
            text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
            lm_head = getattr(model, "lm_head", None)
            quant_method = getattr(lm_head, "quant_method", None)
            if getattr(text_config, "tie_word_embeddings", False) and quant_method is not None:
                quant_method.process_weights_after_loading(lm_head)
        return len(pairs)

    def meshrl_update_weights_ipc(self, handle, version: int | None) -> tuple[int, int]:
        """Load `version` (None: the latest) from a trainer's shared flat buffer (`meshrl.weight_sync.cuda_ipc`)
        in place. Returns (the version loaded, how many tensors).

        The handle is opened once per worker and kept (opening CUDA IPC memory is the slow part); every later
        call only copies from the views. The slot stays locked against the trainer while vLLM copies from it.
        Only a worker on the trainer's GPU can open a CUDA handle (same-GPU, colocated layout); a /dev/shm-backed
        handle (CPU) opens in any process of the host."""
        from meshrl.weight_sync.cuda_ipc import CudaIpcReceiver

        rx = getattr(self, "_meshrl_ipc_receiver", None)
        if rx is None or rx.handle.control_path != handle.control_path:
            if rx is not None:
                rx.close()
            rx = CudaIpcReceiver(handle)
            self._meshrl_ipc_receiver = rx
        with rx.read(version) as (got, views):
            return got, self.meshrl_update_weights(views.items())
