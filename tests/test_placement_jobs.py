"""Placement through Monarch's job API (`--placement process | slurm | k8s`, controller/provision.py).

'process' runs for real: Monarch's ProcessJob starts each host as a subprocess running Monarch's worker loop (its own
stand-in for several hosts), and the GRPO program runs its trainer over two such hosts and its generator and reward
process on a third. No Slurm and no Kubernetes exist on this machine: their jobs are built from the flags and
checked without a scheduler (the sbatch script a fake `sbatch` receives, the meshes a KubernetesJob holds), and the
errors for a missing `sbatch` or kubernetes client are checked to be clear ones."""

import json
import os
import re
import subprocess
import sys

import pytest
from procs import ENV, TWO_HOST_FLAGS, gone, parent

from meshrl.config import ConfigError, PlacementConfig


def _host_of(pid: int) -> tuple[int, str, int]:
    """The ProcessJob host (a worker-loop subprocess) that `pid` runs under: its pid, Monarch's name for it, and
    its parent."""
    while pid > 1:
        pid = parent(pid)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"run_worker_loop_forever" in f.read():
                with open(f"/proc/{pid}/environ", "rb") as env:
                    names = [v for v in env.read().split(b"\0") if v.startswith(b"HYPERACTOR_PROCESS_NAME=")]
                return pid, names[0].split(b"=", 1)[1].decode(), parent(pid)
    raise AssertionError("not under a ProcessJob host")


