"""Shared fixtures, and the test lanes (tests/README.md). Monarch process meshes are expensive on 2 cores, so one
Controller (2 FSDP trainer processes, 1 vLLM generator, 1 reward actor) is spawned per test session and reused."""

from __future__ import annotations

import contextlib
import os
import subprocess
import warnings

import pytest
import torch
from markers import is_needs_cuda

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("MESHRL_PLOTS", "0")  # runs skip their PNGs (~3 s each); tests of the plots pass --log.plots
# vLLM's usage-stats thread runs cpuinfo in a python child on a GPU machine (a `unit` test would then start a process)
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no downloads at run time: a missing local file must fail, not fetch
# Actor processes inherit PYTHONPATH: user-written losses in tests/ (e.g. custom_algorithms.py) reach the trainer
# by name ('custom_algorithms:my_loss'), as a user's own module would.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")) if p
)
# Actor processes fork from a process that has torch, transformers and torchtitan imported (meshrl.proc_zygote)
# instead of importing them each: 4-6 CPU-s less per process; full lane 1128 -> 788-840 s (tests/README.md). The
# program started as the README starts it (test_grpo_e2e) runs without it, as users' runs do by default. CPU
# machines only: it has not run on a GPU yet.
if not torch.cuda.is_available():
    os.environ.setdefault("MESHRL_PROC_ZYGOTE", "1")
torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------------- test lanes
# Every test gets one lane, assigned here so that the test files need no per-test marks:
#   unit    in this process only: no process meshes, no engine or helper processes (the fast lane)
#   actors  starts processes (Monarch process meshes, actor processes, python children) but not a whole program
#   e2e     runs a whole program: grpo / sft / eval `main`, or the CLI as a subprocess
# and `actors` and `e2e` tests are also `slow` (not in the fast lane, `-m "not slow"`). Apart from the lanes, a test
# that carries markers.needs_cuda is also `gpu` (`-m gpu`: the tests that need CUDA, skipped on CPU).
# A module not named in MODULE_LANES is `unit`; TEST_LANES overrides the module per test (by function name, all its
# parametrizations); a test that requests a fixture of FIXTURE_LANES gets that fixture's lane unless it is `e2e`.
# A `unit` test that starts a process fails, naming these tables (see _in_process_only).
MODULE_LANES = {
    "test_cli_exit": "actors",  # a Python child, to run its exit
    "test_proc_zygote": "actors",
    "test_algorithms_actors": "actors",
    "test_collective_failure": "actors",
    "test_env_processes": "actors",
    "test_paused_controller": "actors",
    "test_generator_transformers_engine": "actors",
    "test_hf_backend": "actors",
    "test_memory_handoff": "actors",
    "test_weight_sync": "actors",
    "test_weight_sync_parity": "actors",
    "test_architectures_e2e": "e2e",
    "test_vision_e2e": "e2e",
    "test_envs_e2e": "e2e",
    "test_async_overlap": "e2e",
    "test_deferred_grad_sync": "actors",
    "test_vision_ranks": "actors",
    "test_flat_gather": "actors",
    "test_grpo_async": "e2e",
    "test_grpo_e2e": "e2e",
    "test_grpo_resume": "e2e",
    "test_multihost": "e2e",
    "test_placement_jobs": "e2e",
    "test_resume": "e2e",
    "test_shm_faults_e2e": "e2e",
    "test_tasks_e2e": "e2e",
}
TEST_LANES = {
    # in-process checks in modules of another lane
    "test_envs_e2e::test_env_flags": "unit",
    "test_async_overlap::test_generators_cannot_sleep_in_the_asynchronous_loop": "unit",
    "test_env_processes::test_env_workers_flag_and_what_cannot_run_in_a_process": "unit",
    "test_env_processes::test_a_run_whose_environment_hangs_holding_the_interpreter_or_segfaults_finishes": "e2e",
    "test_generator_transformers_engine::test_bad_engine_name_fails_at_launch": "unit",
    "test_hf_backend::test_backend_is_validated": "unit",
    "test_memory_handoff::test_offloaded_optimizer_state_comes_back_exactly": "unit",
    "test_placement_jobs::test_bad_placement_flags_are_refused_naming_the_flag": "unit",
    "test_placement_jobs::test_kubernetes_without_its_client_says_what_to_install": "unit",
    "test_placement_jobs::test_slurm_without_sbatch_is_a_clear_config_error": "unit",
    "test_resume::test_resume_command_repeats_the_run_flags_and_rng_state_round_trips_through_json": "unit",
    "test_flat_gather::test_shard_rows_are_torch_chunks": "unit",
    "test_flat_gather::test_pack_and_unpack_put_uneven_chunks_back_in_place": "unit",
    # a python child process or a process mesh of their own
    "test_shared_buffer::test_another_process_reads_the_published_version_cpu_backing": "actors",
    "test_shared_buffer::test_another_process_reads_through_cuda_ipc_gpu": "actors",
    "test_shared_buffer::test_the_buffer_is_shared_while_the_trainer_allocates_in_expandable_segments": "actors",
    "test_shared_buffer::test_a_process_that_sees_only_another_gpu_reads_the_buffer_bitwise": "actors",
    "test_shared_buffer::test_stale_files_of_dead_processes_are_removed_and_live_ones_kept": "actors",
    "test_shared_buffer::test_a_one_megabyte_shm_is_a_message_not_a_sigbus": "actors",
    "test_engine_protocol::test_generator_actor_sleep_wake_memory": "actors",
    "test_transformers_engine::test_triton_kernels": "actors",
    "test_optim_kahan_kernel::test_kernel_in_the_interpreter_is_the_torch_formulation": "actors",
    "test_devices::test_machine_identity_is_shared_by_the_processes_of_this_machine": "actors",
    "test_faults_issue31::test_a_reward_that_segfaults_on_one_sample_scores_it_zero_and_names_it": "actors",
    "test_faults_issue31::test_a_reward_that_hangs_holding_the_interpreter_on_one_sample_scores_it_zero_and_names_it": (
        "actors"
    ),
    "test_faults_issue31::test_a_stopped_controller_does_not_declare_a_healthy_process_frozen": "actors",
    "test_placement_jobs::test_a_replica_whose_host_is_lost_is_started_on_a_live_host_until_none_is_left": "actors",
    "test_placement_jobs::test_a_trainer_that_does_not_spread_evenly_is_refused_before_the_job_starts": "actors",
    "test_placement_jobs::test_kubernetes_job_gets_its_meshes_from_the_flags": "actors",
    "test_placement_jobs::test_slurm_job_gets_the_flags_into_its_sbatch_script_and_is_cancelled_unless_kept": "actors",
    "test_run_safety::test_a_live_run_holds_its_directory_against_other_processes": "actors",
    "test_vllm_engine::test_multiprocess_engine_loads_weights_through_collective_rpc": "actors",
    "test_weight_sync_shared_buffer::test_cuda_ipc_through_the_actors_gpu": "actors",
    "test_weight_sync_shared_buffer::test_auto_goes_on_with_torchstore_when_a_generator_cannot_open_the_buffer": (
        "actors"
    ),
    # the CLI as a subprocess
    "test_bad_inputs::test_cli_names_file_and_row_of_a_non_utf8_sft_row": "e2e",
    "test_bad_inputs::test_cli_refuses_a_truncated_checkpoint_before_any_process": "e2e",
    "test_config::test_cli_help_lists_every_section": "e2e",
    "test_task_setup::test_torchtitan_on_llama_is_refused_before_any_process": "e2e",
}
FIXTURE_LANES = {"ctl": "actors", "two_ranks": "actors", "shm_ctl": "actors"}  # fixtures that start processes
# In-process tests too slow for the fast lane (the slowest by --durations on the 2-core machine, 6-8 s each there,
# whose engines the fast lane still covers with quicker tests).
SLOW_UNIT = {
    "test_engine_protocol::test_vllm_engine_satisfies_the_protocol_on_cpu",
    "test_transformers_engine::test_sleep_wake_sequencing_over_a_remappable_cache_on_host",
    "test_vllm_engine::test_seeded_batch_larger_than_one_scheduler_step",
    "test_faults_issue31::test_a_real_sigstop_of_the_watching_process_is_not_a_freeze",  # 3 s stopped on purpose
}
# Python children that libraries start on their own inside an in-process test, allowed in the `unit` lane:
# vLLM inspects a model class it has not cached yet (~/.cache/vllm/modelinfos) in a one-shot subprocess;
# torch.compile's inductor may start its compile workers. (Matched as a substring of an argument.)
LIBRARY_PYTHON_CHILDREN = ("vllm.model_executor.models.registry", "_inductor/compile_worker")


