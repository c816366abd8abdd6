"""Same-GPU weight sync (meshrl.weight_sync.shared_buffer). On CPU: the flat layout (pack / views / unpack),
`choose_transport`, the version and slot rules, and the whole publish/read protocol over the CPU backing (a
/dev/shm file instead of a CUDA IPC handle), in one process and across two. Tests named `*_gpu` need CUDA."""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from markers import needs_cuda, needs_two_gpus

from meshrl.weight_sync.shared_buffer import (
    ALIGN,
    FlatLayout,
    SharedBufferReceiver,
    SharedBufferSender,
    VersionControl,
    WeightVersionUnavailable,
    choose_transport,
    device_identity,
)

torch.set_num_threads(1)


def _state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(13, 8, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g),
        "model.norm.weight": torch.randn(3, generator=g),  # 12 bytes in bf16: forces alignment padding
        "step": torch.tensor([7, 8], dtype=torch.int64),  # not floating point: keeps its dtype
    }


# ---- layout ---------------------------------------------------------------------------------------------------


def test_layout_offsets_dtypes_and_roundtrip():
    sd = _state_dict()
    layout = FlatLayout.of(sd, torch.bfloat16)
    assert layout.names == list(sd)
    assert [s.dtype for s in layout.specs] == ["bfloat16", "bfloat16", "bfloat16", "int64"]
    assert all(s.offset % ALIGN == 0 for s in layout.specs)
    assert [s.nbytes for s in layout.specs] == [13 * 8 * 2, 64 * 2, 3 * 2, 16]
    for a, b in zip(layout.specs, layout.specs[1:], strict=False):  # no overlap
        assert a.offset + a.nbytes <= b.offset
    assert layout.nbytes % ALIGN == 0 and layout.nbytes >= layout.specs[-1].offset + layout.specs[-1].nbytes

    slot = torch.zeros(layout.nbytes, dtype=torch.uint8)
    layout.pack(slot, sd)
    out = layout.unpack(slot)
    for name, t in sd.items():
        expect = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert out[name].dtype == expect.dtype
        assert torch.equal(out[name], expect), name
    views = layout.views(slot)  # views alias the buffer: a later pack shows through without re-mapping
    layout.pack(slot, _state_dict(seed=1))
    assert torch.equal(views["model.norm.weight"], _state_dict(seed=1)["model.norm.weight"].to(torch.bfloat16))
    assert pickle.loads(pickle.dumps(layout)) == layout


