"""vLLM worker extension that reloads weights in place, and the encoding of what the driver sends it.

vLLM mixes this class into its worker class when the engine is built with
``worker_extension_cls="meshrl.generation.vllm_worker_ext.WeightUpdateExtension"``; its methods are then
reachable from the driver through ``LLM.collective_rpc("meshrl_update_weights", args=(...))``, both with the
in-process engine (CPU here) and with multiprocess / tensor-parallel workers (GPU). Each worker receives the
full HF-named weights and vLLM's own weight loaders shard them.

What crosses ``collective_rpc`` must be plain bytes / ints / None: with the multiprocess engine (vLLM V1's
default on GPU, ``VLLM_ENABLE_V1_MULTIPROCESSING=1``) the driver sends the call's args to the engine-core
process with msgpack and no type information, so a tensor arrives as a list (GPU) or raw memoryview (CPU) and a
dataclass as a dict. So the driver pickles tensors and handles to bytes (`encode_weights`, `encode_object`) and
the worker methods unpickle them (`decode_weights`, `decode_object`). The worker methods also still accept the
unencoded objects, for callers that reach the worker directly (an in-worker callable, as bench/generation.py
does). Pickle is safe here: the bytes come from this engine's own driver process.

Method names must not collide with attributes of vLLM's worker (vLLM asserts this when it mixes the class in),
hence the ``meshrl_`` prefix.

This module must stay importable without Monarch or vLLM; it imports vLLM only inside the method (it is only
ever called inside a vLLM worker, where vLLM is already imported).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Iterator
from typing import Any

import torch

CHUNK_BYTES = 1 << 30
"""Tensor bytes per pickled blob of `encode_weights`: msgpack cannot carry a bytes object of 4 GiB or more, so a
large model travels as several blobs (a single tensor of >= 4 GiB still cannot cross a multiprocess engine)."""

_BYTES = (bytes, bytearray, memoryview)


def _owning(t: torch.Tensor) -> torch.Tensor:
    """`t` on the CPU, contiguous and owning exactly its own storage: pickling a view would pickle the whole
    storage it views (e.g. a whole shared weight buffer for every tensor)."""
    t = t.detach().to("cpu").contiguous()
    if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def encode_weights(weights: Iterable[tuple[str, torch.Tensor]], *, chunk_bytes: int = CHUNK_BYTES) -> list[bytes]:
    """(name, tensor) pairs -> pickled blobs of CPU tensors (dtype, shape and values exact; bf16 included), each
    holding about `chunk_bytes` of tensor data at most (one tensor per blob if it is larger). Order is kept."""
    blobs: list[bytes] = []
    part: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        t = _owning(tensor)
        nbytes = t.numel() * t.element_size()
        if part and size + nbytes > chunk_bytes:
            blobs.append(pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL))
            part, size = [], 0
        part.append((str(name), t))
        size += nbytes
    if part:
        blobs.append(pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL))
    return blobs


def decode_weights(payload: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Inverse of `encode_weights` (a list of blobs), one blob unpickled at a time. Anything else is taken as
    already-decoded (name, tensor) pairs and passed through."""
    items = list(payload) if isinstance(payload, (list, tuple)) else None
    if items is None or not items or not all(isinstance(b, _BYTES) for b in items):
        yield from ((str(name), tensor) for name, tensor in (items if items is not None else payload))
        return
    for blob in items:
        yield from pickle.loads(blob)


def encode_object(obj: Any) -> bytes:
    """Any picklable object (e.g. a `SharedBufferHandle`) -> bytes that cross `collective_rpc` intact."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def decode_object(payload: Any) -> Any:
    """Inverse of `encode_object`; a payload that is not bytes is returned as it is (already an object)."""
    return pickle.loads(payload) if isinstance(payload, _BYTES) else payload


class WeightUpdateExtension:
    """Mixed into vLLM's worker; ``self`` is the worker (has ``model_runner`` and ``vllm_config``)."""

    def meshrl_update_weights(self, weights: list[bytes] | Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named checkpoint tensors (`encode_weights` blobs, or (name, tensor) pairs) into the running
        model, in place. Returns how many were loaded.

        Plain ``model.load_weights`` is not enough: on CPU, linear weights are repacked for oneDNN after
        loading, so the kernels would keep using the old packed copy. ``reload_weights`` (vLLM's layerwise
        in-place reload) re-runs that post-processing for every layer it loads into.
        """
        from vllm.config import set_current_vllm_config

        pairs = list(decode_weights(weights))
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

    def meshrl_update_weights_ipc(self, handle, version: int | None = None) -> tuple[int, int]:
        """Load `version` (None: the latest) from a trainer's shared flat buffer (`meshrl.weight_sync.shared_buffer`)
        in place. `handle` is a `SharedBufferHandle`, or one encoded with `encode_object` (what `VLLMEngine` sends).
        Returns (the version loaded, how many tensors).

        The handle is opened once per worker and kept (opening CUDA IPC memory is the slow part); every later
        call only copies from the views. The slot stays locked against the trainer while vLLM copies from it.
        Only a worker on the trainer's GPU can open a CUDA handle (same-GPU, colocated layout); a /dev/shm-backed
        handle (CPU) opens in any process of the host."""
        from meshrl.weight_sync.shared_buffer import SharedBufferReceiver

        handle = decode_object(handle)
        rx = getattr(self, "_meshrl_ipc_receiver", None)
        if rx is None or rx.handle.control_path != handle.control_path:
            if rx is not None:
                rx.close()
            rx = SharedBufferReceiver(handle)
            self._meshrl_ipc_receiver = rx
        with rx.read(version) as (got, views):
            return got, self.meshrl_update_weights(views.items())
