"""Fixtures shared by test modules."""
from __future__ import annotations

import compileall
import datetime
import os
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mp_harness  # noqa: E402
import warm  # noqa: E402
from mp_harness import _free_port  # noqa: E402


ROOT = Path(__file__).resolve().parents[1]


def pytest_sessionstart(session: pytest.Session) -> None:
    """Write the bytecode of pipeflow and the suite's helpers once, then start the warm fork
    server (tests/warm.py), so that its imports overlap the collection.

    Every process the suite starts reads that bytecode instead of compiling the sources again
    (where PYTHONDONTWRITEBYTECODE is set, as on CI, nothing else writes it): about 0.2 s of
    pipeflow's import (-X importtime) in each of the interpreters the launch tests start.
    Under pytest-xdist the controller writes the bytecode and each worker starts its server."""
    worker = hasattr(session.config, "workerinput")
    if not worker:
        for folder in ("pipeflow", "tests", "examples", "benchmarks", "scripts"):
            compileall.compile_dir(str(ROOT / folder), quiet=2)
        compileall.compile_file(str(ROOT / "train.py"), quiet=2)
    if worker or not getattr(session.config.option, "numprocesses", 0):  # not the xdist controller
        warm.start_server()


# The quick selection, ``python -m pytest -q -m "not slow"`` (docs/dev/testing.md): the pure and
# in-process tests, and one multi-process case per area.  Slow: every test that reads a module's
# multi-process world, and these (node-id prefixes under tests/) ...
WORLD_FIXTURES = {"world", "world2", "world4", "world8"}
SLOW = (
    "test_hosts.py", "test_hosts_links.py", "test_hosts_storage.py", "test_hosts_clocks.py::test_two_hosts", "test_multinode.py",
    "test_relaunch.py", "test_runs.py", "test_timeouts.py", "test_watchdog.py",  # real launches, signals, deadlines
    "test_cli.py::test_torchrun", "test_cli.py::test_custom", "test_cli.py::test_a_torchvision",
    "test_cli.py::test_your_module", "test_sweep.py::test_a_2x2", "test_observability_cli.py::test_",
    "test_faults.py::test_a_", "test_faults.py::test_an_", "test_faults.py::test_ranks_launched",
    "test_faults.py::test_check_finite_stops", "test_checkpoint.py::test_a_save_killed",
    "test_experiments.py::test_llama_end_to_end", "test_experiments.py::test_lora_finetune",
    "test_docs.py::test_start_path_one_process", "test_gpu_check.py::test_a_", "test_gpu_check.py::test_vs_plain_loop_compiled",
    "test_gpu_check.py::test_offload_tiny", "test_plan.py::test_plan_cli", "test_plan.py::test_plan_rehearse",
    "test_storage.py", "test_export_names.py::test_from_module_exports",
    # long pure sweeps and searches (over 3 s each)
    "test_schedules_more.py::test_sweep_every_accepted", "test_schedules_more.py::test_interleaved_bubble",
    "test_schedules_more.py::test_interleaved_zb_makespan", "test_schedules_more.py::test_looped_bfs_makespan",
    "test_schedules_more.py::test_zb_h2_memory", "test_schedules_more.py::test_dualpipev_makespan",
    "test_schedules_more.py::test_controllable_memory_bounds", "test_schedules_more.py::test_zbv_attains",
    "test_cluster_plan.py::test_table1", "test_auto_schedule.py::test_never_worse", "test_plan.py::test_planner_top_pick",
)
# ... except these, one multi-process case per area (each world runs only the cases they read)
QUICK = (
    "test_pipeline_equivalence.py::test_pipelined_training_equals_unsplit_model[p2-eq-gpt-1f1b-m4]",
    "test_scale.py::test_mesh_training_equals_unsplit_model[dp2xpp2-1f1b]",
    "test_hf.py::test_pipelined_equals_hugging_face_on_2_processes[llama-1f1b]",
    "test_cli.py::test_torchrun_two_processes_trains_and_loss_falls",
    "test_faults.py::test_a_wrong_shape_mid_run", "test_observability_cli.py::test_cfg_job",
    "test_schedules_more.py::test_sweep_every_accepted_combination_is_valid[1f1b]",
)


# The modules whose process worlds keep both cores busy on their own.  Under pytest-xdist
# (pyproject's ``-n auto --dist loadgroup``) they run one after another on one worker, first,
# while the other worker runs the modules that mostly wait (launchers, deadlines, emulated hosts)
# or use one core (pure tests): two of them at once would only share the cores, and the waiting
# modules would then wait side by side.  Every other module is a group of its own, so a
# module's world is still started once.
BOTH_CORES = (
    "test_scale.py", "test_pipeline_equivalence.py", "test_tensor_parallel.py", "test_compile.py", "test_hf.py",
    "test_schedules_more.py", "test_cli.py",
    "test_hosts_links.py",  # not two cores busy, but timed against a quiet host: never beside a world that fills them
)
FEW_CORES = (os.cpu_count() or 2) <= 3  # with more, a world leaves cores to a second one


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """Workers for ``-n auto``: two on 2 cores (one runs a module's process world while the other's
    module waits on a launcher or runs pure tests on the idle core), up to four on bigger
    machines; none for one module (it runs in this process, as ``-n 0`` runs every selection);
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` or ``-n N`` choose."""
    given = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if given:
        return int(given)
    files = {arg.split("::")[0] for arg in config.args}
    if len(files) == 1 and next(iter(files)).endswith(".py"):
        return 0  # one module runs on one worker anyway: no worker to start
    return max(2, min(4, (os.cpu_count() or 2) // 2))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the slow tests (SLOW, WORLD_FIXTURES), QUICK excepted; put the BOTH_CORES modules
    first and in one xdist group, every other module in a group of its own."""
    for item in items:
        nodeid = item.nodeid.removeprefix("tests/")
        slow = bool(WORLD_FIXTURES & set(getattr(item, "fixturenames", ()))) or nodeid.startswith(SLOW)
        if slow and not nodeid.startswith(QUICK):
            item.add_marker(pytest.mark.slow)
    def module(item: pytest.Item) -> str:
        return item.nodeid.removeprefix("tests/").split("::")[0]

    together = FEW_CORES and BOTH_CORES or ()
    items.sort(key=lambda item: module(item) not in together)
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            item.add_marker(pytest.mark.xdist_group("both_cores" if module(item) in together else module(item)))


def pytest_deselected(items: list[pytest.Item]) -> None:
    """Note the modules the selection cut, so that their worlds run only the cases still read
    (mp_harness.selected_cases)."""
    for item in items:
        module = getattr(item, "module", None)
        if module is not None:
            mp_harness.DESELECTED_MODULES.add(module.__name__)


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank in this process (a Trainer of one stage, a transport to
    itself), destroyed after the test."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()