def test_layout_rejects_other_models_and_bad_slots():
    sd = _state_dict()
    layout = FlatLayout.of(sd)
    slot = torch.zeros(layout.nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="missing"):
        layout.pack(slot, {k: v for k, v in sd.items() if k != "step"})
    with pytest.raises(ValueError, match="shape"):
        layout.pack(slot, {**sd, "model.norm.weight": torch.zeros(4)})
    with pytest.raises(ValueError, match="uint8"):
        layout.views(torch.zeros(layout.nbytes // 4, dtype=torch.float32))
    with pytest.raises(ValueError, match="empty"):
        FlatLayout.of({})


# ---- transport choice -----------------------------------------------------------------------------------------


def test_choose_transport():
    a, b = "cuda:GPU-aaaa@host1", "cuda:GPU-bbbb@host1"
    assert choose_transport(a, a) == "cuda_ipc"
    assert choose_transport(a, b) == "cuda_ipc"  # two GPUs of one host: peer to peer
    assert choose_transport(a, "cuda:GPU-aaaa@host2") == "torchstore"  # same UUID string, other host
    assert choose_transport("cpu@host1", "cpu@host1") == "torchstore"  # IPC is for GPUs
    assert choose_transport("cpu", "cpu") == "torchstore"  # plain devices resolve in this process
    assert choose_transport(torch.device("cpu"), a) == "torchstore"


def test_the_receiver_opens_a_handle_on_its_own_device():
    """The receiver replaces the sender's device index in rebuild_cuda_tensor's arguments by its own (the sender's
    index names another GPU, or none, in a process that sees only its GPU): the argument must be where it is put."""
    import inspect

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from meshrl.weight_sync.shared_buffer import _REBUILD_DEVICE_ARG

    assert list(inspect.signature(rebuild_cuda_tensor).parameters)[_REBUILD_DEVICE_ARG] == "storage_device"


# ---- versions and slots ---------------------------------------------------------------------------------------


def test_version_rules(tmp_path):
    vc = VersionControl(str(tmp_path / "ctl"), 2, create=True)
    assert vc.latest is None and vc.find(0) is None
    s0 = vc.slot_for_write(0)
    vc.mark_writing(s0)
    assert vc.find(0) is None  # a slot being written is never found
    vc.mark_written(s0, 0)
    assert vc.latest == 0 and vc.find(0) == s0
    s1 = vc.slot_for_write(1)
    assert s1 != s0  # never overwrite the latest version
    vc.mark_written(s1, 1)
    assert vc.slot_for_write(2) == s0  # the oldest goes
    for bad in (1, 0, -1, 1.5):
        with pytest.raises(ValueError):
            vc.slot_for_write(bad)
    other = VersionControl(str(tmp_path / "ctl"), 2, create=False)  # a second opener sees the same state
    assert other.latest == 1 and other.find(0) == s0
    single = VersionControl(str(tmp_path / "ctl1"), 1, create=True)
    single.mark_written(single.slot_for_write(3), 3)
    assert single.slot_for_write(4) == 0
    with pytest.raises(ValueError, match="not a meshrl"):
        (tmp_path / "junk").write_bytes(b"\0" * 64)
        VersionControl(str(tmp_path / "junk"), 2, create=False)


def test_publish_read_protocol_cpu_backing():
    sender = SharedBufferSender.for_state_dict(_state_dict(0), "cpu", dtype=torch.bfloat16)
    try:
        rx = SharedBufferReceiver(pickle.loads(pickle.dumps(sender.handle())))
        with pytest.raises(WeightVersionUnavailable, match="no weights"):
            with rx.read():
                pass
        for v in (1, 2):
            sender.publish(_state_dict(v), v)
        assert rx.latest == 2
        for v in (1, 2):  # double buffering: the previous version is still whole
            with rx.read(v) as (got, views):
                assert got == v
                assert torch.equal(
                    views["model.embed_tokens.weight"], _state_dict(v)["model.embed_tokens.weight"].bfloat16()
                )
        with rx.read(2) as (_, views):  # a reader holds v2's slot: the writer may use the other one ...
            sender.publish(_state_dict(3), 3)
            with pytest.raises(TimeoutError, match="reader"):  # ... but not overwrite the one being read
                sender.publish(_state_dict(4), 4, timeout_s=0.05)
            assert torch.equal(views["model.norm.weight"], _state_dict(2)["model.norm.weight"].bfloat16())
        with pytest.raises(WeightVersionUnavailable, match="overwritten"):
            with rx.read(1):  # v3 went into v1's slot
                pass
        assert sender.publish(_state_dict(4), 4).version == 4  # the failed publish left nothing half-done
        with rx.read() as (got, views):
            assert got == 4 and torch.equal(views["step"], _state_dict()["step"])
        with pytest.raises(ValueError, match="rise"):
            sender.publish(_state_dict(4), 4)
        rx.close()
    finally:
        sender.close()


def test_load_into_transformers_engine(base_model_dir):
    from meshrl.generation.transformers_engine import TransformersEngine
    from meshrl.models.qwen3 import load_hf_state_dict

    engine = TransformersEngine(base_model_dir, dtype="float32", max_model_len=32, max_num_seqs=2, device="cpu")
    base = load_hf_state_dict(base_model_dir)
    new = {k: v + 0.5 for k, v in base.items()}
    sender = SharedBufferSender.for_state_dict(new, "cpu", dtype=torch.float32)
    try:
        sender.publish(new, 5)
        rx = SharedBufferReceiver(sender.handle())
        assert rx.load_into(engine, 5) == 5
        params = engine.model.state_dict()
        for k, v in new.items():
            assert torch.equal(params[k], v), k
        rx.close()
    finally:
        sender.close()
        engine.shutdown()


_CHILD = textwrap.dedent(
    """
    import hashlib, pickle, sys, torch
    from meshrl.weight_sync.shared_buffer import SharedBufferReceiver
    rx = SharedBufferReceiver(pickle.loads(sys.stdin.buffer.read()))
    with rx.read() as (v, views):
        total = float(sum(t.double().sum() for t in views.values()))
        digest = hashlib.sha256(b"".join(views[s.name].cpu().view(-1).view(torch.uint8).numpy().tobytes()
                                         for s in rx.layout.specs)).hexdigest()
        print(v, total, views["model.norm.weight"].device, digest)
    """
)


def _child_reads(handle, env: dict | None = None) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], input=pickle.dumps(handle), capture_output=True, timeout=120, check=True,
        env=env,
    )  # fmt: skip
    return out.stdout.decode().split()


