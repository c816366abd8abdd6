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
    2: "measured 0.42x the one-GPU step on 2x H100 (median; 0.60x with micro-batches of 32), where a second "
    "generator on the trainer's GPU was slower (bench/NOTES.md)",
    4: "measured 0.29x the one-GPU step on 4x H100 (same job) and 0.22x per unit of work at 4x the prompts, where "
    "one trainer rank and three generators took 0.42x (the trainer is the slower side) and four colocated ranks with "
    "a generator each 1.15x (bench/NOTES.md)",
}
"""GPU counts whose `gpu_layout` was measured fastest (bench/gpu_check.sh), and what was measured."""

ALONE_MICRO_BATCH_PER_RANK = 128
"""Sequences per `forward_backward` call and trainer rank when the trainer has its GPUs to itself (the token budget
still bounds each call). Measured on 2x H100: 8 calls of 32 -> 3 calls, train 1.88 -> 1.40 s (median)."""
SHARED_MICRO_BATCH_PER_RANK = 32
"""The same where generators share the trainer's GPUs (TrainerConfig's default, for one rank)."""


@dataclass(frozen=True)
class GpuLayout:
    """Where `--placement.gpus` N puts the processes: GPU indices of the trainer ranks and of the generator
    replicas (one replica per index), whether the loop runs ahead (asynchronous), and the micro-batch cap."""

    trainer_gpus: list[int]
    generator_gpus: list[int]
    asynchronous: bool
    micro_batch_size: int
    why: str


GPU_LAYOUTS = ("auto", "split", "colocated")


def gpu_layout(gpus: int, trainer_ranks: int | None = None, layout: str = "auto") -> GpuLayout:
    """The layout for `gpus` GPUs of one machine. `trainer_ranks`: the user's --trainer.num-procs (None: chosen).
    `layout` (--placement.layout): 'auto' (the measured fastest), 'split' or 'colocated'.

    split (auto for N >= 2): the trainer gets the first half of the GPUs (a power of two ranks, so that batches of
    powers of two split evenly over them) and generators the rest, one per GPU, and the loop runs one version ahead:
    generation on its own GPUs overlaps training, weights cross by CUDA IPC in milliseconds. Measured on 2 and 4
    H100s (MEASURED_GPU_LAYOUTS); other counts follow the same rule, unmeasured.
    colocated (auto for 1 GPU, and where the trainer ranks given take every GPU): a trainer rank and a generator on
    every GPU, taking turns (the synchronous loop), as verl and OpenRLHF lay out a node."""
    if gpus < 1:
        raise ConfigError(f"--placement.gpus {gpus}: give 1 or more GPUs")
    if layout not in GPU_LAYOUTS:
        raise ConfigError(f"--placement.layout {layout!r}: use one of {', '.join(GPU_LAYOUTS)}")
    if trainer_ranks is not None and trainer_ranks > gpus:
        raise ConfigError(
            f"--placement.gpus {gpus} with --trainer.num-procs {trainer_ranks}: one trainer rank per GPU at most; "
            f"use --trainer.num-procs {gpus} or fewer (or place the ranks with --trainer.devices)"
        )
    if layout == "split" and (gpus < 2 or trainer_ranks == gpus):
        raise ConfigError(
            f"--placement.layout split with --placement.gpus {gpus}"
            + (f" and --trainer.num-procs {trainer_ranks}" if trainer_ranks == gpus else "")
            + ": splitting needs a GPU for the generators that no trainer rank takes; give more GPUs, fewer "
            "trainer ranks, or --placement.layout colocated"
        )
    if trainer_ranks is None:
        if layout == "colocated":
            trainer_ranks = gpus
        else:  # the largest power of two <= gpus // 2 (>= 1)
            trainer_ranks = 1 << max(gpus // 2, 1).bit_length() - 1
    trainer = list(range(trainer_ranks))
    if trainer_ranks == gpus or layout == "colocated":  # a generator beside every trainer rank, on every GPU
        measured = MEASURED_GPU_LAYOUTS[1] if gpus == 1 else "colocated, as asked"
        return GpuLayout(trainer, list(range(gpus)), False, SHARED_MICRO_BATCH_PER_RANK * trainer_ranks, measured)
    measured = MEASURED_GPU_LAYOUTS.get(gpus, "the rule measured on 2 and 4 GPUs; this count is not measured yet")
    return GpuLayout(
        trainer, list(range(trainer_ranks, gpus)), True, ALONE_MICRO_BATCH_PER_RANK * trainer_ranks, measured
    )


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
    fastest (bench/gpu_check.sh, bench/NOTES.md), for what is not set otherwise: devices unset, the counts,
    --trainer.micro-batch-size and --grpo.max-staleness at their defaults.
    1: trainer and generators share GPU 0 (the synchronous loop; generators sleep while the trainer trains).
    N >= 2: trainer ranks (FSDP) on the first half of the GPUs (a power of two), a generator replica on each of the
    others, weights across by CUDA IPC, the asynchronous loop (--grpo.max-staleness 1: samples are one policy
    version old), micro-batches of up to 128 sequences per trainer rank (the trainer has its GPUs to itself; the
    token budget still bounds each call). Measured: 2 GPUs 0.42x and 4 GPUs 0.29x the one-GPU step on H100s (same
    job); other counts follow the same rule, not measured yet. --placement.layout colocated (or --trainer.num-procs N
    on the command line for N GPUs): a generator beside each rank, synchronous. Unset: every
    process on the default GPU unless --trainer.devices /
    --generator.devices say otherwise. The run prints the layout and why."""
    layout: str = "auto"
    """With --placement.gpus: 'auto' (the layout measured fastest for the count, above), 'split' (trainer ranks on
    the first half of the GPUs, generators on the rest, the asynchronous loop) or 'colocated' (a trainer rank and a
    generator on every GPU, taking turns: the synchronous loop, as verl and OpenRLHF lay out a node)."""
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
        if self.layout not in GPU_LAYOUTS:
            raise ConfigError(f"--placement.layout {self.layout!r}: use one of {', '.join(GPU_LAYOUTS)}")
        if self.layout != "auto" and self.gpus is None:
            raise ConfigError(
                f"--placement.layout {self.layout} lays out --placement.gpus N: give the GPU count too (or place "
                "the processes with --trainer.devices / --generator.devices)"
            )
        if self.gpus is not None:
            self._check_gpus()
        if self.kind == "slurm":
            self._check_slurm()
        if self.kind == "k8s":
            self._check_k8s()

    def _check_gpus(self) -> None:
        if self.gpus < 1:
            raise ConfigError(
                f"--placement.gpus {self.gpus}: give 1 or more GPUs (unset: place with --trainer.devices)"
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
