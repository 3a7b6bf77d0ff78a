"""Checkpoints that survive a change of pipeline and data-parallel degree, written atomically.

Model and optimizer state are saved with ``torch.distributed.checkpoint`` (DCP) under global,
layer-indexed names that do not depend on the layout: ``model.layers.<i>.<name>`` for layer i's
``state_dict()`` entries and ``optim.layers.<i>.<param>.<field>`` for its AdamW state.  Each
rank writes the layers it holds (DCP keeps one copy of what dp replicas or tied copies hold
twice) and loads the layers it holds now, whatever the layout was, so a pp=4 run resumes with
pp=2 or pp=1 and another dp.  Beside them: ``meta.json`` (step, loss scale, layout) and each
rank's RNG states.  The data position is the step: batch k is a pure function of k.

Atomicity: every rank writes into ``step_<n>.tmp``; after a barrier rank 0 writes ``meta.json``
last and renames the directory to ``step_<n>``, then points ``latest`` at it.  A complete
checkpoint is a ``step_<n>`` directory (it always holds ``meta.json``); a crash mid-save leaves
only a ``.tmp`` directory, which loading ignores and the next save removes.  Needs a file
system that every rank sees (a shared one across nodes).

Export to one file that loads into the plain unsplit model::

    python -m pipeflow.checkpoint export <checkpoint dir or checkpoints root> model.pt
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from pipeflow.errors import ConfigError

META = "meta.json"
LATEST = "latest"
ADAM_FIELDS = ("step", "exp_avg", "exp_avg_sq")


def param_names(layers: dict[int, nn.Module]) -> dict[int, list[str]]:
    """Every global name (``layers.<i>.<name>``) of each parameter, keyed by the parameter's id."""
    names: dict[int, list[str]] = {}
    for i, layer in sorted(layers.items()):
        for name, p in layer.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(f"layers.{i}.{name}")
    return names


def model_state(layers: dict[int, nn.Module]) -> dict[str, torch.Tensor]:
    """Layer i's ``state_dict()`` under ``model.layers.<i>.<key>`` (tensors share the layers' storage)."""
    return {f"model.layers.{i}.{k}": v for i, layer in layers.items() for k, v in layer.state_dict().items()}


def optimizer_state(optimizer: torch.optim.Optimizer, layers: dict[int, nn.Module], fill: bool) -> dict[str, torch.Tensor]:
    """AdamW state under ``optim.<param name>.<field>``, every name of a parameter when saving.

    With `fill` (loading), missing state is created as zeros to be loaded into, and each
    parameter appears under its first name only.
    """
    names = param_names(layers)
    out: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if fill and not state:
                state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            if not state:
                continue
            if sorted(state) != sorted(ADAM_FIELDS):
                raise ConfigError(f"checkpoints support AdamW state {ADAM_FIELDS}; found {sorted(state)}")
            for name in names[id(p)][:1] if fill else names[id(p)]:
                out.update({f"optim.{name}.{field}": state[field] for field in ADAM_FIELDS})
    return out


def _rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save(
    root: str, step: int, layers: dict[int, nn.Module], optimizer: torch.optim.Optimizer, meta: dict[str, Any]
) -> str:
    """Write checkpoint ``<root>/step_<step>`` atomically (collective: every rank calls it).

    Args:
        root: the checkpoints directory (shared by all ranks).
        step: steps done; training resumes at this step.
        layers: this rank's layers by global index.
        optimizer: the AdamW over their parameters.
        meta: JSON-able extras written by rank 0 (layout, loss scale).

    Returns:
        The checkpoint directory.
    """
    rank = dist.get_rank()
    final = os.path.join(root, f"step_{step:08d}")
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):  # leftovers of an interrupted save
            if name.endswith((".tmp", ".old")):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    dist.barrier()
    dcp.save({**model_state(layers), **optimizer_state(optimizer, layers, fill=False)}, checkpoint_id=tmp)
    os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        _commit(root, tmp, final, {**meta, "step": step, "world_size": dist.get_world_size()})
    dist.barrier()
    return final


def _write_atomic(path: str, text: str) -> None:
    with open(path + ".part", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".part", path)


def _commit(root: str, tmp: str, final: str, meta: dict[str, Any]) -> None:
    """Rank 0: meta.json last, then the rename that makes the checkpoint visible."""
    _write_atomic(os.path.join(tmp, META), json.dumps(meta, indent=1))
    if os.path.exists(final):  # saving the same step again: keep the old one until the swap
        os.rename(final, final + ".old")
    os.rename(tmp, final)
    shutil.rmtree(final + ".old", ignore_errors=True)
    _write_atomic(os.path.join(root, LATEST), os.path.basename(final))