def _checksum(sd, dtype) -> float:
    return float(sum((t.to(dtype) if t.is_floating_point() else t).double().sum() for t in sd.values()))


def test_another_process_reads_the_published_version_cpu_backing():
    sd = _state_dict(3)
    sender = SharedBufferSender.for_state_dict(sd, "cpu", dtype=torch.bfloat16)
    try:
        sender.publish(sd, 9)
        version, total, device, _ = _child_reads(sender.handle())
        assert int(version) == 9 and device == "cpu"
        assert float(total) == pytest.approx(_checksum(sd, torch.bfloat16), rel=1e-12)
    finally:
        sender.close()


@needs_cuda
def test_another_process_reads_through_cuda_ipc_gpu():
    sd = {k: v.cuda() for k, v in _state_dict(4).items()}
    sender = SharedBufferSender.for_state_dict(sd, "cuda", dtype=torch.bfloat16)
    try:
        sender.publish(sd, 1)
        sd2 = {k: v + 1 if v.is_floating_point() else v for k, v in sd.items()}
        sender.publish(sd2, 2)
        version, total, device, _ = _child_reads(sender.handle())
        assert int(version) == 2 and device.startswith("cuda")
        assert float(total) == pytest.approx(_checksum(sd2, torch.bfloat16), rel=1e-12)
        assert choose_transport("cuda", "cuda") == "cuda_ipc"
    finally:
        sender.close()


@needs_cuda
def test_the_buffer_is_shared_while_the_trainer_allocates_in_expandable_segments():
    """The trainer's allocator uses expandable segments on GPUs (TrainerConfig.expandable_segments); the buffer is
    still a plain allocation of its own pool, which a generator opens by its CUDA IPC handle and reads exactly."""
    from meshrl.devices import use_expandable_segments

    before = os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    try:
        assert use_expandable_segments()
        cached = [torch.empty(n, device="cuda") for n in (1 << 20, 3 << 20)]  # blocks of the expandable pool
        del cached[0]  # a free block the buffer must not be carved from
        sd = {k: v.cuda() for k, v in _state_dict(4).items()}
        sender = SharedBufferSender.for_state_dict(sd, "cuda", dtype=torch.bfloat16)
        try:
            assert sender._pool is not None
            sender.publish(sd, 5)
            version, total, _, _ = _child_reads(sender.handle())
            assert int(version) == 5
            assert float(total) == pytest.approx(_checksum(sd, torch.bfloat16), rel=1e-12)
        finally:
            sender.close()
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if before is not None:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = before


@needs_two_gpus
def test_a_process_that_sees_only_another_gpu_reads_the_buffer_bitwise():
    """The split layout (trainer on GPU 0, generator on GPU 1, each seeing only its own): the generator opens the
    buffer on the trainer's GPU peer to peer and reads exactly what was published."""
    sd = {k: v.cuda(0) for k, v in _state_dict(4).items()}
    sender = SharedBufferSender.for_state_dict(sd, "cuda:0", dtype=torch.bfloat16)
    try:
        sender.publish(sd, 3)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": _physical_gpu(1)}
        version, _, device, digest = _child_reads(sender.handle(), env=env)
        assert int(version) == 3 and device == "cuda:0"  # its own GPU's index: the only one it sees
        published = b"".join(
            sd[spec.name].to(getattr(torch, spec.dtype)).cpu().view(-1).view(torch.uint8).numpy().tobytes()
            for spec in sender.layout.specs
        )
        assert digest == hashlib.sha256(published).hexdigest()  # bitwise what the trainer published
        ids = [device_identity("cuda:0"), device_identity("cuda:1")]
        assert ids[0] != ids[1] and choose_transport(*ids) == "cuda_ipc"
    finally:
        sender.close()


def _physical_gpu(index: int) -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index].strip() if visible else str(index)