# ------------------------------------------------------------------------------------- the work of the two workers
# scripts/test.sh runs two pytest-xdist workers, each handed whole modules (`--dist loadfile`). The modules that use
# the session's `ctl` fixture (2 trainer processes, a vLLM generator, a reward process: ~45 s on 2 cores) go to one
# worker as one unit (SuiteScheduling below), so that `ctl` is made once per run instead of once per worker.
# (Handing the longest modules out first was tried and lost: 25.5 min against 22.5. Both workers then ran whole
# programs side by side for most of the run, 8-10 processes on 2 cores, and each program took longer; xdist's own
# order, modules with the most tests first, pairs programs with in-process tests more often.)
# xdist's order puts the modules of one or two tests last, and those are whole programs: the run ended with one
# worker idle while the other finished a program (the last ~2 min of the full lane had a core ~35% idle). So, on top
# of xdist's order: FIRST_UNITS go out first, in their order (modules that mostly sleep, on one worker while the
# other starts the ctl unit: their idle core goes to its processes), TAIL_MODULES last (quick in-process modules,
# ~80 s in all: whichever worker ends its last program first takes them, so the two end within seconds of each
# other), and a worker gets its next module only when it has one test left (xdist hands it out at two, a program
# module ahead of time).
CTL_MODULES = {
    "test_algorithms_actors",
    "test_generator_transformers_engine",
    "test_token_batching",
    "test_trainer_endpoints",
    "test_weight_shards",
    "test_weight_sync_parity",
    "test_weight_sync_shared_buffer",
}
CTL_UNIT = "tests/[ctl modules]"
# The first worker takes test_paused_controller (a controller paused on purpose for 40 s of ~48), the second the ctl
# unit, the first then test_faults_issue31 (processes stopped, hung or waited on: mostly asleep, ~50 s).
FIRST_UNITS = ("test_paused_controller", CTL_UNIT, "test_faults_issue31")  # modules by name, and the ctl unit
TAIL_MODULES = {  # in-process, each a few seconds on the 2-core machine (full lane, --durations)
    "test_arithmetic_task", "test_cli_exit", "test_devices", "test_doc_flags", "test_env_rows", "test_envs_builtin",
    "test_evaluation", "test_gpu_layout", "test_images", "test_losses", "test_model_hf", "test_observability",
    "test_optim", "test_optim_bf16", "test_progress", "test_prompt_data", "test_rewards", "test_run_safety",
    "test_sft_data", "test_shapes_task", "test_task_setup", "test_titan_import", "test_torchstore_shm",
    "test_trainer_levers", "test_transformers_engine_vision", "test_types", "test_vision_trainer", "test_vlm_models",
    "test_vllm_engine_vision",
}  # fmt: skip


