"""Issue 31's fault items that belong to the watching and stopping machinery: a paused controller is not a frozen
generator (11), a reward function that kills its process on one sample costs that sample, not the run (15), a
trainer death names its rank and pid (17), a full disk is an error naming its directory, not a death (17), and
SIGTERM saves the step being taken before the run stops (17)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from types import SimpleNamespace

import pytest

from meshrl.controller.replicas import WatcherClock, heartbeat_answers


# ---- 11: a pause of the watcher is not a freeze of the watched ----------------------------------------------------
class _Silent:
    """A heartbeat future that never answers: each get waits its timeout, then raises TimeoutError."""

    def get(self, timeout=None):
        time.sleep(timeout or 0)
        raise TimeoutError


class _Answers:
    def get(self, timeout=None):
        return {"pid": 1}


def test_a_stall_of_the_watcher_extends_the_heartbeat_wait_and_asks_again():
    t = [100.0]
    clock = WatcherClock(tick_s=0.25, start=False, now=lambda: t[0])
    asked = []

    def ask():
        asked.append(t[0])
        if len(asked) == 1:  # sent just before the controller was stopped for 25 s: its timer fires on waking
            return SimpleNamespace(get=lambda timeout=None: (t.__setitem__(0, t[0] + 25.0), _raise(TimeoutError))[1])
        return _Answers()  # asked again after waking: the healthy process answers

    assert heartbeat_answers(ask, 20.0, clock) == {"pid": 1}
    assert len(asked) == 2
    assert clock.stalled_since(100.0) >= 24.0  # the stall still under way (no tick yet since waking) counts

    # The same silence without a stall of the watcher is a freeze, judged on time.
    clock = WatcherClock(tick_s=0.25, start=False)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        heartbeat_answers(_Silent, 0.3, clock)
    assert time.monotonic() - t0 < 2.0


def _raise(exc):
    raise exc


def test_a_real_sigstop_of_the_watching_process_is_not_a_freeze():
    """This process (the watcher) is stopped for 3 s by a helper while it waits for a heartbeat with heartbeat_s=1;
    the first beat's wait times out on waking, as Monarch's timer does; the beat asked again answers."""
    clock = WatcherClock(tick_s=0.1)
    asked = []

    def ask():
        asked.append(time.monotonic())
        return _Silent() if len(asked) == 1 else _Answers()

    pauser = subprocess.Popen(["sh", "-c", f"sleep 0.3; kill -STOP {os.getpid()}; sleep 3; kill -CONT {os.getpid()}"])
    try:
        assert heartbeat_answers(ask, 1.0, clock) == {"pid": 1}
    finally:
        pauser.wait(timeout=30)
    assert len(asked) == 2 and asked[1] - asked[0] >= 2.5, asked


# ---- 15: a reward that kills its process on one sample ----------------------------------------------------------
def _score_a_poisoned_sample(name: str, *, heartbeat_s: float):
    """Reward processes scoring two groups of two with reward function `name` (its poison on the third completion)
    and user_rewards:contains_answer (0.5); returns the scored samples and the restart budget (3)."""
    from meshrl.config import PlacementConfig
    from meshrl.controller.process import prepare_process
    from meshrl.controller.provision import Provisioner
    from meshrl.controller.replicas import RestartBudget
    from meshrl.controller.reward_pool import RewardPool
    from meshrl.rewards import Rubric, ScoringConfig

    prepare_process()  # as a program (or a Controller) does: Monarch's fault hook records, never exits, for good
    rubric = Rubric({name: 1.0, "user_rewards:contains_answer": 0.5}, ScoringConfig())
    budget = RestartBudget(3)
    pool = RewardPool(Provisioner(PlacementConfig()), rubric, budget=budget, timeout_s=120, heartbeat_s=heartbeat_s)
    try:
        pool.start()
        rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "poisoned row", "answer": "7"}]
        completions = ["2", "3", "7 POISON", "7"]  # two groups of two; the third completion is the poisoned one
        scored = pool.score(completions, rows, group_size=2).result()
    finally:
        for f in pool.stop():
            try:
                f.get(timeout=30)
            except Exception:  # noqa: BLE001 - best effort
                pass
    return scored, budget


def test_a_reward_that_segfaults_on_one_sample_scores_it_zero_and_names_it(capfd):
    name = "user_rewards:segfaults_on_poison"
    scored, budget = _score_a_poisoned_sample(name, heartbeat_s=10)
    assert [s.parts[name] for s in scored] == [1.0, 0.0, 0.0, 1.0]
    assert [s.reward for s in scored] == [1.5, 0.0, 0.5, 1.5]  # the other function still scored the poisoned one
    assert list(scored[2].failures) == [name] and scored[2].failures[name].startswith("crashed:")
    assert not any(s.failures for i, s in enumerate(scored) if i != 2)
    assert budget.used == 0  # the losses were the sample's fault, not the process's
    err = capfd.readouterr().err
    assert f"reward function '{name}' kills its reward process" in err, err[-3000:]
    assert "sample 2 of the request: row (answer '7', prompt 'poisoned row')" in err, err[-3000:]


def test_a_reward_that_hangs_holding_the_interpreter_on_one_sample_scores_it_zero_and_names_it(capfd):
    """The segfault's sibling: on one sample the function spins in C code that keeps the interpreter (a regex that
    backtracks for hours), so even the process's heartbeat cannot answer. That process is found frozen and replaced,
    the replacement freezes on the same request, the request is scored one function, group and sample at a time,
    and the sample that freezes its process scores 0 as that function's failure, named with its row."""
    name = "user_faults:holds_the_interpreter_on_poison"
    t0 = time.perf_counter()
    scored, budget = _score_a_poisoned_sample(name, heartbeat_s=3)
    took = time.perf_counter() - t0
    assert [s.parts[name] for s in scored] == [1.0, 0.0, 0.0, 1.0]
    assert [s.reward for s in scored] == [1.5, 0.0, 0.5, 1.5]
    assert list(scored[2].failures) == [name] and scored[2].failures[name].startswith("crashed:")
    assert "stopped answering" in scored[2].failures[name], scored[2].failures[name]
    assert not any(s.failures for i, s in enumerate(scored) if i != 2)
    assert budget.used == 0
    err = capfd.readouterr().err
    assert f"reward function '{name}' kills its reward process" in err, err[-3000:]
    assert "sample 2 of the request: row (answer '7', prompt 'poisoned row')" in err, err[-3000:]
    print(f"took {took:.1f}s")