def test_stale_files_of_dead_processes_are_removed_and_live_ones_kept(tmp_path):
    """A SIGKILLed trainer or controller leaves its shared-buffer files behind; the next Controller sweeps those
    of processes that are gone, and never touches a live process's files."""
    import os
    import subprocess
    import sys

    from meshrl.weight_sync.shared_buffer import remove_stale_files

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = [tmp_path / f"meshrl-wsync-{dead_pid}-abc.ctl", tmp_path / f"meshrl-wsync-{dead_pid}-abc.buf"]
    live = tmp_path / f"meshrl-wsync-{os.getpid()}-def.ctl"
    other = tmp_path / "something-else"
    for p in [*stale, live, other]:
        p.write_bytes(b"x")
    assert sorted(remove_stale_files(str(tmp_path))) == sorted(str(p) for p in stale)
    assert live.exists() and other.exists() and not any(p.exists() for p in stale)


# ---- faults: a full /dev/shm, files removed under a live run, stale files (issue 31, items 11, 12 and 13) -----------


def _big_state_dict() -> dict[str, torch.Tensor]:
    return {"model.embed_tokens.weight": torch.zeros(768, 1024), "model.norm.weight": torch.ones(1024)}  # ~3 MiB


def _files_of(pid: int, directory: str) -> set[str]:
    import glob
    import os

    return set(glob.glob(os.path.join(directory, f"meshrl-wsync-{pid}-*")))


def test_a_full_shm_is_said_before_anything_is_written(monkeypatch):
    """A /dev/shm with 1 MB free and a buffer of ~6 MiB: the sender refuses before it creates a file, with the free
    space, the need and what to do — instead of the SIGBUS of the first publish. Stand-in: the free-space reader is
    patched to say 1 MB (making /dev/shm small needs a mount namespace: the real 1 MiB tmpfs is
    test_a_one_megabyte_shm_is_a_message_not_a_sigbus)."""
    import errno
    import os
    import re

    from meshrl.weight_sync import shared_buffer
    from meshrl.weight_sync.shared_buffer import ShmSpaceError, shm_dir

    monkeypatch.setattr(shared_buffer, "shm_free_bytes", lambda directory=None: 1_000_000)
    before = _files_of(os.getpid(), shm_dir())
    with pytest.raises(ShmSpaceError) as caught:
        SharedBufferSender.for_state_dict(_big_state_dict(), "cpu", dtype=torch.float32)
    message = str(caught.value)
    assert re.fullmatch(
        rf"{re.escape(shm_dir())} has 976\.6 KiB free, the weights need 6\.0 MiB \(2 slot\(s\) of 3\.0 MiB, and "
        r"1\.0 MiB kept free\); enlarge it \(--shm-size for containers\) or use --generator\.weight-sync torchstore",
        message,
    ), message
    assert caught.value.errno == errno.ENOSPC  # an OSError of a full device, for whoever tells those apart
    assert _files_of(os.getpid(), shm_dir()) == before  # nothing made, nothing left behind


def test_the_launch_check_refuses_shm_and_auto_falls_back_to_torchstore(monkeypatch):
    """The same check on the controller, at launch, from the parameter count: an explicit 'shm' or 'cuda_ipc' that
    does not fit is a ConfigError with the message; 'auto' falls back to torchstore and prints a note. Stand-in:
    the free-space reader is patched to say 1 MB, then 1 GB."""
    from meshrl.errors import ConfigError
    from meshrl.weight_sync import shared_buffer
    from meshrl.weight_sync.transport import resolve_transport, weight_nbytes

    cpu, gpu = "cpu@host1", "cuda:GPU-aaaa@host1"
    weights = weight_nbytes(297_600, "float32")
    notes: list[str] = []
    monkeypatch.setattr(shared_buffer, "shm_free_bytes", lambda directory=None: 1_000_000)
    with pytest.raises(ConfigError, match=r"'shm': .* has 976\.6 KiB free, the weights need 2\.3 MiB .*enlarge it "
                       r"\(--shm-size for containers\) or use --generator\.weight-sync torchstore"):  # fmt: skip
        resolve_transport("shm", cpu, [cpu], weight_bytes=weights)
    with pytest.raises(ConfigError, match=r"'cuda_ipc': .* the CUDA IPC transport's control files need 4\.0 KiB"):
        resolve_transport("cuda_ipc", gpu, [gpu])
    assert resolve_transport("auto", gpu, [gpu], weight_bytes=weights, note=notes.append) == "torchstore"
    assert len(notes) == 1 and "976.6 KiB free" in notes[0] and "'auto' uses torchstore instead of cuda_ipc" in notes[0]
    assert resolve_transport("torchstore", cpu, [cpu], weight_bytes=weights) == "torchstore"  # needs no /dev/shm

    monkeypatch.setattr(shared_buffer, "shm_free_bytes", lambda directory=None: 1 << 30)
    assert resolve_transport("shm", cpu, [cpu], weight_bytes=weights) == "shm"
    assert resolve_transport("auto", gpu, [gpu], weight_bytes=weights, note=notes.append) == "cuda_ipc"
    assert len(notes) == 1
    assert weight_nbytes(10, "bfloat16") == 20


