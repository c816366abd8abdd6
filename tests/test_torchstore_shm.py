"""torchstore's tensors through /dev/shm between processes of one host (meshrl.weight_sync.torchstore_shm): the
buffer's two directions in one process, and files that never outlive their keys. The whole path between real
processes (trainer, storage volume, generator) runs in test_weight_sync.py and every torchstore sync of the suite.
A second host cannot be made here: the "other host" below is a buffer whose identity is set to a foreign value, a
named fake of the one thing that differs."""

from __future__ import annotations

import asyncio
import glob
import os

import pytest
import torch

from meshrl.weight_sync.shared_buffer import shm_dir
from meshrl.weight_sync.torchstore_shm import ShmTransportBuffer, ShmUnreachable


def _files() -> set[str]:
    return set(glob.glob(os.path.join(shm_dir(), f"meshrl-wsync-{os.getpid()}-ts-*")))


def _sent(buffer: ShmTransportBuffer) -> ShmTransportBuffer:
    """What the other process unpickles."""
    import pickle

    return pickle.loads(pickle.dumps(buffer))


def test_put_and_get_through_one_file():
    before = _files()
    data = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    put = ShmTransportBuffer()
    asyncio.run(put.write_from(data))
    assert put.path is not None and put.tensor is None  # the message carries a name, not the bytes
    received = _sent(put)
    received.client_pid = -1  # unpickled "in the volume": the same buffer, seen from the receiving side
    stored = asyncio.run(received.read_into(None))
    assert torch.equal(stored, data)
    asyncio.run(put.drop())  # adopted (renamed): the client's drop leaves it alone
    (own,) = _files() - before
    assert stored._meshrl_shm_path == own

    get = ShmTransportBuffer()
    answer = _sent(get)
    asyncio.run(answer.write_from(stored))  # the volume answers with the stored tensor's own file
    assert answer.path == own and answer.tensor is None
    get.update(_sent(answer))
    assert torch.equal(asyncio.run(get.read_into(None)), data)
    del stored, received  # the volume drops the key: the file goes
    import gc

    gc.collect()
    assert _files() == before


def test_a_volume_elsewhere_refuses_the_file_and_answers_inside_the_message():
    before = _files()
    put = ShmTransportBuffer()
    asyncio.run(put.write_from(torch.ones(3)))
    received = _sent(put)
    received.identity = "another-host"  # fake: the volume sees another /dev/shm than the client's
    with pytest.raises(ShmUnreachable):
        asyncio.run(received.read_into(None))
    asyncio.run(put.drop())  # not adopted: the client removes its file
    assert _files() == before

    get = ShmTransportBuffer()
    get.identity = "another-host"
    answer = _sent(get)
    answer.client_pid = -1
    asyncio.run(answer.write_from(torch.full((2,), 7.0)))
    assert answer.path is None and torch.equal(answer.tensor, torch.full((2,), 7.0))
    get.update(_sent(answer))
    assert torch.equal(asyncio.run(get.read_into(None)), torch.full((2,), 7.0))
    assert _files() == before
