"""pipeflow: pipeline-parallel training for PyTorch.

The package shows its parts (arrows point down only; errors.py is the base every part uses):

    commands/       python -m pipeflow.plan, .launch, .generate and train.py -m sweeps: entry points
    run/            the one builder, the training loop, the guards around a run (train.py enters here)
    checkpoint/     save and load under any layout, find, store, gather, export (python -m pipeflow.checkpoint)
    config/         the schemas every run and command starts from, their checks, old key names
    observability/  per-stage figures, trackers, traces, stragglers, console
    planning/       profiling, partition and balance, the planner and its cost models (costs/)
    runtime/        the transport, the stage, the interpreter of a lowered program, the
                    parallelisms inside a stage and their mesh (parallel/)
    schedules/      the IR, pure generators, lowering, the simulator, pictures (no torch.distributed)
    models/         model specs as lazy layer lists, built-in models (they never know they are pipelined)
    data/           batches made locally or read from disk, identical on every rank

What each part may import: docs/explanation/architecture.md (tests/test_layering.py holds it).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

# Modules that moved when the parts were drawn (December 2026): the old import path still works,
# warns, and goes in the release after.
MOVED = {
    "pipeflow.run.config": "pipeflow.config.schema",
    "pipeflow.run.config_checks": "pipeflow.config.checks",
    "pipeflow.run.config_choices": "pipeflow.config.choices",
    "pipeflow.run.config_data": "pipeflow.config.data",
    "pipeflow.run.config_keys": "pipeflow.config.keys",
    "pipeflow.run.config_models": "pipeflow.config.models",
    "pipeflow.run.config_renames": "pipeflow.config.renames",
    "pipeflow.run.config_values": "pipeflow.config.values",
    "pipeflow.run.saved_config": "pipeflow.config.saved",
    "pipeflow.run.checkpoint": "pipeflow.checkpoint.saving",
    "pipeflow.run.checkpoint_async": "pipeflow.checkpoint.background",
    "pipeflow.run.checkpoint_find": "pipeflow.checkpoint.find",
    "pipeflow.run.checkpoint_gather": "pipeflow.checkpoint.gather",
    "pipeflow.run.checkpoint_load": "pipeflow.checkpoint.loading",
    "pipeflow.run.checkpoint_replicas": "pipeflow.checkpoint.replicas",
    "pipeflow.run.checkpoint_state": "pipeflow.checkpoint.names",
    "pipeflow.run.storage": "pipeflow.checkpoint.storage",
    "pipeflow.run.integrity": "pipeflow.checkpoint.integrity",
    "pipeflow.run.retention": "pipeflow.checkpoint.retention",
    "pipeflow.run.export": "pipeflow.checkpoint.exporting",
    "pipeflow.run.export_lora": "pipeflow.checkpoint.export_lora",
    "pipeflow.run.lora_base": "pipeflow.checkpoint.lora_base",
    "pipeflow.run.train_state": "pipeflow.checkpoint.train_state",
    "pipeflow.run.lock": "pipeflow.checkpoint.lock",
    "pipeflow.run.launch": "pipeflow.commands.launch",
    "pipeflow.run.launch_wait": "pipeflow.commands.launch_wait",
    "pipeflow.run.sweep": "pipeflow.commands.sweep",
    "pipeflow.run.generate": "pipeflow.commands.generate",
    "pipeflow.run.generate_weights": "pipeflow.commands.generate_weights",
    "pipeflow.run.plan": "pipeflow.commands.plan.command",
    "pipeflow.run.plan_cp": "pipeflow.commands.plan.cp",
    "pipeflow.run.plan_ep": "pipeflow.commands.plan.ep",
    "pipeflow.run.plan_help": "pipeflow.commands.plan.help",
    "pipeflow.run.plan_profile": "pipeflow.run.layer_profiles",
    "pipeflow.run.plan_rehearsal": "pipeflow.commands.plan.rehearsal",
    "pipeflow.run.plan_tp": "pipeflow.commands.plan.tp",
    "pipeflow.run.cluster_plan": "pipeflow.commands.plan.cluster",
    "pipeflow.runtime.tensor_parallel": "pipeflow.runtime.parallel.tensor_parallel",
    "pipeflow.runtime.tensor_parallel_lora": "pipeflow.runtime.parallel.tensor_parallel_lora",
    "pipeflow.runtime.expert_parallel": "pipeflow.runtime.parallel.expert_parallel",
    "pipeflow.runtime.routing": "pipeflow.runtime.parallel.routing",
    "pipeflow.runtime.fsdp": "pipeflow.runtime.parallel.fsdp",
    "pipeflow.runtime.zero": "pipeflow.runtime.parallel.zero",
    "pipeflow.runtime.ring_attention": "pipeflow.runtime.parallel.ring_attention",
    "pipeflow.runtime.mesh": "pipeflow.runtime.parallel.mesh",
    "pipeflow.runtime.mesh_order": "pipeflow.runtime.parallel.mesh_order",
    "pipeflow.runtime.distributed": "pipeflow.runtime.world.distributed",
    "pipeflow.runtime.join": "pipeflow.runtime.world.join",
    "pipeflow.runtime.hosts": "pipeflow.runtime.world.hosts",
    "pipeflow.runtime.clocks": "pipeflow.runtime.world.clocks",
    "pipeflow.runtime.timeouts": "pipeflow.runtime.world.timeouts",
    "pipeflow.planning.comm_cost": "pipeflow.planning.costs.comm",
    "pipeflow.planning.context_cost": "pipeflow.planning.costs.context",
    "pipeflow.planning.expert_cost": "pipeflow.planning.costs.expert",
    "pipeflow.planning.tensor_cost": "pipeflow.planning.costs.tensor",
    "pipeflow.planning.tp_traffic": "pipeflow.planning.costs.tp_traffic",
    "pipeflow.planning.roofline": "pipeflow.planning.costs.roofline",
    "pipeflow.planning.layer_timing": "pipeflow.planning.costs.layer_timing",
    "pipeflow.planning.runtime_timing": "pipeflow.planning.costs.runtime_timing",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of a :data:`MOVED` path: the module at its new path (the same object, so a patch
    through either name is seen by both), with a DeprecationWarning naming the new path."""

    def __init__(self) -> None:
        self._specs: dict[str, Any] = {}

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec: Any) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {MOVED[spec.name]}; import it from there (the old path goes in the "
                      f"next release)", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(MOVED[spec.name])
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._specs.pop(module.__spec__.name)  # the import system gave it the alias's spec


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