def test_a_new_receiver_attaches_after_another_closed_and_loads_the_current_version():
    """A replacement generator: the first subscriber closes (or its process dies), the trainer goes on publishing,
    and a new subscriber attached to the same handle loads the current version. Closing a subscriber never touches
    the files."""
    import os

    sender = SharedBufferSender.for_state_dict(_state_dict(0), "cpu", dtype=torch.float32)
    try:
        sender.publish(_state_dict(1), 1)
        first = SharedBufferReceiver(sender.handle())
        with first.read(1) as (v, _):
            assert v == 1
        first.close()
        assert all(os.path.exists(h[0]) for h in sender.handle().held)
        sender.publish(_state_dict(2), 2)
        second = SharedBufferReceiver(pickle.loads(pickle.dumps(sender.handle())))
        with second.read() as (v, views):
            assert v == 2 and torch.equal(views["model.norm.weight"], _state_dict(2)["model.norm.weight"])
        second.close()
    finally:
        sender.close()
    assert not any(os.path.exists(h[0]) for h in sender.handle().held)  # the owner's close removes them


def test_a_replacement_finds_the_buffer_while_its_owner_holds_it_after_its_names_were_removed():
    """The issue's `FileNotFoundError: ... /dev/shm/meshrl-wsync-...ctl` of a replacement generator: the buffer's
    names were removed while the trainer lived (here as any outside sweeper would: remove_shared_files). A new
    receiver still attaches, through the owner's descriptors (/proc/<owner pid>/fd/<fd>, checked by inode), reads
    the current version and sees the next; once the owner has let go, it is an error that names the owner."""
    import os

    from meshrl.weight_sync.pubsub import SharedBufferPublisher
    from meshrl.weight_sync.shared_buffer import remove_shared_files

    sender = SharedBufferSender.for_state_dict(_state_dict(0), "cpu", dtype=torch.float32)
    handle = sender.handle()
    try:
        sender.publish(_state_dict(3), 3)
        remove_shared_files(handle)
        assert not any(os.path.exists(h[0]) for h in handle.held)
        rx = SharedBufferReceiver(pickle.loads(pickle.dumps(handle)))
        assert rx.control.path == handle.control_path
        with rx.read() as (v, views):
            assert v == 3 and torch.equal(views["model.norm.weight"], _state_dict(3)["model.norm.weight"])
        sender.publish(_state_dict(4), 4)  # the owner and the late receiver share the same control block and locks
        with rx.read(4) as (v, views):
            assert torch.equal(views["model.norm.weight"], _state_dict(4)["model.norm.weight"])
        rx.close()

        # A publisher replaced on the trainer (set_weight_sync again) no longer removes the live buffer's files.
        class _Policy:
            def publish_weights_ipc(self, version, dtype):
                sender.publish(_state_dict(version), version)
                return handle

        import asyncio

        publisher = SharedBufferPublisher("shm")
        asyncio.run(publisher.publish(_Policy(), 5, torch.float32))
        publisher.close()
        SharedBufferReceiver(handle).close()  # still attachable (through the owner: the names were removed above)
    finally:
        sender.close()
    with pytest.raises(FileNotFoundError, match=rf"owner \(trainer rank 0, pid {os.getpid()}\) no longer holds it"):
        SharedBufferReceiver(handle)