# ---- 17: a trainer death names its rank and pid ------------------------------------------------------------------
def test_a_trainer_death_names_its_rank_and_pid():
    from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

    from meshrl.controller.futures import ActorDiedError, Pending
    from meshrl.controller.trainer_client import TrainerClient

    gone = subprocess.Popen(["true"])
    gone.wait()
    trainer = object.__new__(TrainerClient)
    trainer.pids, trainer.elsewhere = [os.getpid(), gone.pid], False
    assert trainer.dead_ranks() == f"trainer rank 1 of 2 (pid {gone.pid})"

    died = SimpleNamespace(get=lambda timeout=None: _raise(SupervisionError("supervision\nActor trainer crashed")))
    dead = rf"forward_backward failed because trainer rank 1 of 2 \(pid {gone.pid}\)"
    with pytest.raises(ActorDiedError, match=dead):
        Pending([died], list, 10, "forward_backward", trainer.dead_ranks).result()
    # A survivor's error (its collective lost the peer) is told as the death it is.
    peer = SimpleNamespace(get=lambda timeout=None: _raise(RuntimeError("gloo: Connection reset by peer")))
    with pytest.raises(ActorDiedError, match=r"trainer rank 1 of 2 .* died \(a surviving process said: RuntimeError"):
        Pending([peer], list, 10, "optim_step", trainer.dead_ranks).result()


# ---- 17: a full disk; SIGTERM saves the step ---------------------------------------------------------------------
class _FakeCtl:
    """What RunCheckpoints asks of a Controller: save_checkpoint (writing a file there) and policy_version."""

    def __init__(self, fail: BaseException | None = None):
        self.policy_version, self.fail, self.trainer = 0, fail, None

    def save_checkpoint(self, path: str) -> None:
        if self.fail is not None:
            raise self.fail
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "state.bin"), "wb") as f:
            f.write(b"x")


def _checkpoints(tmp_path):
    from meshrl.config import GRPORunConfig
    from meshrl.controller.run_checkpoints import RunCheckpoints
    from meshrl.run_dir import RunDir

    cfg = GRPORunConfig()
    cfg.run.output_dir, cfg.run.name, cfg.run.save_every = str(tmp_path), "r", 0
    return RunCheckpoints("grpo", RunDir(cfg.run.output_dir, cfg.run.name, cfg), cfg)


