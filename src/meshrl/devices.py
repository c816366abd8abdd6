"""Which GPU each process of a run computes on (`--trainer.devices`, `--generator.devices`).

Every process is pinned before it touches CUDA by restricting what it can see (`CUDA_VISIBLE_DEVICES`), so inside it
the chosen GPU is `cuda:0` for torch, vLLM and NCCL alike, and nothing else in the code needs to know:

    trainer.devices = [0, 1], generator.devices = [2, 3]  ->  trainer ranks on GPUs 0 and 1, replicas on 2 and 3
    trainer.devices = [0],    generator.devices = [1]     ->  trainer on GPU 0, generator on GPU 1 (weight sync by
                                                              torchstore: meshrl.weight_sync.transport sees two GPUs)

Unset (None), a process keeps the machine's defaults: trainer rank r on `LOCAL_RANK` r, every generator on GPU 0.
No Monarch in here; the actors call `pin_process` first thing in their constructors.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import cache


@cache
def machine_identity() -> str:
    """Equal in two processes exactly when they share a kernel and /dev/shm (one machine, one container): the
    boot id and the /dev/shm mount. A pid means something only to a process with the same identity."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown"
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    st = os.stat(shm)
    return f"{boot}/{st.st_dev}/{st.st_ino}"


def device_of(devices: Sequence[int] | None, rank: int) -> int | None:
    """The GPU index of process `rank` of a role: `devices[rank % len(devices)]` (replicas may share a GPU when
    there are more of them than devices); None when unset."""
    if not devices:
        return None
    return int(devices[rank % len(devices)])


def pin_process(devices: Sequence[int] | None, rank: int) -> int | None:
    """Make this process see only its GPU (before CUDA is initialised in it). Returns the GPU index, or None when
    `devices` is unset (nothing changes)."""
    device = device_of(devices, rank)
    if device is None:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:  # already restricted (a job scheduler): index into what this process was given
        allowed = [d.strip() for d in visible.split(",") if d.strip()]
        if device >= len(allowed):
            raise ValueError(
                f"device {device} asked for, but CUDA_VISIBLE_DEVICES={visible!r} gives this job {len(allowed)}; "
                "--trainer.devices / --generator.devices index into those"
            )
        os.environ["CUDA_VISIBLE_DEVICES"] = allowed[device]
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(device)
    os.environ["LOCAL_RANK"] = "0"  # the one visible GPU (meshrl.policy.policy_from_env sets it current)
    return device


def ieee_float32_convolutions(dtype: str, device: str | object) -> bool:
    """cuDNN convolutions without TF32 in this process, where `dtype` is float32 on a CUDA `device`; returns whether
    it set them so. torch lets cuDNN multiply float32 convolutions in TF32 by default (cudnn.allow_tf32 is True,
    unlike matmuls), so a vision tower's patch embedding (a Conv3d) ran in TF32 in the trainer and the transformers
    engine, while vLLM computes it as a float32 matmul: on one H100 the real-sized Qwen2.5-VL tower's sampled-token
    logprobs differed from vLLM's by up to 2.5e-3 (bench/NOTES.md). float32 is the parity setting, so its
    convolutions are IEEE. The legacy flag, not `cudnn.conv.fp32_precision`: setting the conv flag alone makes
    torch's own reads of the legacy flag raise (conv and RNN would then differ)."""
    import torch

    if dtype != "float32" or torch.device(device).type != "cuda":
        return False
    torch.backends.cudnn.allow_tf32 = False
    return True


def use_expandable_segments() -> bool:
    """This process's CUDA allocations go into expandable segments (TrainerConfig.expandable_segments), unless the
    user set PYTORCH_CUDA_ALLOC_CONF: theirs stands. Returns whether they are on."""
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        import torch

        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    return expandable_segments_on()


def expandable_segments_on() -> bool:
    settings = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
    return "expandable_segments:true" in settings


def check_devices(devices: Sequence[int] | None, flag: str) -> None:
    """Config-time check of a devices list (raises ValueError naming the flag)."""
    if devices is None:
        return
    if not devices:
        raise ValueError(f"{flag} is empty: list GPU indices (e.g. 0,1), or leave it unset")
    if any(int(d) < 0 for d in devices):
        raise ValueError(f"{flag}={list(devices)}: GPU indices are >= 0")


def freeze_startup_heap() -> None:
    """Move every object made so far (the imported libraries, the model's Python objects) out of the garbage
    collector's sight, once a process is set up. At exit Python's last collection walked that whole heap: ~2.5 s of
    every trainer process's stop, so of every run's end (py-spy: gc_collect_main). It also spares the collections
    during training from re-walking it; objects made later are collected as usual. (vLLM freezes its engine's
    startup objects for the same reason.)

    What stays frozen is still alive when the interpreter tears its modules down, and nanobind-built extensions
    (triton's) then print a page of "leaked ..." lines per process. Nothing of the run is said at that point (the
    process was asked to stop, its errors already went to the controller), so its stderr goes to /dev/null from the
    first exit handler on."""
    import atexit
    import gc

    gc.collect()
    gc.freeze()
    atexit.register(_silence_stderr)


def _silence_stderr() -> None:
    import sys

    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