def _unit_of(nodeid: str) -> str:
    """The work unit (what one worker runs whole) of a test: its module, or CTL_UNIT for the modules using `ctl`."""
    path = nodeid.split("::", 1)[0]
    return CTL_UNIT if os.path.basename(path).removesuffix(".py") in CTL_MODULES else path


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: pytest without xdist (-p no:xdist, the GPU machine)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` with the CTL_MODULES as one unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SuiteScheduling(LoadFileScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return _unit_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # the first assignment: xdist's queue is complete, in its order
                self.ordered = True

                def rank(unit: str) -> tuple[int, int]:
                    name = unit if unit == CTL_UNIT else os.path.basename(unit).removesuffix(".py")
                    if name in FIRST_UNITS:
                        return 0, FIRST_UNITS.index(name)
                    return (2 if name in TAIL_MODULES else 1), 0

                for unit in sorted(self.workqueue, key=rank):  # stable: xdist's order within each rank
                    self.workqueue.move_to_end(unit)
            super()._assign_work_unit(node)

        def _reschedule(self, node) -> None:
            """xdist's, but the next module goes out once the node holds its last test (a worker runs a test when it
            knows the next one), not two."""
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            if self._pending_of(self.assigned_work[node]) > 1:
                return
            self._assign_work_unit(node)

    return SuiteScheduling(config, log)


def _key(item: pytest.Item) -> str:
    return f"{item.module.__name__.rpartition('.')[2]}::{getattr(item, 'originalname', item.name)}"


def lane_of(item: pytest.Item) -> str:
    module = item.module.__name__.rpartition(".")[2]
    lane = TEST_LANES.get(_key(item)) or MODULE_LANES.get(module, "unit")
    if lane != "e2e":
        lane = next((FIXTURE_LANES[f] for f in item.fixturenames if f in FIXTURE_LANES), lane)
    return lane


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the markers added here
def pytest_collection_modifyitems(config, items):
    if stale := _stale_lane_names():
        warnings.warn(f"tests/conftest.py gives lanes to tests that do not exist (renamed?): {stale}", stacklevel=1)
    for item in items:
        lane = lane_of(item)
        item.add_marker(lane)
        if lane != "unit" or _key(item) in SLOW_UNIT:
            item.add_marker("slow")
        if any(is_needs_cuda(m) for m in item.iter_markers("skipif")):
            item.add_marker("gpu")
        if "ctl" in item.fixturenames and _unit_of(item.nodeid) != CTL_UNIT:
            warnings.warn(f"{item.nodeid} uses `ctl`: add its module to CTL_MODULES in tests/conftest.py", stacklevel=1)


def _stale_lane_names() -> list[str]:
    """The modules and tests named in the lane and scheduling tables that are not in tests/ (by file, `def name(`)."""
    here, stale = os.path.dirname(os.path.abspath(__file__)), []
    for name in (
        *MODULE_LANES,
        *TEST_LANES,
        *SLOW_UNIT,
        *CTL_MODULES,
        *TAIL_MODULES,
        *(u for u in FIRST_UNITS if u != CTL_UNIT),
    ):
        module, _, test = name.partition("::")
        path = os.path.join(here, f"{module}.py")
        if not os.path.exists(path) or (test and f"def {test}(" not in open(path, encoding="utf-8").read()):
            stale.append(name)
    return stale


class UnmarkedProcessError(RuntimeError):
    """A test of the `unit` lane started a process."""


def _is_python(prog) -> bool:
    words = os.fsdecode(prog).split() if prog else []
    return bool(words) and os.path.basename(words[0]).startswith("python")


@contextlib.contextmanager
def _in_process_only(item: pytest.Item):
    """While a `unit` test sets up and runs, spawning a Monarch process mesh, a python child process or a
    multiprocessing process raises UnmarkedProcessError (and is recorded, in case the test catches the error).
    Other children (a compiler, `git`) are allowed."""
    import multiprocessing.process

    try:
        from monarch.actor import HostMesh
    except ImportError:  # a machine without Monarch (the GPU machine's plain stacks): nothing spawns meshes there
        HostMesh = None
    seen: list[str] = []

    def refuse(what: str):
        seen.append(
            f"{item.nodeid} is in the `unit` lane (in this process only) but started {what}: give it the `actors` "
            "lane (it starts processes) or `e2e` (it runs a whole program) in tests/conftest.py (MODULE_LANES, "
            "TEST_LANES or FIXTURE_LANES; see tests/README.md)"
        )
        raise UnmarkedProcessError(seen[-1])

    def spawn_procs(self, *args, **kwargs):
        refuse("a Monarch process mesh (HostMesh.spawn_procs)")

    def execute_child(self, args, executable, *rest, **kwargs):
        argv0 = args if isinstance(args, (str, bytes, os.PathLike)) else args[0]
        library = any(lib in str(args) for lib in LIBRARY_PYTHON_CHILDREN)
        if _is_python(executable or argv0) and not library:
            refuse(f"a python process ({str(args)[:200]})")
        return real_execute_child(self, args, executable, *rest, **kwargs)

    def start(self):
        refuse(f"a multiprocessing process ({self!r})")

    real_execute_child = subprocess.Popen._execute_child
    with pytest.MonkeyPatch.context() as mp:
        if HostMesh is not None:
            mp.setattr(HostMesh, "spawn_procs", spawn_procs)
        mp.setattr(subprocess.Popen, "_execute_child", execute_child)
        mp.setattr(multiprocessing.process.BaseProcess, "start", start)
        yield seen


def _guarded(item: pytest.Item):
    if item.get_closest_marker("unit") is None:
        return (yield)
    with _in_process_only(item) as seen:
        result = yield
    if seen:  # the test caught the error and went on
        raise UnmarkedProcessError(seen[0])
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):  # a test's fixtures start here, session- and module-scoped ones included
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded(item))


@pytest.fixture(scope="session")
def tokenizer():
    from meshrl.tokenizer import CharTokenizer

    return CharTokenizer("abcdefgh=")


@pytest.fixture(scope="session")
def base_model_dir(tmp_path_factory, tokenizer) -> str:
    from meshrl.models.qwen3 import create_random_checkpoint

    return str(
        create_random_checkpoint(tmp_path_factory.mktemp("base") / "model", flavor="tiny", tokenizer=tokenizer, seed=0)
    )


@pytest.fixture(scope="session")
def ctl(base_model_dir, tokenizer):
    from meshrl.config import GeneratorConfig, ModelConfig, TrainerConfig
    from meshrl.controller.api import Controller

    c = Controller(
        model_dir=base_model_dir,
        model_cfg=ModelConfig(),
        trainer_cfg=TrainerConfig(num_procs=2, micro_batch_size=4),
        generator_cfg=GeneratorConfig(max_model_len=48, max_tokens=8),
        tokenizer=tokenizer,
        reward_weights={"char_match": 1.0},
        call_timeout_s=120,
    )
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-rank gloo group for a `Policy` built in the test process (made before any vLLM engine, which then leaves
    it alone on shutdown)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def random_data(n: int, *, seed: int = 0, vocab: int = 13, prompt_len: int = 3, with_old: bool = True):
    """n Datum of varied lengths with random tokens, advantages and generator logprobs."""
    from meshrl.types import Datum

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        n_resp = 2 + (i * 3) % 6
        toks = torch.randint(4, vocab, (prompt_len + n_resp,), generator=g).tolist()
        old = (-torch.rand(n_resp, generator=g) * 3).tolist() if with_old else None
        adv = float(torch.randn(1, generator=g))
        out.append(Datum.from_completion(toks[:prompt_len], toks[prompt_len:], old, adv))
    return out