def test_a_full_disk_is_an_error_naming_the_directory_and_its_free_space(tmp_path):
    from monarch._src.actor.actor_mesh import ActorError

    from meshrl.controller.run_checkpoints import RunFailedError

    ckpts = _checkpoints(tmp_path)
    where = str(tmp_path / "r" / "checkpoints" / "step_00000001.tmp" / "trainer" / "__0_0.distcp")
    full = ActorError(OSError(errno.ENOSPC, "No space left on device", where), "Actor call trainer.save failed.")
    with pytest.raises(RunFailedError) as failed, ckpts.resume_hint_on_failure():
        ckpts.save(_FakeCtl(fail=full), 1, {})
    message = str(failed.value)
    assert message.startswith("run failed (the disk is full)"), message
    assert "an actor process died" not in message
    assert f"no space left on the device of {where}: " in message and " free of " in message, message


def test_sigterm_during_a_step_saves_that_step_then_stops_with_the_resume_command(tmp_path, capsys):
    from meshrl.controller.cli import STEP_BOUNDARY, stop_on_sigterm

    ckpts, ctl = _checkpoints(tmp_path), _FakeCtl()
    before = signal.getsignal(signal.SIGTERM)
    stop_on_sigterm()
    try:
        with pytest.raises(KeyboardInterrupt), ckpts.resume_hint_on_failure():
            for step in range(5):
                ctl.policy_version = step + 1  # the step, taken whole
                if step == 1:
                    os.kill(os.getpid(), signal.SIGTERM)  # mid-step: the step goes on
                    time.sleep(0.05)
                ckpts.after_step(ctl, step + 1, 5, lambda: {"cursor": 7})
    finally:
        signal.signal(signal.SIGTERM, before)
    assert not STEP_BOUNDARY.deferring and STEP_BOUNDARY.requested is None
    assert [p.name for p in ckpts.manager.complete()] == ["step_00000002"]
    err = capsys.readouterr().err
    assert "stopped after step 2 on SIGTERM" in err, err
    assert "interrupted; last good checkpoint: " in err and "step_00000002" in err, err
    assert "--run.resume latest" in err, err

    # Before the first step ends (no boundary to wait for yet), SIGTERM stops at once, as Ctrl-C does.
    stop_on_sigterm()
    try:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    finally:
        signal.signal(signal.SIGTERM, before)


_PAUSED_CONTROLLER = """
import sys, time
from meshrl.config import PlacementConfig
from meshrl.controller.process import prepare_process
from meshrl.controller.provision import Provisioner
from meshrl.controller.replicas import RestartBudget
from meshrl.controller.reward_pool import RewardPool
from meshrl.rewards import Rubric, ScoringConfig


def slow(completion, row):
    time.sleep(2.5)
    return 1.0


if __name__ == "__main__":
    prepare_process()
    rubric = Rubric({"slow": 1.0}, ScoringConfig(num_threads=1), fns={"slow": slow})
    pool = RewardPool(Provisioner(PlacementConfig()), rubric, budget=RestartBudget(0), timeout_s=120, heartbeat_s=3)
    pool.start()
    print("READY", pool.pids[0], flush=True)
    scored = pool.score(["a"] * 4, [{"prompt": "p", "answer": "a"}], group_size=4).result()
    print("DONE", [s.reward for s in scored], "restarts", pool.budget.used, flush=True)
    for f in pool.stop():
        try:
            f.get(timeout=10)
        except Exception:
            pass
"""


def test_a_stopped_controller_does_not_declare_a_healthy_process_frozen(tmp_path):
    """A real controller (one reward process, heartbeat_s=3, no replacement allowed) waiting on a 10 s request: the
    reward process is stopped so that a heartbeat goes unanswered, the controller is stopped for 8 s while it waits
    for it, the reward process is continued (it answers while the controller is stopped), then the controller.
    Before the fix the controller woke past its 3 s and declared the healthy process frozen (the run ended here,
    its budget being 0); now it counts its own stall and asks again."""
    import sys

    script = tmp_path / "paused_controller.py"
    script.write_text(_PAUSED_CONTROLLER)
    proc = subprocess.Popen(
        [sys.executable, "-u", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), line + proc.stderr.read()[-3000:]
        reward = int(line.split()[1])
        time.sleep(1.0)  # the request is under way
        os.kill(reward, signal.SIGSTOP)  # its heartbeat goes unanswered: the controller waits on it within 1 s
        time.sleep(1.5)
        os.kill(proc.pid, signal.SIGSTOP)  # the controller stops while it waits for that heartbeat
        time.sleep(0.5)
        os.kill(reward, signal.SIGCONT)  # the reward process answers, to a controller that is stopped
        time.sleep(8.0)
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "DONE [1.0, 1.0, 1.0, 1.0] restarts 0" in out, (out + err)[-3000:]
    assert "this controller did not run for " in err, err[-3000:]
