"""Where a run's processes start (`--placement.*`): this machine, Monarch workers already running on several hosts,
or a Monarch job the run starts itself (Slurm, Kubernetes, local stand-in processes). `controller/provision.py`
reads it whole and spawns the role meshes there; `meshrl.devices` then pins each process to its GPU.

    Provisioner(PlacementConfig(kind="slurm", trainer_nodes=2, slurm_partition="gpu"))

No Monarch in here, so `meshrl.config` nests it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshrl.errors import ConfigError

MEASURED_GPU_LAYOUTS = {
    1: "trainer and generators on GPU 0, the synchronous loop",
    2: "trainer on GPU 0 with micro-batches of up to 128, generators on GPU 1, the asynchronous loop (max-staleness "
    "1): measured 0.42x the one-GPU step on 2x H100 (median; 0.60x with micro-batches of 32; bench/NOTES.md), "
    "where a second generator on the trainer's GPU was slower",
}
"""`--placement.gpus` N -> the layout it chooses, and why (bench/gpu_check.sh measures each)."""


@dataclass
class PlacementConfig:
    kind: str = "local"
    """Where the run's processes start: 'local' (this machine); 'hosts' (Monarch workers already running, one per
    host, started with `python -m meshrl.controller.worker --address tcp://HOST:PORT`; the controller attaches to
    them); or a Monarch job that the run starts and ends itself: 'slurm' (an sbatch allocation), 'k8s' (Kubernetes
    pods), 'process' (each host a local subprocess running Monarch's worker loop: Monarch's stand-in for several
    hosts on one machine). A job has two host meshes: 'trainer' (trainer ranks, reference model) and 'rollout'
    (generator replicas and reward processes)."""
    workers: str | None = None
    """kind=hosts: the workers' addresses, comma-separated, e.g. 'tcp://node0:26600,tcp://node1:26600'; host i is
    the i-th."""
    trainer_host: int = 0
    """kind=hosts: the host (index into --placement.workers; negative counts from the end) of the trainer ranks."""
    generator_host: int = -1
    """kind=hosts: the host of the generator replicas (default: the last)."""
    reward_host: int = -1
    """kind=hosts: the host of the reward processes (default: the last)."""
    trainer_nodes: int = 1
    """slurm/k8s/process: hosts of the 'trainer' mesh. The trainer ranks are spread evenly over them
    (trainer.num_procs a multiple of it); the reference model goes beside them."""
    rollout_nodes: int = 1
    """slurm/k8s/process: hosts of the 'rollout' mesh; generator replicas and reward processes go round-robin over
    them. 0: no such mesh, they share the trainer's hosts."""
    spawn_timeout_s: float = 60.0
    """Any kind but local: a host that has not started a process this long after being asked is lost (dead or cut
    off). The run ends with the resume command, instead of waiting run.call_timeout_s for a host that is gone; a
    replica on it is not replaced there."""
    job_cache: str | None = None
    """slurm/k8s/process: Monarch's job file (e.g. .monarch/job_state.pkl). The run reuses the job saved there when
    it is still alive with the same spec (else starts one and saves it), and leaves it running at the end, for the
    next run or a resume: end it yourself (scancel, kubectl delete). Unset: the run's own job, ended with the run."""
    start_timeout_s: int | None = None
    """slurm: the longest wait in the queue; k8s: for the pods to be ready. Unset: wait as long as it takes."""
    slurm_partition: str | None = None
    """slurm: the partition (sbatch --partition); unset: the cluster's default."""
    slurm_time: str | None = None
    """slurm: the time limit (sbatch --time), e.g. '4:00:00' or '1-12:00:00'; unset: the partition's default."""
    slurm_gpus_per_node: int | None = None
    """slurm: GPUs per node (sbatch --gpus-per-node); unset: none asked for."""
    slurm_account: str | None = None
    """slurm: the account charged (sbatch --account)."""
    slurm_qos: str | None = None
    """slurm: the quality of service (sbatch --qos)."""
    slurm_args: str = ""
    """slurm: more sbatch options, space-separated, each as --name=value, e.g. '--constraint=h100 --mem=0'."""
    slurm_python: str | None = None
    """slurm: the Python that runs Monarch's worker on each node (it needs meshrl installed); unset: the
    controller's own interpreter, which a shared filesystem makes the same path on every node."""
    slurm_port: int = 22222
    """slurm: the TCP port the workers listen on, on each node."""
    k8s_namespace: str = "default"
    """k8s: the namespace of the pods."""
    k8s_image: str | None = None
    """k8s: provision the meshes with this container image (a MonarchMesh resource each, for the MonarchMesh
    operator, deleted at the end). Unset: attach to pods already running, labelled
    app.kubernetes.io/name=monarch-worker and monarch.pytorch.org/mesh-name=MESH, with their rank in
    apps.kubernetes.io/pod-index (a StatefulSet sets it)."""
    k8s_gpus_per_pod: int = 0
    """k8s with --placement.k8s-image: nvidia.com/gpu asked for per pod."""
    k8s_trainer_mesh: str = "trainer"
    """k8s: the name of the trainer's mesh (the mesh-name label of its pods, or its MonarchMesh)."""
    k8s_rollout_mesh: str = "rollout"
    """k8s: the name of the rollout mesh (generators and reward processes)."""
    gpus: int | None = None
    """GPUs of this machine the run lays its processes out over (the first N it sees), in the layout measured
    fastest for that count (bench/gpu_check.sh, bench/NOTES.md), for what is not set otherwise: devices unset,
    --trainer.num-procs, --trainer.micro-batch-size and --grpo.max-staleness at their defaults (one trainer rank).
    1: trainer and generators share GPU 0 (the synchronous loop; generators sleep while the trainer trains).
    2: trainer on GPU 0, the generators on GPU 1, weights across by CUDA IPC, the asynchronous loop
    (--grpo.max-staleness 1: samples are one policy version old), micro-batches of up to 128 sequences (the trainer
    has the GPU to itself; the token budget still bounds each call) — 0.42x the one-GPU step on 2x H100 (median of
    steps); a second generator on the trainer's GPU measured slower there, since the trainer is the slower side.
    For the synchronous loop on two GPUs, place them with --trainer.devices 0 --generator.devices 1 instead. More
    GPUs: not measured yet; place the processes with those flags. Unset: every process on the default GPU unless
    those flags say otherwise. The run prints the layout and why."""
    k8s_kubeconfig: str | None = None
    """k8s: a kubeconfig file, for a controller outside the cluster (Monarch port-forwards to a pod). Unset: the
    controller runs in the cluster (a pod or Job) and uses the in-cluster config."""

    # Which kinds each field is for: setting one for another kind is refused (it would be silently ignored).
    _JOBS = ("process", "slurm", "k8s")
    _SCOPES = {
        "workers": ("hosts",), "trainer_host": ("hosts",), "generator_host": ("hosts",), "reward_host": ("hosts",),
        "trainer_nodes": _JOBS, "rollout_nodes": _JOBS, "job_cache": _JOBS, "start_timeout_s": ("slurm", "k8s"),
        "spawn_timeout_s": ("hosts", *_JOBS),
    }  # fmt: skip

    def __post_init__(self) -> None:
        if self.kind not in ("local", "hosts", *self._JOBS):
            raise ConfigError(
                f"--placement {self.kind!r}: use local, hosts (Monarch workers you started), process, slurm or k8s "
                "(a Monarch job the run starts); the README's 'Running on several machines' shows each"
            )
        self._check_scopes()
        if not self.spawn_timeout_s > 0:
            raise ConfigError(f"--placement.spawn-timeout-s={self.spawn_timeout_s} must be > 0 (seconds)")
        if self.kind == "hosts":
            self._check_hosts()
        if self.trainer_nodes < 1 or self.rollout_nodes < 0:
            raise ConfigError(
                f"--placement.trainer-nodes={self.trainer_nodes} must be >= 1 and --placement.rollout-nodes="
                f"{self.rollout_nodes} >= 0 (0: generators and reward processes on the trainer's hosts)"
            )
        if self.start_timeout_s is not None and self.start_timeout_s <= 0:
            raise ConfigError(f"--placement.start-timeout-s={self.start_timeout_s} must be > 0 (or unset: no limit)")
        if self.gpus is not None:
            self._check_gpus()
        if self.kind == "slurm":
            self._check_slurm()
        if self.kind == "k8s":
            self._check_k8s()

    def _check_gpus(self) -> None:
        if self.gpus not in MEASURED_GPU_LAYOUTS:
            raise ConfigError(
                f"--placement.gpus {self.gpus}: layouts are measured for {sorted(MEASURED_GPU_LAYOUTS)} GPUs; for "
                "more, place the processes with --trainer.devices / --generator.devices (and --trainer.num-procs, "
                "--generator.num-replicas)"
            )
        if self.kind != "local":
            raise ConfigError(
                f"--placement.gpus lays out the GPUs of this machine, but --placement {self.kind} starts processes "
                "on other hosts; place them there with --trainer.devices / --generator.devices"
            )

    def _check_scopes(self) -> None:
        from dataclasses import fields

        for f in fields(self):
            kinds = self._SCOPES.get(f.name)
            if kinds is None and f.name.startswith(("slurm_", "k8s_")):
                kinds = (f.name.split("_", 1)[0],)
            if kinds and self.kind not in kinds and getattr(self, f.name) != f.default:
                flag = f"--placement.{f.name.replace('_', '-')}"
                raise ConfigError(
                    f"{flag} has no effect with --placement {self.kind}: it is for --placement {' / '.join(kinds)}"
                )

    def _check_hosts(self) -> None:
        addresses = self.worker_addresses
        if not addresses:
            raise ConfigError("--placement hosts needs --placement.workers tcp://HOST:PORT,... (one per host)")
        for a in addresses:
            if "://" not in a:
                raise ConfigError(f"--placement.workers entry {a!r} is not an address like tcp://HOST:PORT")
        for name in ("trainer_host", "generator_host", "reward_host"):
            index = getattr(self, name)
            if not -len(addresses) <= index < len(addresses):
                raise ConfigError(
                    f"--placement.{name.replace('_', '-')}={index}, but --placement.workers names {len(addresses)} "
                    f"host(s): use 0..{len(addresses) - 1} (or -1 for the last)"
                )

    def _check_slurm(self) -> None:
        import re

        if self.slurm_time is not None and not re.fullmatch(r"(\d+-)?\d+(:\d\d){0,2}", self.slurm_time):
            raise ConfigError(
                f"--placement.slurm-time={self.slurm_time!r} is not a Slurm time limit: use MINUTES, HH:MM:SS or "
                "DAYS-HH:MM:SS"
            )
        if self.slurm_gpus_per_node is not None and self.slurm_gpus_per_node < 0:
            raise ConfigError(f"--placement.slurm-gpus-per-node={self.slurm_gpus_per_node} must be >= 0")
        if not 0 < self.slurm_port < 65536:
            raise ConfigError(f"--placement.slurm-port={self.slurm_port} is not a TCP port (1..65535)")
        for arg in self.slurm_arg_list:
            if not arg.startswith("-"):
                raise ConfigError(
                    f"--placement.slurm-args: {arg!r} is not an option; write each as --name=value (e.g. "
                    "'--constraint=h100 --mem=0'), one sbatch directive each"
                )

    def _check_k8s(self) -> None:
        for name in ("k8s_trainer_mesh", "k8s_rollout_mesh"):
            mesh = getattr(self, name)
            # Monarch's rule for mesh names (an RFC 1123 label that is also a host name part).
            if not (0 < len(mesh) <= 63 and mesh.isalnum() and mesh.islower() and mesh[0].isalpha()):
                raise ConfigError(
                    f"--placement.{name.replace('_', '-')}={mesh!r}: a mesh name is 1-63 lowercase letters and digits, "
                    "starting with a letter"
                )
        if self.k8s_trainer_mesh == self.k8s_rollout_mesh and self.rollout_nodes:
            raise ConfigError(
                f"--placement.k8s-trainer-mesh and --placement.k8s-rollout-mesh are both {self.k8s_trainer_mesh!r}: "
                "name two meshes, or set --placement.rollout-nodes 0 to put everything on the trainer's"
            )
        if self.k8s_gpus_per_pod < 0:
            raise ConfigError(f"--placement.k8s-gpus-per-pod={self.k8s_gpus_per_pod} must be >= 0")
        if self.k8s_gpus_per_pod and self.k8s_image is None:
            raise ConfigError(
                "--placement.k8s-gpus-per-pod needs --placement.k8s-image (pods the run provisions); pods already "
                "running have the resources their own spec asks for"
            )

    @property
    def worker_addresses(self) -> list[str]:
        return [a.strip() for a in (self.workers or "").split(",") if a.strip()]

    @property
    def slurm_arg_list(self) -> list[str]:
        import shlex

        return shlex.split(self.slurm_args)
