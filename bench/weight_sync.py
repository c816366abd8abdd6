"""Weight sync trainer -> generator on one GPU: CUDA IPC (meshrl.weight_sync.shared_buffer) beside a host round trip
and, when Monarch + torchstore are importable, the torchstore path.

    python bench/weight_sync.py [--torchstore]    # Qwen3-0.6B shape, random weights, bf16 transfer dtype
    python bench/weight_sync.py --tiny           # smoke test of the script (CPU: host path only)

Two processes: this one is the trainer (the real `Policy`, 'hf' backend: FSDP2 on a 1-process NCCL group, fp32
master weights), a spawned one is the generator (the real `TransformersEngine`). Per version the trainer changes its
weights in place (so every version differs), then:
- cuda_ipc: `Policy.publish_weights_ipc(v)` (live weights -> cast to bf16 -> the shared flat buffer, device
  sync, version mark), a pipe message, and in the generator `SharedBufferReceiver.load_into(engine, v)` (views ->
  engine weights, device sync). End to end = from the start of the publish until the generator's reply.
- host round trip: the same protocol with the flat buffer in host shared memory (/dev/shm): GPU -> host ->
  GPU, the baseline of a transport that stages through host memory.
- torchstore (`--torchstore`): `push_weights` + `pull_weights` through torchstore's storage-volume process,
  both called in the trainer process (the pulled CPU tensors are then copied to the GPU); the engine load in
  the generator is not part of this figure (add the cuda_ipc "load" column for it).
After the last version the generator's weights are checked against the trainer's (bf16) exactly.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import environment, make_model_dir, median, print_table, sync, write_json


def generator_proc(conn, model_dir: str, device: str) -> None:
    from meshrl.generation.transformers_engine import TransformersEngine
    from meshrl.weight_sync.shared_buffer import SharedBufferReceiver, device_identity

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    engine = TransformersEngine(model_dir, dtype="bfloat16", max_model_len=256, max_num_seqs=8, device=device)
    conn.send(("ready", device_identity(device)))
    receivers: dict[str, SharedBufferReceiver] = {}
    while True:
        msg = conn.recv()
        if msg[0] == "open":
            t0 = time.perf_counter()
            receivers[msg[1]] = SharedBufferReceiver(msg[2])
            conn.send(time.perf_counter() - t0)
        elif msg[0] == "load":
            t0 = time.perf_counter()
            v = receivers[msg[1]].load_into(engine, msg[2])
            conn.send((v, time.perf_counter() - t0))
        elif msg[0] == "checksums":
            sd = engine.model.state_dict()
            conn.send({k: float(sd[k].double().sum()) for k in msg[1]})
        elif msg[0] == "stop":
            for rx in receivers.values():
                rx.close()
            engine.shutdown()
            conn.send("bye")
            return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--versions", type=int, default=20)
    ap.add_argument("--torchstore", action="store_true")
    ap.add_argument("--torchstore-versions", type=int, default=3, help="torchstore moves 1.2 GB through host RPCs")
    args = ap.parse_args()

    from meshrl.policy import Policy
    from meshrl.weight_sync.shared_buffer import SharedBufferSender, choose_transport, device_identity

    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(
        "nccl" if dev.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1,
        **({"device_id": dev} if dev.type == "cuda" else {}),
    )  # fmt: skip
    model_dir = make_model_dir(tempfile.mkdtemp() + "/model", tiny=args.tiny)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    gen = ctx.Process(target=generator_proc, args=(child_conn, model_dir, str(dev)), daemon=True)
    gen.start()

    def recv():  # a dead generator must fail the run, not hang it
        while not conn.poll(1.0):
            if not gen.is_alive():
                raise RuntimeError(f"generator process died (exit code {gen.exitcode}); see its traceback above")
        return conn.recv()

    policy = Policy.from_options(model_dir, backend="hf", dtype="bfloat16", device=dev.type)
    _, gen_identity = recv()
    transport = choose_transport(device_identity(dev), gen_identity)
    bf16 = torch.bfloat16
    params = [p for p in policy.model.parameters()]
    results: dict[str, dict] = {}
    hf0 = policy.backend.hf_state_dict(snapshot=False)
    payload = {
        "env": environment(),
        "chosen_transport": transport,
        "tensors": len(hf0),
        "bytes": sum(t.numel() * 2 for t in hf0.values()),
        "results": results,
    }

    def new_version() -> None:
        with torch.no_grad():
            for p in params:
                p.add_(1e-3)  # every version differs
        sync(dev)

    def run(name: str, publish, first_version: int) -> int:
        """publish(v) makes v visible; the generator then loads it. Returns the next free version."""
        pub, load, e2e = [], [], []
        v = first_version
        for i in range(args.versions + 1):
            new_version()
            t0 = time.perf_counter()
            publish(v)
            t1 = time.perf_counter()
            conn.send(("load", name, v))
            got, load_s = recv()
            t2 = time.perf_counter()
            assert got == v, (got, v)
            if i:  # the first round includes one-time costs (buffer allocation, IPC open, graph warm-up)
                pub.append(t1 - t0)
                load.append(load_s)
                e2e.append(t2 - t0)
            v += 1
        results[name] = {
            "publish_ms": median(pub) * 1e3,
            "load_ms": median(load) * 1e3,
            "end_to_end_ms": median(e2e) * 1e3,
            "end_to_end_ms_all": [x * 1e3 for x in e2e],
        }
        # The generator runs exactly the trainer's last version.
        want = {k: float(t.to(bf16).double().sum()) for k, t in policy.backend.hf_state_dict().items()}
        conn.send(("checksums", list(want)))
        results[name]["exact_match"] = recv() == want
        print(name, {k: v for k, v in results[name].items() if not k.endswith("_all")}, flush=True)
        write_json("weight_sync", payload)
        return v

    version = 1
    if dev.type == "cuda":
        handle = policy.publish_weights_ipc(version, bf16)  # allocates the buffer
        conn.send(("open", "cuda_ipc", handle))
        results["ipc_open_ms"] = recv() * 1e3
        conn.send(("load", "cuda_ipc", version))
        recv()
        version = run("cuda_ipc", lambda v: policy.publish_weights_ipc(v, bf16), version + 1)

    host = SharedBufferSender.for_state_dict(hf0, "cpu", dtype=bf16)
    conn.send(("open", "host_round_trip", host.handle()))
    recv()
    run("host_round_trip", lambda v: host.publish(policy.backend.hf_state_dict(snapshot=False), v), 1)
    host.close()

    if args.torchstore:
        try:
            results["torchstore"] = torchstore_path(policy, args.torchstore_versions)
        except Exception as e:  # noqa: BLE001 - report why the optional path did not run
            results["torchstore"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print("torchstore", results["torchstore"], flush=True)

    conn.send(("stop",))
    recv()
    gen.join(timeout=60)
    write_json("weight_sync", payload)
    rows = []
    for name in ("cuda_ipc", "host_round_trip"):
        r = results.get(name)
        if r:
            rows.append([name, r["end_to_end_ms"], r["publish_ms"], r["load_ms"], r["exact_match"]])
    ts = results.get("torchstore")
    if ts and "error" not in ts:
        rows.append(["torchstore (push+pull+H2D)", ts["total_ms"], ts["push_ms"], ts["pull_ms"] + ts["h2d_ms"], "-"])
    elif ts:
        rows.append(["torchstore", None, None, None, ts["error"][:50]])
    print_table(
        f"weight sync trainer -> generator, {payload['tensors']} tensors, {payload['bytes'] / 1e9:.2f} GB bf16, "
        f"{payload['env']['device']}, chosen transport: {transport}"
        + (f", one-time IPC open {results['ipc_open_ms']:.1f} ms" if "ipc_open_ms" in results else ""),
        ["transport", "end-to-end ms", "trainer publish ms", "generator load ms", "exact"],
        rows,
    )
    dist.destroy_process_group()


def torchstore_path(policy, versions: int) -> dict:
    import asyncio

    from meshrl.weight_sync.store import init_weight_store, pull_weights, push_weights, shutdown_weight_store

    async def go() -> dict:
        await init_weight_store()
        push, pull, h2d = [], [], []
        try:
            for v in range(versions + 1):
                t0 = time.perf_counter()
                await push_weights(policy.hf_state_dict(torch.bfloat16), v)
                t1 = time.perf_counter()
                sd = await pull_weights(v)
                t2 = time.perf_counter()
                _ = {k: t.to(policy.device, non_blocking=True) for k, t in sd.items()}
                sync(policy.device)
                t3 = time.perf_counter()
                if v:
                    push.append(t1 - t0)
                    pull.append(t2 - t1)
                    h2d.append(t3 - t2)
        finally:
            await shutdown_weight_store()
        return {
            "push_ms": median(push) * 1e3,
            "pull_ms": median(pull) * 1e3,
            "h2d_ms": median(h2d) * 1e3,
            "total_ms": (median(push) + median(pull) + median(h2d)) * 1e3,
        }

    return asyncio.run(go())


if __name__ == "__main__":
    main()
