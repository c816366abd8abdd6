"""Where the run's processes start: the one place that spawns process meshes (the `Controller` asks it by role).

- 'local': this machine (`this_host()`).
- 'hosts': Monarch workers started beforehand, one per host (`python -m meshrl.controller.worker --address
  tcp://HOST:PORT`, by hand, by `srun`, or as a pod's command); the controller attaches to them
  (`attach_to_workers`) and puts each role on the host `PlacementConfig` names for it.
- 'process' / 'slurm' / 'k8s': a Monarch job (`monarch.job`'s ProcessJob, SlurmJob, KubernetesJob), each of its
  hosts running Monarch's worker loop, with two named host meshes: 'trainer' (the trainer ranks spread over its
  hosts, the reference model beside them) and 'rollout' (generator replicas and reward processes, round-robin over
  its hosts). The job is applied at the first spawn (after the controller has put its import path into the
  environment, which the workers inherit), each role's host mesh is taken from `job.state()`, and the job is
  killed when the controller exits (the Slurm allocation cancelled, provisioned MonarchMesh resources deleted,
  worker subprocesses ended), unless `--placement.job-cache` keeps it for the next run.

Every spawn off this machine waits for its processes to start, for at most `--placement.spawn-timeout-s`: a host
that does not start them is lost (`HostLostError`, naming host and role) and is not asked again, so a replica
that died with its host is not replaced there: the run ends with the resume command instead of hanging.
Nothing here opens a connection of its own: Monarch carries every message, weight sync through torchstore included.
"""

from __future__ import annotations

import atexit
import importlib.util
import shutil
import sys
from typing import Any

from meshrl import proc_zygote
from meshrl.controller.futures import ActorDiedError
from meshrl.errors import ConfigError
from meshrl.placement import PlacementConfig

ROLES = ("trainer", "generator", "reward", "reference")
JOB_KINDS = ("process", "slurm", "k8s")
# A job's two host meshes: the trainer's (the reference model joins it: it computes the same batches' logprobs)
# and the rollout mesh (generation and scoring, replicas that can be replaced one at a time).
_GROUP = {"trainer": "trainer", "reference": "trainer", "generator": "rollout", "reward": "rollout"}


class HostLostError(ActorDiedError):
    """A host of the run did not start the processes asked of it in time: it died, or is cut off."""


