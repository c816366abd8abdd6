"""One trainer rank raises inside a call while the other waits for it in a collective (issue 33: on four GPUs one rank
ran out of memory in its forward and the other waited in backward's reduce-scatter; the run hung until NCCL's
timeout). The controller must end the call with that rank's error at once and stop the waiting rank, not wait for
an answer that cannot come. Real 2-rank trainer mesh (gloo), a user's loss that fails on rank 1 only."""

from __future__ import annotations

import time

import pytest
from conftest import random_data

from meshrl.controller.replicas import process_state


def test_one_rank_failing_inside_a_collective_call_ends_the_call_and_stops_the_ranks(base_model_dir, tokenizer):
    from meshrl.config import ModelConfig, TrainerConfig
    from meshrl.controller.api import Controller
    from meshrl.controller.futures import CollectiveRankError
    from meshrl.types import LossSpec

    ctl = Controller(
        model_dir=base_model_dir, model_cfg=ModelConfig(), trainer_cfg=TrainerConfig(num_procs=2, micro_batch_size=8),
        generator_cfg=None, tokenizer=tokenizer, call_timeout_s=300,
    )  # fmt: skip
    try:
        pids = list(ctl.trainer.pids)
        assert len(pids) == 2
        ok = ctl.forward_backward(random_data(8), LossSpec(name="grpo", num_loss_tokens=20)).result()
        assert ok.num_tokens > 0  # the mesh works before the faulty loss

        t0 = time.monotonic()
        with pytest.raises(CollectiveRankError) as failed:
            ctl.forward_backward(random_data(8), LossSpec(name="custom_algorithms:fails_on_rank_1")).result()
        took = time.monotonic() - t0
        message = str(failed.value)
        assert (
            message.startswith("ValueError: this loss fails on trainer rank 1")
            or "fails on trainer rank 1" in (message.splitlines()[0])
        ), message
        assert "waited for it in a collective" in message and "was stopped" in message, message
        # the rank's error, its grace for the other rank, and the stop: well within the collective timeout (600 s)
        assert took < 90, took
        deadline = time.monotonic() + 30
        while any(process_state(p) not in (None, "Z") for p in pids) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert all(process_state(p) in (None, "Z") for p in pids), [process_state(p) for p in pids]
        assert "trainer rank failed inside a collective call" in ctl.failures
    finally:
        t0 = time.monotonic()
        ctl.shutdown()
        assert time.monotonic() - t0 < 60
