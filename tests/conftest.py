"""Fixtures shared by test modules."""
from __future__ import annotations

import compileall
import datetime
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
    pipeflow's import (-X importtime) in each of the interpreters the launch tests start."""
    for folder in ("pipeflow", "tests", "examples", "benchmarks", "scripts"):
        compileall.compile_dir(str(ROOT / folder), quiet=2)
    compileall.compile_file(str(ROOT / "train.py"), quiet=2)
    warm.start_server()


# The quick selection, ``python -m pytest -q -m "not slow"`` (docs/dev/testing.md): the pure and
# in-process tests, and one multi-process case per area.  Slow: every test that reads a module's
# multi-process world, and these (node-id prefixes under tests/) ...
WORLD_FIXTURES = {"world", "world2", "world4", "world8"}
SLOW = (
    "test_hosts.py", "test_hosts_storage.py", "test_hosts_clocks.py::test_two_hosts", "test_multinode.py",
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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the slow tests (SLOW, WORLD_FIXTURES), QUICK excepted."""
    for item in items:
        nodeid = item.nodeid.removeprefix("tests/")
        slow = bool(WORLD_FIXTURES & set(getattr(item, "fixturenames", ()))) or nodeid.startswith(SLOW)
        if slow and not nodeid.startswith(QUICK):
            item.add_marker(pytest.mark.slow)


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