def is_checkpoint(path: str) -> bool:
    """True for a complete checkpoint directory."""
    return os.path.isfile(os.path.join(path, META)) and not path.rstrip("/").endswith((".tmp", ".old"))


def find_latest(root: str) -> str | None:
    """The newest complete checkpoint under `root` (``latest`` first, else the highest step)."""
    if not os.path.isdir(root):
        return None
    pointer = os.path.join(root, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            candidate = os.path.join(root, f.read().strip())
        if is_checkpoint(candidate):
            return candidate
    done = sorted(n for n in os.listdir(root) if n.startswith("step_") and is_checkpoint(os.path.join(root, n)))
    return os.path.join(root, done[-1]) if done else None


def resolve(resume: str | None, default_root: str) -> str | None:
    """The checkpoint ``train.resume`` names: None, ``auto`` (newest under `default_root`, or
    None for a fresh start), a checkpoint directory, or a checkpoints root (its newest).

    Raises:
        ConfigError: a path that holds no complete checkpoint.
    """
    if not resume:
        return None
    if resume == "auto":
        return find_latest(default_root)
    if is_checkpoint(resume):
        return resume
    found = find_latest(resume)
    if found is None:
        raise ConfigError(
            f"train.resume={resume!r} holds no complete checkpoint (a step_<n> directory with {META}); "
            f"use a checkpoint directory, its parent, or train.resume=auto"
        )
    return found


def load(path: str, layers: dict[int, nn.Module], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load this rank's layers and their optimizer state from checkpoint `path` (collective);
    restores this rank's RNG states when the checkpoint had the same world size.

    Returns:
        The checkpoint's meta (``step``, layout, loss scale).
    """
    with open(os.path.join(path, META)) as f:
        meta = json.load(f)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    model = model_state(layers)
    _check_model(path, model, saved)
    optim = optimizer_state(optimizer, layers, fill=True)
    if any(key not in saved for key in optim):  # saved before any optimizer step (e.g. all fp16 steps skipped)
        optimizer.state.clear()
        optim = {}
    dcp.load({**model, **optim}, checkpoint_id=path)
    rng = os.path.join(path, "rng", f"rank{dist.get_rank()}.pt")
    if meta.get("world_size") == dist.get_world_size() and os.path.isfile(rng):
        saved = torch.load(rng, weights_only=False)
        torch.set_rng_state(saved["cpu"])
        if "cuda" in saved and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["cuda"])
    return meta


def _check_model(path: str, model: dict[str, torch.Tensor], saved: dict[str, Any]) -> None:
    """Raise on every rank (agreed by one all-gather) if any rank's model entries are missing
    from the checkpoint or have another shape, naming the first such rank and entries."""
    bad = sorted(k for k, v in model.items() if k not in saved or tuple(saved[k].size) != tuple(v.shape))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, bad)
    culprit = next((r for r, keys in enumerate(everyone) if keys), None)
    if culprit is not None:
        keys = everyone[culprit]
        raise ConfigError(
            f"rank {culprit}: checkpoint {path} has no {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''} "
            f"of this shape ({len(keys)} of that rank's model entries missing or reshaped): it was saved from "
            f"another model; resume with the model config it was trained with"
        )


def export(path: str, out: str) -> int:
    """Write the model of checkpoint `path` (or the newest under it) as one ``torch.save`` file
    of ``<layer index>.<key>`` entries: it loads into ``nn.ModuleList(spec.build_all())``.
    Runs in one process, no process group.

    Returns:
        The number of entries written.
    """
    path = resolve(path, path)  # a checkpoint, or the newest under a root
    reader = dcp.FileSystemReader(path)
    entries = reader.read_metadata().state_dict_metadata
    state = {
        key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for key, md in entries.items()
        if key.startswith("model.layers.")
    }
    dcp.load(state, storage_reader=reader, no_dist=True)
    model = {key.removeprefix("model.layers."): value for key, value in state.items()}
    torch.save(model, out + ".part")
    os.replace(out + ".part", out)
    return len(model)


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeflow.checkpoint export <checkpoint> <out.pt>``; returns the exit status
    (``--help`` prints the usage and exits 0)."""
    parser = argparse.ArgumentParser(
        prog="python -m pipeflow.checkpoint", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Work with the checkpoints train.py writes (train.save_every) under <run_dir>/checkpoints.",
        epilog="example: python -m pipeflow.checkpoint export outputs/<time>/checkpoints model.pt",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="one-file state dict for the unsplit model")
    exp.add_argument("checkpoint", help="a step_<n> directory or a checkpoints root (its newest)")
    exp.add_argument("out", help="the .pt file to write")
    args = parser.parse_args(argv)
    count = export(args.checkpoint, args.out)
    print(f"wrote {count} tensors to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
