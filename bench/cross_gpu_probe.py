"""Which way should weights cross GPUs of one host? (issue 32, item 2) Measured on a two-GPU machine:

  A. CUDA IPC into a process that sees only its own GPU (CUDA_VISIBLE_DEVICES=1) of a buffer on GPU 0
  B. CUDA IPC into a process that sees its GPU first and the trainer's second (CUDA_VISIBLE_DEVICES=1,0),
     then a device-to-device copy over NVLink into a buffer on its own GPU
  C. NCCL broadcast between two processes that each see one GPU (a process group built once)

for a flat bf16 buffer the size of a Qwen3-0.6B state dict (1.19 GB). Prints a table; JSON to $OUT.

    python bench/cross_gpu_probe.py            (on a machine with two GPUs)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp

NBYTES = int(os.environ.get("PROBE_BYTES", 596_049_920 * 2))
REPEATS = 10


def _sender(conn, barrier_q) -> None:  # GPU 0: owns the buffer, shares its handle
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    buf = torch.empty(NBYTES, dtype=torch.uint8, device="cuda:0")
    buf.random_(0, 255)
    torch.cuda.synchronize()
    share = buf.untyped_storage()._share_cuda_()
    conn.send((share, int(buf.sum(dtype=torch.int64).item())))
    conn.recv()  # keep the buffer alive until every receiver is done


def _receiver(visible: str, src_index: int, share, checksum: int, out_q) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = visible
    res = {"visible": visible}
    try:
        torch.cuda.set_device(0)
        t0 = time.perf_counter()
        dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = share
        storage = torch.UntypedStorage._new_shared_cuda(
            src_index, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync
        )
        src = torch.empty(0, dtype=torch.uint8, device=f"cuda:{src_index}").set_(storage)
        res["open_ms"] = (time.perf_counter() - t0) * 1e3
        dst = torch.empty(NBYTES, dtype=torch.uint8, device="cuda:0")
        times = []
        for _ in range(REPEATS):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        res["copy_ms"] = statistics.median(times[2:])
        res["equal"] = int(dst.sum(dtype=torch.int64).item()) == checksum
        res["src_device"] = str(src.device)
        res["ok"] = True
    except Exception as e:  # noqa: BLE001 - the probe reports what failed
        res["ok"] = False
        res["error"] = f"{type(e).__name__}: {e}"[:400]
    out_q.put(res)


def _nccl(rank: int, out_q) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method="tcp://127.0.0.1:29517", rank=rank, world_size=2, device_id=torch.device("cuda:0")
    )
    buf = torch.empty(NBYTES, dtype=torch.uint8, device="cuda:0")
    if rank == 0:
        buf.random_(0, 255)
    times = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(buf, src=0)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    total = torch.tensor([int(buf.sum(dtype=torch.int64).item())], device="cuda:0")
    sums = [torch.zeros_like(total) for _ in range(2)]
    dist.all_gather(sums, total)
    if rank == 1:
        out_q.put(
            {"nccl_broadcast_ms": statistics.median(times[2:]), "equal": bool(sums[0] == sums[1]), "first_ms": times[0]}
        )
    dist.destroy_process_group()


def main() -> None:
    ctx = mp.get_context("spawn")
    results: dict = {"bytes": NBYTES, "gpus": torch.cuda.device_count()}
    parent, child = ctx.Pipe()
    sender = ctx.Process(target=_sender, args=(child, None))
    sender.start()
    share, checksum = parent.recv()
    out_q = ctx.Queue()
    for name, visible, idx in (("A_own_gpu_only", "1", 0), ("B_both_visible", "1,0", 1)):
        p = ctx.Process(target=_receiver, args=(visible, idx, share, checksum, out_q))
        p.start()
        p.join(120)
        results[name] = out_q.get(timeout=5) if p.exitcode == 0 else {"ok": False, "exit": p.exitcode}
    parent.send("done")
    sender.join(30)
    try:
        procs = [ctx.Process(target=_nccl, args=(r, out_q)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(180)
        results["C_nccl"] = out_q.get(timeout=5)
    except Exception:  # noqa: BLE001
        results["C_nccl"] = {"error": traceback.format_exc()[-400:]}
    gb = NBYTES / 1e9
    print(f"\n{'way':24} {'ok':>5} {'ms':>8} {'GB/s':>7}  note")
    for name in ("A_own_gpu_only", "B_both_visible", "C_nccl"):
        r = results[name]
        ms = r.get("copy_ms", r.get("nccl_broadcast_ms"))
        note = r.get("error") or ", ".join(f"{k} {r[k]}" for k in ("open_ms", "first_ms", "equal") if k in r)
        rate = gb / (ms / 1e3) if ms else 0.0
        print(f"{name:24} {str(ms is not None):>5} {ms or 0:8.2f} {rate:7.1f}  {note}")
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "cross_gpu_probe.json"), "w") as f:
        json.dump(results, f, indent=1)
    json.dump(results, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