def test_stale_files_are_those_of_runs_whose_processes_are_all_gone(tmp_path, monkeypatch):
    """remove_stale_files at the next start: files are kept while their owner pid lives OR while any process holds
    the run's control block (the trainer for its lifetime, each attached generator): a live run whose pids this
    process cannot see (another pid namespace sharing /dev/shm) keeps its files. Stand-ins: the directory is a
    temporary one, a dead pid is that of a finished `true`, and a run in another pid namespace is this process's
    own sender with the pid check patched to see nothing."""
    import fcntl
    import os

    from meshrl.weight_sync import shared_buffer
    from meshrl.weight_sync.shared_buffer import remove_stale_files

    finished = subprocess.Popen(["true"])
    finished.wait()
    dead = finished.pid
    monkeypatch.setattr(shared_buffer, "shm_dir", lambda: str(tmp_path))
    sender = SharedBufferSender.for_state_dict(_state_dict(0), "cpu", dtype=torch.float32)
    live = {h[0] for h in sender.handle().held}
    gone = {str(tmp_path / f"meshrl-wsync-{dead}-abc{suffix}") for suffix in (".ctl", ".ctl.slot0.lock", ".buf")}
    gone.add(str(tmp_path / f"meshrl-wsync-{dead}-ts-0123"))  # a torchstore chunk of a dead volume
    attached = {str(tmp_path / f"meshrl-wsync-{dead}-def{suffix}") for suffix in (".ctl", ".ctl.slot0.lock")}
    other = tmp_path / "something-else"
    for p in [*gone, *attached, other]:
        open(p, "wb").close()
    generator = os.open(str(tmp_path / f"meshrl-wsync-{dead}-def.ctl"), os.O_RDONLY)
    fcntl.flock(generator, fcntl.LOCK_SH)  # a generator of a run whose trainer died is still attached
    try:
        assert sorted(remove_stale_files(str(tmp_path))) == sorted(gone)
        monkeypatch.setattr(shared_buffer, "_alive", lambda pid: False)  # the sweeper cannot see the owner's pid
        assert remove_stale_files(str(tmp_path)) == []
        assert all(os.path.exists(p) for p in [*live, *attached, other])
        rx = SharedBufferReceiver(sender.handle())  # untouched: it attaches by name
        rx.close()
    finally:
        os.close(generator)
        sender.close()
    assert sorted(remove_stale_files(str(tmp_path))) == sorted(attached)  # the last process of that run let go
    assert os.listdir(tmp_path) == ["something-else"]


_ONE_MIB_SHM = textwrap.dedent(
    """
    import os, sys, torch
    from meshrl.weight_sync import shared_buffer
    from meshrl.weight_sync.shared_buffer import SharedBufferSender, ShmSpaceError
    sd = {"w": torch.ones(768, 1024)}  # 3 MiB in float32, two slots
    if sys.argv[1] == "bare":  # what the buffer did before: map a file /dev/shm cannot fill, then write
        t = torch.from_file("/dev/shm/meshrl-wsync-bare.buf", shared=True, size=3 << 20, dtype=torch.uint8)
        t.fill_(1)
    if sys.argv[1] == "lying":  # the check passed, and the space went before the allocation
        shared_buffer.buffer_space_problem = lambda *args, **kwargs: None
    try:
        SharedBufferSender.for_state_dict(sd, "cpu", dtype=torch.float32)
    except ShmSpaceError as e:
        print(e)
    print(sorted(os.listdir("/dev/shm")))
    """
)


def _in_one_mib_shm(mode: str) -> subprocess.CompletedProcess:
    script = f'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {sys.executable} -c "$0" {mode}'
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, _ONE_MIB_SHM], capture_output=True, text=True, timeout=120
    )


def test_a_one_megabyte_shm_is_a_message_not_a_sigbus():
    """The probe's fault for real: a 1 MiB tmpfs on /dev/shm, in a private mount namespace (`unshare -rm`). Mapping
    a buffer it cannot fill and writing is a SIGBUS (what the run died of: `Killed(sig=7)`); the sender says
    '/dev/shm has 1.0 MiB free, the weights need 6.0 MiB ...' instead and leaves no file — also when the free
    space looked sufficient and went before the allocation (every page is allocated up front)."""
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs a private mount namespace (unshare -rm)")
    bare = _in_one_mib_shm("bare")
    assert bare.returncode == -7, (bare.returncode, bare.stderr[-2000:])  # SIGBUS
    for mode in ("checked", "lying"):
        out = _in_one_mib_shm(mode)
        assert out.returncode == 0, out.stderr[-2000:]
        message, files = out.stdout.strip().splitlines()
        free = "1.0 MiB" if mode == "checked" else "1020.0 KiB"  # the control block's page is taken by then
        assert message.startswith(f"/dev/shm has {free} free, the weights need 6.0 MiB"), message
        assert message.endswith("enlarge it (--shm-size for containers) or use --generator.weight-sync torchstore")
        assert files == "[]", files