def test_grpo_on_a_monarch_process_job_puts_each_role_on_its_own_hosts_with_parity(tmp_path):
    """The GRPO program, same flags, plus `--placement process --placement.trainer-nodes 2`: one trainer rank on each
    of the 'trainer' mesh's two hosts, generator and reward process on the 'rollout' mesh's host, each host a
    subprocess of the controller; logprobs agree after every sync, and the hosts end with the run."""
    placement = ["--placement", "process", "--placement.trainer-nodes", "2"]
    cmd = [
        sys.executable,
        "-m",
        "meshrl.controller.grpo",
        *TWO_HOST_FLAGS,
        *placement,
        "--run.output-dir",
        str(tmp_path),
    ]
    proc = subprocess.Popen(
        [*cmd, "--run.name", "p"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )
    hosts, seen = {}, []
    try:
        for line in proc.stdout:  # while the run lives
            seen.append(line)
            if m := re.search(r"(trainer|generator|reward) processes \(pids\): \[([\d, ]+)\]", line):
                hosts[m.group(1)] = [_host_of(int(p)) for p in m.group(2).split(",")]
            if "placement:" in line:
                break
        rest, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, "".join(seen)[-2000:] + rest[-2000:] + err[-3000:]
    assert sorted(name for _, name, _ in hosts["trainer"]) == ["trainer_0", "trainer_1"], hosts
    assert [name for _, name, _ in hosts["generator"] + hosts["reward"]] == ["rollout_0", "rollout_0"], hosts
    host_pids = {pid for role in hosts.values() for pid, _, _ in role}
    assert len(host_pids) == 3 and {parent for role in hosts.values() for _, _, parent in role} == {proc.pid}
    assert "a Monarch ProcessJob: trainers on the 'trainer' mesh (2 hosts)" in seen[-1], seen[-1]
    assert "weight sync: torchstore" in "".join(seen)
    rl = [json.loads(r) for r in (tmp_path / "p" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rl if r["phase"] == "rl"]
    assert len(rl) == 4 and all(r["logprob_diff_max"] < 1e-4 for r in rl), [r["logprob_diff_max"] for r in rl]
    assert all(gone(pid, 15) for pid in host_pids), "the job's hosts outlived the run"


_SLURM_CHILD = r"""
import json, sys
from meshrl.config import PlacementConfig
from meshrl.controller.provision import Provisioner

flags = dict(
    kind="slurm", trainer_nodes=2, rollout_nodes=1, slurm_partition="gpu", slurm_time="2:00:00",
    slurm_gpus_per_node=8, slurm_account="rl", slurm_qos="high", slurm_args="--constraint=h100 --mem=0",
    slurm_port=23456, slurm_python="/opt/venv/bin/python", start_timeout_s=600,
)
own = Provisioner(PlacementConfig(**flags))
own.job.apply()  # what job.state() does first: sbatch (here the fake one)
submitted = own.job._slurm_job_id
own.shutdown()  # the run's own allocation: cancelled
kept = Provisioner(PlacementConfig(**flags, job_cache=sys.argv[1]))
kept.job.apply()
kept.shutdown()  # --placement.job-cache: left running for the next run
print(json.dumps({"meshes": own.job._meshes, "submitted": submitted, "describe": own.describe(),
                  "timeout": own.job._job_start_timeout}))
"""


def _fake_slurm(tmp_path) -> dict:
    """A PATH whose sbatch saves the script it is given and 'submits' job 4242, and whose scancel logs its args."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "sbatch": f'cat > {tmp_path}/sbatch.script\necho "Submitted batch job 4242"\n',
        "scancel": f'echo "$@" >> {tmp_path}/scancel.args\n',
        "squeue": 'echo "{}"\n',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        (bin_dir / name).chmod(0o755)
    return {**ENV, "PATH": f"{bin_dir}{os.pathsep}{ENV['PATH']}"}


def test_slurm_job_gets_the_flags_into_its_sbatch_script_and_is_cancelled_unless_kept(tmp_path):
    # A child process: SlurmJob switches the process's Monarch transport to TCP, which this one must not see.
    child = subprocess.run(
        [sys.executable, "-c", _SLURM_CHILD, str(tmp_path / "job.pkl")],
        capture_output=True, text=True, timeout=120, env=_fake_slurm(tmp_path),
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["meshes"] == {"trainer": 2, "rollout": 1} and result["submitted"] == "4242"
    assert result["timeout"] == 600
    assert result["describe"].startswith("a Monarch SlurmJob: trainers on the 'trainer' mesh (2 hosts)")
    script = (tmp_path / "sbatch.script").read_text()
    for directive in (
        "--nodes=3", "--partition=gpu", "--time=2:00:00", "--gpus-per-node=8", "--account=rl", "--qos=high",
        "--constraint=h100", "--mem=0", "--job-name=meshrl_",
    ):  # fmt: skip
        assert f"#SBATCH {directive}" in script, (directive, script)
    assert re.search(r"srun /opt/venv/bin/python -c '.*run_worker_loop_forever.*:23456", script), script
    assert (tmp_path / "scancel.args").read_text().split() == ["4242"]  # once: the kept job was not cancelled


def test_slurm_without_sbatch_is_a_clear_config_error(tmp_path):
    from meshrl.controller.provision import Provisioner

    path = os.environ["PATH"]
    os.environ["PATH"] = str(tmp_path)  # no Slurm tools on it (there are none on this machine at all)
    try:
        with pytest.raises(ConfigError, match=r"--placement slurm needs Slurm's sbatch, squeue, scancel on PATH"):
            Provisioner(PlacementConfig(kind="slurm"))
    finally:
        os.environ["PATH"] = path


def test_slurm_without_sbatch_ends_the_program_with_the_message_not_a_traceback(tmp_path):
    cmd = [sys.executable, "-m", "meshrl.controller.grpo", *TWO_HOST_FLAGS, "--placement", "slurm"]
    env = {**ENV, "PATH": os.path.dirname(sys.executable)}  # python, and no Slurm
    proc = subprocess.run(
        [*cmd, "--run.output-dir", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "config error: --placement slurm needs Slurm's sbatch" in proc.stderr, proc.stderr[-3000:]
    assert "processes (pids)" not in proc.stdout


_K8S_CHILD = r"""
import json
from meshrl.config import PlacementConfig
from meshrl.controller.provision import Provisioner

attach = Provisioner(PlacementConfig(kind="k8s", k8s_namespace="rl", trainer_nodes=2, k8s_rollout_mesh="gen",
                                     start_timeout_s=300)).job
made = Provisioner(PlacementConfig(kind="k8s", k8s_image="ghcr.io/me/meshrl:1", k8s_gpus_per_pod=8,
                                   rollout_nodes=0)).job
print(json.dumps({
    "namespace": attach._namespace, "timeout": attach._timeout,
    "attach": {n: [m["num_replicas"], m["label_selector"], m["provisioned"]] for n, m in attach._meshes.items()},
    "made": {n: [m["num_replicas"], m["image_spec"].image, m["image_spec"].resources] for n, m in made._meshes.items()},
}))
"""


def test_kubernetes_job_gets_its_meshes_from_the_flags():
    # A child process, as for Slurm (KubernetesJob switches the Monarch transport too).
    if subprocess.run([sys.executable, "-c", "import kubernetes"], capture_output=True, env=ENV).returncode:
        pytest.skip("the kubernetes client is not installed (pip install kubernetes)")
    child = subprocess.run([sys.executable, "-c", _K8S_CHILD], capture_output=True, text=True, timeout=120, env=ENV)
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["namespace"] == "rl" and result["timeout"] == 300
    selector = "app.kubernetes.io/name=monarch-worker,monarch.pytorch.org/mesh-name="
    assert result["attach"] == {"trainer": [2, selector + "trainer", False], "gen": [1, selector + "gen", False]}
    assert result["made"] == {"trainer": [1, "ghcr.io/me/meshrl:1", {"nvidia.com/gpu": 8}]}  # rollout shares it


def test_kubernetes_without_its_client_says_what_to_install(monkeypatch):
    import importlib.util

    from meshrl.controller.provision import Provisioner

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "kubernetes" else real(name, *a))
    with pytest.raises(
        ConfigError, match=r"--placement k8s needs the Kubernetes Python client: pip install kubernetes"
    ):
        Provisioner(PlacementConfig(kind="k8s"))


def test_a_trainer_that_does_not_spread_evenly_is_refused_before_the_job_starts():
    # A child process: monarch.job imports flask, whose module proxies break a vLLM engine built later in this one.
    code = (
        "from meshrl.config import ConfigError, PlacementConfig\n"
        "from meshrl.controller.provision import Provisioner\n"
        "provision = Provisioner(PlacementConfig(kind='process', trainer_nodes=2))\n"
        "try:\n    provision.procs('trainer', 3)\nexcept ConfigError as e:\n    print(e)\n"
        "print('job started:', provision.job.active)\n"
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert child.returncode == 0, child.stderr[-3000:]
    assert "trainer.num_procs=3 ranks do not spread evenly over --placement.trainer-nodes=2" in child.stdout
    assert "job started: False" in child.stdout  # no host was started


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (dict(kind="slurms"), r"--placement 'slurms': use local, hosts .*, process, slurm or k8s"),
        (dict(kind="process", slurm_partition="gpu"), r"--placement.slurm-partition has no effect with"),
        (dict(kind="slurm", workers="tcp://a:1"), r"--placement.workers has no effect with --placement slurm"),
        (dict(kind="hosts", workers="tcp://a:1", trainer_nodes=2), r"--placement.trainer-nodes has no effect with"),
        (dict(kind="local", spawn_timeout_s=5), r"--placement.spawn-timeout-s has no effect with --placement local"),
        (dict(kind="slurm", slurm_time="2h"), r"--placement.slurm-time='2h' is not a Slurm time limit"),
        (dict(kind="slurm", slurm_args="--constraint h100"), r"--placement.slurm-args: 'h100' is not an option"),
        (dict(kind="process", trainer_nodes=0), r"--placement.trainer-nodes=0 must be >= 1"),
        (dict(kind="k8s", k8s_gpus_per_pod=8), r"--placement.k8s-gpus-per-pod needs --placement.k8s-image"),
        (dict(kind="k8s", k8s_trainer_mesh="Trainer"), r"--placement.k8s-trainer-mesh='Trainer': a mesh name is"),
        (dict(kind="k8s", k8s_rollout_mesh="trainer"), r"are both 'trainer'"),
        (dict(kind="process", spawn_timeout_s=0), r"--placement.spawn-timeout-s=0 must be > 0"),
    ],
)  # fmt: skip
def test_bad_placement_flags_are_refused_naming_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message):
        PlacementConfig(**flags)


_LOST_HOST_CHILD = r"""
import json, os, signal
import monarch.actor
from meshrl.actors.heartbeat import Heartbeat
from meshrl.config import PlacementConfig
from meshrl.controller.provision import HostLostError, Provisioner

monarch.actor.unhandled_fault_hook = lambda failure: None  # as the Controller does: the test reads the outcome
# 8 s: a live host starts a process in ~1 s, but took over 3 s under the load of two test workers
provision = Provisioner(PlacementConfig(kind="process", rollout_nodes=2, spawn_timeout_s=8))

def replica():
    return provision.procs("generator", 1).spawn("heartbeat", Heartbeat).beat.call_one().get(timeout=60)["pid"]

def host_of(pid):
    while True:
        pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        if b"run_worker_loop_forever" in open(f"/proc/{pid}/cmdline", "rb").read():
            return pid

first, second = host_of(replica()), host_of(replica())  # rollout[0], rollout[1]
for entry in os.listdir("/proc"):  # rollout[1] dies, with every process on it
    if entry.isdigit() and os.getsid(int(entry)) == second:
        os.kill(int(entry), signal.SIGKILL)
provision.procs("generator", 1)  # the round-robin's turn of rollout[0]
replacement = host_of(replica())  # rollout[1]'s turn: lost after 8 s, so on rollout[0]
lost = dict(provision.lost)
for entry in os.listdir("/proc"):
    if entry.isdigit() and os.getsid(int(entry)) == first:
        os.kill(int(entry), signal.SIGKILL)
try:
    replica()
    error = None
except HostLostError as e:
    error = str(e)
print(json.dumps({"first": first, "second": second, "replacement": replacement, "lost": lost, "error": error}))
"""


def test_a_replica_whose_host_is_lost_is_started_on_a_live_host_until_none_is_left():
    """`--placement process --placement.rollout-nodes 2`: with one rollout host dead, a replica whose turn falls on
    it starts on the other one (after --placement.spawn-timeout-s); with both dead, HostLostError names the host."""
    child = subprocess.run(
        [sys.executable, "-c", _LOST_HOST_CHILD], capture_output=True, text=True, timeout=120, env=ENV
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["first"] != result["second"] and result["replacement"] == result["first"], result
    assert (
        list(result["lost"]) == ["rollout[1]"]
        and "within --placement.spawn-timeout-s=8s" in result["lost"]["rollout[1]"]
    )
    assert result["error"].startswith("the generator host rollout[0] is lost"), result["error"]