class Provisioner:
    """Process meshes by role, on the hosts `PlacementConfig` says.

    provision = Provisioner(PlacementConfig(kind="process", trainer_nodes=2))
    trainer_procs = provision.procs("trainer", 2)        # one process on each of the trainer's two hosts
    """

    def __init__(self, cfg: PlacementConfig | None = None) -> None:
        self.cfg = cfg or PlacementConfig()
        # Built now (a missing scheduler tool or package fails before anything starts), applied at the first spawn.
        self.job = make_job(self.cfg) if self.cfg.kind in JOB_KINDS else None
        self._meshes: dict[str, Any] | None = None  # mesh name -> HostMesh, attached on first use
        self._turns: dict[str, int] = {}  # role -> processes placed so far (round-robin over its hosts)
        self.lost: dict[str, str] = {}  # host -> why it is taken for lost
        self._ended = False
        if self.cfg.kind == "hosts" and not all(map(_is_loopback, self.cfg.worker_addresses)):
            _tcp_transport()
        if self.job is not None and self.cfg.job_cache is None:
            atexit.register(self.shutdown)  # however the controller exits (the Controller need not be shut down)

    def host(self, role: str) -> Any:
        """The Monarch host mesh (one host) that `role`'s processes start on (its first, where they span several)."""
        _check_role(role)
        if self.cfg.kind == "local":
            from monarch.actor import this_host

            return this_host()
        mesh, hosts = self._hosts_for(role)
        return self._host_meshes()[mesh].slice(hosts=self._next_live(mesh, hosts, advance=None))

    def procs(self, role: str, num: int) -> Any:
        """A mesh of `num` new processes for `role`, started (HostLostError when their host does not start them)."""
        _check_role(role)
        if self.cfg.kind == "local":
            from monarch.actor import this_host

            return this_host().spawn_procs(per_host={"procs": num}, bootstrap_command=_local_bootstrap())
        mesh, hosts = self._hosts_for(role)
        if role in ("generator", "reward"):
            return self._spawn_replica(role, mesh, hosts, num)
        if num % len(hosts):
            if role == "trainer":
                raise ConfigError(
                    f"trainer.num_procs={num} ranks do not spread evenly over --placement.trainer-nodes="
                    f"{len(hosts)} hosts: make it a multiple"
                )
            hosts = hosts[:1]  # a reference model of another size than the trainer's: on the first trainer host
        return self._spawn(role, mesh, hosts, num // len(hosts))

    def describe(self) -> str:
        if self.cfg.kind == "local":
            return "every process on this machine"
        where = {role: self._describe_hosts(*self._hosts_for(role)) for role in ("trainer", "generator", "reward")}
        text = "; ".join(f"{role}s on {hosts}" for role, hosts in where.items())
        return text if self.job is None else f"a Monarch {type(self.job).__name__}: {text}"

    def shutdown(self) -> None:
        """End the job this run started: its workers and every process on them (also done at exit; once). A job
        kept by --placement.job-cache, and the workers of --placement hosts, are left running."""
        if self.job is None or self._ended or self.cfg.job_cache is not None:
            return
        self._ended = True
        try:
            self.job.kill()
        except NotImplementedError:
            pass  # KubernetesJob: pods that the run did not provision are not its to delete
        except Exception as e:  # noqa: BLE001 - at exit: say so, the run's own outcome is already decided
            print(f"[meshrl] could not end the {self.cfg.kind} job: {e}", file=sys.stderr, flush=True)

    # ---- where ------------------------------------------------------------------------------------------------
    def _hosts_for(self, role: str) -> tuple[str, list[int]]:
        """The host mesh `role` starts on, and the indices of the hosts in it that it may use."""
        if self.cfg.kind == "hosts":
            index = getattr(self.cfg, f"{'trainer' if role == 'reference' else role}_host")
            return "workers", [index % len(self.cfg.worker_addresses)]
        sizes = job_meshes(self.cfg)
        mesh = mesh_name(self.cfg, _GROUP[role])
        return mesh, list(range(sizes[mesh]))

    def _next_live(self, mesh: str, hosts: list[int], advance: str | None) -> int:
        """The next host of `hosts` in `advance`'s round-robin (None: the first) that is not lost; a lost one when
        all are (the spawn there then fails at once)."""
        turn = 0
        if advance is not None:
            turn = self._turns.get(advance, 0)
            self._turns[advance] = turn + 1
        live = [h for h in hosts if self._label(mesh, h) not in self.lost] or hosts
        return live[turn % len(live)]

    def _label(self, mesh: str, index: int) -> str:
        if self.cfg.kind == "hosts":
            return self.cfg.worker_addresses[index]
        return f"{mesh}[{index}]"

    def _describe_hosts(self, mesh: str, hosts: list[int]) -> str:
        if self.cfg.kind == "hosts":
            return self._label(mesh, hosts[0])
        return f"the {mesh!r} mesh ({len(hosts)} host{'s' if len(hosts) > 1 else ''})"

    # ---- starting processes -----------------------------------------------------------------------------------
    def _host_meshes(self) -> dict[str, Any]:
        if self._meshes is None:
            if self.job is None:
                from monarch.actor import attach_to_workers

                # TLS between controller and workers is not plumbed in this Monarch (attach_to_workers raises for
                # it): run the workers on a private network, as a Slurm or Kubernetes job's nodes are.
                workers = self.cfg.worker_addresses
                self._meshes = {"workers": attach_to_workers(ca="trust_all_connections", workers=workers)}
            else:
                self._meshes = start_job(self.job, self.cfg)
        return self._meshes

    def _spawn_replica(self, role: str, mesh: str, hosts: list[int], num: int) -> Any:
        """A replica's processes on the next host of the round-robin; on the one after it when that host turns out to
        be lost (so a replica that died with its host is replaced on a live one), until none is left."""
        while True:
            try:
                return self._spawn(role, mesh, [self._next_live(mesh, hosts, advance=role)], num)
            except HostLostError:
                if all(self._label(mesh, h) in self.lost for h in hosts):
                    raise

    def _spawn(self, role: str, mesh: str, hosts: list[int], per_host: int) -> Any:
        where = " and ".join(self._label(mesh, h) for h in hosts)
        if lost := [self.lost[self._label(mesh, h)] for h in hosts if self._label(mesh, h) in self.lost]:
            raise HostLostError(f"cannot start {role} processes on {where}: that host was lost earlier ({lost[0]})")
        host_mesh = self._host_meshes()[mesh]
        target = host_mesh if len(hosts) > 1 else host_mesh.slice(hosts=hosts[0])
        procs = target.spawn_procs(per_host={"procs": per_host})
        # Monarch keeps a request to a dead host waiting (its own limit is minutes away): bound the wait here.
        timeout = self.cfg.spawn_timeout_s
        try:
            procs.initialized.get(timeout=timeout)
        except Exception as e:  # noqa: BLE001 - TimeoutError (no answer) or a supervision error (the host is gone)
            why = f"no processes started within --placement.spawn-timeout-s={timeout:g}s"
            if not isinstance(e, TimeoutError):
                why = f"starting processes failed: {_last_line(e)}"
            for h in hosts:
                self.lost[self._label(mesh, h)] = why
            try:
                procs.stop()  # not waited for: the host may never answer
            except Exception:  # noqa: BLE001 - best effort
                pass
            raise HostLostError(
                f"the {role} host {where} is lost (dead, or cut off from this controller): {why}"
            ) from None
        return procs


def job_meshes(cfg: PlacementConfig) -> dict[str, int]:
    """A job's host meshes and their sizes: {'trainer': trainer_nodes, 'rollout': rollout_nodes} (named as
    --placement.k8s-*-mesh say on Kubernetes; no rollout mesh with rollout_nodes=0)."""
    meshes = {mesh_name(cfg, "trainer"): cfg.trainer_nodes}
    if cfg.rollout_nodes:
        meshes[mesh_name(cfg, "rollout")] = cfg.rollout_nodes
    return meshes


def mesh_name(cfg: PlacementConfig, group: str) -> str:
    if group == "rollout" and not cfg.rollout_nodes:
        group = "trainer"  # the rollout roles share the trainer's hosts
    return getattr(cfg, f"k8s_{group}_mesh") if cfg.kind == "k8s" else group


def make_job(cfg: PlacementConfig) -> Any:
    """The Monarch job `cfg` describes, not yet applied (nothing is submitted or started)."""
    meshes = job_meshes(cfg)
    if cfg.kind == "process":
        return _monarch_job_class("ProcessJob")(meshes)
    if cfg.kind == "slurm":
        return slurm_job(cfg, meshes)
    if cfg.kind == "k8s":
        return kubernetes_job(cfg, meshes)
    raise ValueError(f"--placement {cfg.kind} is not a Monarch job; one of {JOB_KINDS}")


def slurm_job(cfg: PlacementConfig, meshes: dict[str, int]) -> Any:
    # SlurmJob calls sbatch / squeue / scancel as subprocesses: a missing one would be a FileNotFoundError deep in
    # Monarch, after the run's model was built.
    missing = [tool for tool in ("sbatch", "squeue", "scancel") if shutil.which(tool) is None]
    if missing:
        raise ConfigError(
            f"--placement slurm needs Slurm's {', '.join(missing)} on PATH, and this machine has none: run the "
            "controller on a login or compute node of the cluster (or start workers yourself: --placement hosts)"
        )
    return _monarch_job_class("SlurmJob")(
        meshes,
        python_exe=cfg.slurm_python or sys.executable,
        slurm_args=cfg.slurm_arg_list,
        monarch_port=cfg.slurm_port,
        job_name="meshrl",
        time_limit=cfg.slurm_time,
        partition=cfg.slurm_partition,
        gpus_per_node=cfg.slurm_gpus_per_node,
        job_start_timeout=cfg.start_timeout_s,
        account=cfg.slurm_account,
        qos=cfg.slurm_qos,
    )


def kubernetes_job(cfg: PlacementConfig, meshes: dict[str, int]) -> Any:
    if importlib.util.find_spec("kubernetes") is None:  # Monarch's module raises a RuntimeError at import without it
        raise ConfigError("--placement k8s needs the Kubernetes Python client: pip install kubernetes")
    try:
        from monarch.job.kubernetes import ImageSpec, KubeConfig, KubernetesJob
    except ImportError as e:
        raise ConfigError(f"--placement k8s: this Monarch has no KubernetesJob ({e}); use --placement hosts") from e
    kubeconfig = KubeConfig.from_path(cfg.k8s_kubeconfig) if cfg.k8s_kubeconfig else None
    job = KubernetesJob(cfg.k8s_namespace, timeout=cfg.start_timeout_s, kubeconfig=kubeconfig)
    resources = {"nvidia.com/gpu": cfg.k8s_gpus_per_pod} if cfg.k8s_gpus_per_pod else None
    for name, nodes in meshes.items():
        if cfg.k8s_image is None:  # pods already running, found by Monarch's labels
            job.add_mesh(name, nodes)
        else:
            job.add_mesh(name, nodes, image_spec=ImageSpec(cfg.k8s_image, resources=resources))
    return job


def start_job(job: Any, cfg: PlacementConfig) -> dict[str, Any]:
    """Apply `job` (or attach to the one saved in --placement.job-cache) and take each of its host meshes."""
    try:
        state = job.state(cached_path=cfg.job_cache)
    except Exception as e:  # noqa: BLE001 - sbatch refused, pods never ready, ...: say which flags to look at
        raise ConfigError(
            f"--placement {cfg.kind}: the Monarch job did not start ({type(e).__name__}: {_last_line(e)}); check the "
            f"--placement.{cfg.kind}-* flags and the scheduler's own logs"
        ) from e
    return {name: getattr(state, name) for name in job_meshes(cfg)}


def _monarch_job_class(name: str) -> Any:
    try:
        import monarch.job
    except ImportError as e:
        raise ConfigError(f"this Monarch has no job API (monarch.job: {e}); use --placement hosts") from e
    if not hasattr(monarch.job, name):
        raise ConfigError(f"this Monarch's monarch.job has no {name}; use --placement hosts")
    return getattr(monarch.job, name)


def _tcp_transport() -> None:
    """Workers on other hosts must be able to dial this controller back: serve it on TCP at this host's name (what
    SlurmJob and KubernetesJob set for their controllers), not on the default Unix socket."""
    from monarch._rust_bindings.monarch_hyperactor.channel import ChannelTransport
    from monarch._rust_bindings.monarch_hyperactor.config import configure

    configure(default_transport=ChannelTransport.TcpWithHostname)


def _is_loopback(address: str) -> bool:
    """Workers on this machine (tests, a single node) reach the controller on its default Unix socket; this
    Monarch cannot serve TCP at a host name that resolves to loopback only."""
    host = address.rsplit("@", 1)[-1].split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def _local_bootstrap() -> Any:
    """Monarch's default bootstrap command, or, with MESHRL_PROC_ZYGOTE=1, the same command served by a zygote
    that forks each process with torch already imported (meshrl.proc_zygote)."""
    if not proc_zygote.enabled():
        return None
    from monarch._rust_bindings.monarch_hyperactor.host_mesh import BootstrapCommand
    from monarch._src.actor.proc_mesh import _get_bootstrap_args  # what default_bootstrap_cmd() is made of

    _, args, env = _get_bootstrap_args()
    if not args:  # a packaged binary (PAR) bootstraps itself: it starts as Monarch starts it
        return None
    program, args = proc_zygote.bootstrap_args(list(args))
    return BootstrapCommand(program, None, args, env)


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; one of {ROLES}")


def _last_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__
