"""``python -m pipeflow.checkpoint export``: a checkpoint back out as the model's own weights.

A checkpoint holds layer i's ``state_dict()`` under ``model.layers.<i>.<key>``, whatever the
layout it was saved from (dp, pp, ``parallel.shard``: DCP merges the shards on read), so export
reads the model entries in one process, with no process group, and writes them under the names
of the model they came from:

- the model is learnt from the run: a checkpoint ``<run_dir>/checkpoints/step_<n>`` has the run's
  ``config.yaml`` two folders up, whose ``model`` section is instantiated with Hydra on the meta
  device (nothing materialised, ``model.init_from`` not read) to get the `ModelSpec`;
- where the spec has ``export_name`` ((global layer index, the layer's own state-dict key) -> the
  original model's name: `from_module` models, ``model=hf``), ``--format pt`` (the default)
  writes one ``torch.save`` file under the original names, every name the original module's
  ``state_dict()`` has (a tied parameter under each of its names, as the module's own state dict
  holds it), so ``module.load_state_dict(torch.load(out))`` takes it as it is; without it (the
  built-in GPT, a run without a readable ``config.yaml``) it writes ``<layer index>.<key>``, which
  loads into ``nn.ModuleList(spec.build_all())``, and says why;
- ``--format hf`` writes a Hugging Face folder: ``config.json`` (the spec's ``save_config``) and
  ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` shards and
  ``model.safetensors.index.json`` beyond ``--max-shard-size``) under the original names, a tied
  parameter once (under its first member's name, as ``save_pretrained`` writes a tied
  ``lm_head.weight``: not at all), so ``AutoModelForCausalLM.from_pretrained(<dir>)`` loads it.

The target must not exist (a :class:`~pipeflow.errors.CheckpointError` naming it); ``--force``
replaces an earlier export (a file, or a folder holding only what an export writes; never a
mount point, which cannot be removed).  The target is written beside itself (``<out>.part``) and
renamed into place; a write that fails (a read-only file system, a busy target, a full disk) is
one ``CheckpointError`` naming the target, the errno and what to do, and leaves no ``.part``.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp

from pipeflow.errors import CheckpointError, ConfigError
from pipeflow.models.dcp_metadata import SafeReader
from pipeflow.models.spec import ModelSpec
from pipeflow.checkpoint import gather as checkpoint_gather, export_lora, integrity, retention
from pipeflow.checkpoint.find import read_meta, resolve, verify
from pipeflow.runtime.world.hosts import rank_ranges

log = logging.getLogger("pipeflow")

FORMATS = ("pt", "hf", "peft")
PREFIX = "model.layers."
DEFAULT_MAX_SHARD = 5 * 1024**3  # bytes; save_pretrained's classic default ("5GB")
SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
HF_FILES = ("config.json", "generation_config.json", SAFETENSORS, INDEX, "adapter_config.json")  # --force replaces
# What an OSError's errno says about an export target, and what to do.
TARGET_HINTS = {
    errno.EROFS: "the file system is read-only: export to a writable path",
    errno.EBUSY: "it is busy (a mount point, or held by another process), so it cannot be replaced: export to "
                 "another path (a folder inside a mount point)",
    errno.EACCES: "permission denied: export to a path this user may write",
    errno.EPERM: "not permitted: export to a path this user may write",
    errno.ENOSPC: "the file system is full: free space there, or export elsewhere",
    errno.EDQUOT: "the disk quota is used up: free space, or export elsewhere",
}


def read_layers(path: str) -> dict[int, dict[str, torch.Tensor]]:
    """Every model entry of checkpoint `path` (verified first), by layer: ``{i: {key: tensor}}``.

    Runs in one process (DCP's ``no_dist``); the ``.metadata`` pickle is read through the
    allowlist, so a planted one runs nothing.

    Raises:
        CheckpointError: a damaged or unreadable checkpoint (naming the file).
    """
    problem = verify(path, collective=False)
    if problem is not None:
        raise CheckpointError(problem)
    reader = SafeReader(path)
    entries = reader.read_metadata().state_dict_metadata
    state = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
             for key, md in entries.items() if key.startswith(PREFIX)}
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        integrity.call_named(lambda: dcp.load(state, storage_reader=reader, no_dist=True),
                             f"exporting checkpoint {path}")
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        index, _, name = key.removeprefix(PREFIX).partition(".")
        layers.setdefault(int(index), {})[name] = value
    return layers


def config_file(path: str) -> str:
    """The run's ``config.yaml`` for checkpoint ``<run_dir>/checkpoints/step_<n>``."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))), "config.yaml")


def model_of(path: str) -> tuple[ModelSpec | None, str]:
    """The `ModelSpec` of the run that wrote checkpoint `path`, built from its ``config.yaml``
    on the meta device; ``(None, why not)`` when there is none or it cannot be built."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    file = config_file(path)
    if not os.path.isfile(file):
        return None, f"{file} does not exist (the checkpoint is not inside its run directory)"
    try:
        model_cfg = OmegaConf.load(file).model
        if "init_from" in model_cfg:
            model_cfg.init_from = None  # the names need no weights
        with torch.device("meta"):
            spec = instantiate(model_cfg)
    except Exception as exc:  # noqa: BLE001 - any failure only costs the names; say which
        return None, f"the model of {file} could not be built here ({type(exc).__name__}: {exc})"
    if not isinstance(spec, ModelSpec):
        return None, f"the model of {file} is a {type(spec).__name__}, not a ModelSpec"
    return spec, ""


def _check_layers(spec: ModelSpec, layers: dict[int, Any], path: str) -> str:
    """Why the checkpoint's layers do not fit `spec` ("" when they do)."""
    if layers and (min(layers) < 0 or max(layers) >= len(spec)):
        return (f"checkpoint {path} holds layers up to {max(layers)} but the run's model {spec.name!r} has "
                f"{len(spec)} layers: its config.yaml is not the config that checkpoint was saved with")
    return ""


def check_complete(path: str, layers: dict[int, Any], spec: ModelSpec | None, why: str = "") -> None:
    """Refuse to export part of a model: a host's part of a ``train.checkpoint_storage=local``
    checkpoint that lacks layers the other hosts' parts hold (gather them first), or a checkpoint
    without some layers of its run's model.  `why`: why `spec` is None (:func:`model_of`'s), for
    the note where nothing can be checked.

    Raises:
        CheckpointError: naming the layers missing, the host and ranks, and what to run.
    """
    meta = read_meta(path)
    expected = _stateful_layers(spec) if spec is not None else None
    missing = sorted(expected - set(layers)) if expected is not None else []
    if not missing:
        if expected is None and meta.get("storage") == "local":
            log.warning("note: %s is one host's part (train.checkpoint_storage=local) and the run's model could not be "
                        "built here (%s): whether it holds every layer is not checked", path, why or "no model")
        return
    lacking = f"layers {rank_ranges(missing)} of the run's model ({len(spec)} layers)"  # type: ignore[arg-type]
    if meta.get("storage") == "local":
        raise CheckpointError(
            f"checkpoint {path} is host {meta.get('host')}'s part of step {meta.get('step')} "
            f"(train.checkpoint_storage=local, global ranks {rank_ranges(meta.get('host_ranks', []))}): it lacks "
            f"{lacking}, which the other hosts' parts hold; merge the parts first: python -m pipeflow.checkpoint "
            f"gather <each host's {os.path.basename(path.rstrip('/'))}> <out>, then export <out>")
    raise CheckpointError(f"checkpoint {path} lacks {lacking}: it is damaged or was not saved by this run; "
                          f"export another checkpoint")


def _stateful_layers(spec: ModelSpec) -> set[int] | None:
    """The indices of `spec`'s layers that hold parameters or buffers (built on the meta device);
    None when they cannot be built here."""
    try:
        with torch.device("meta"):
            return {i for i, layer in enumerate(spec.build_all()) if layer.state_dict()}
    except Exception:  # noqa: BLE001 - no check rather than no export
        return None


def named(layers: dict[int, dict[str, torch.Tensor]], spec: ModelSpec, tied_once: bool) -> dict[str, torch.Tensor]:
    """The entries under the original model's names (``spec.export_name(i, key)``).

    A name two layers give alike (a tied parameter the model holds under one name) is written
    once; with `tied_once` every tie of ``spec.tied`` is written under its first member only.
    An ``export_name`` that returns None drops that entry (state the original model does not have).

    Raises:
        ConfigError: two different tensors map to one name.
    """
    export_name: Callable[[int, str], str | None] = spec.export_name  # type: ignore[attr-defined]
    index = {name: i for i, name in enumerate(spec.layer_names())}
    ties = spec.tied.values() if tied_once else []
    dropped = {(index[layer], key) for members in ties for layer, key in members[1:]}
    out: dict[str, torch.Tensor] = {}
    for i in sorted(layers):
        for key, value in layers[i].items():
            name = None if (i, key) in dropped else export_name(i, key)
            if name is None:
                continue
            if name in out and not torch.equal(out[name], value):
                raise ConfigError(f"model {spec.name!r}: export_name gives {name!r} to two different tensors "
                                  f"(layer {i} {key!r} and an earlier one)")
            out.setdefault(name, value)
    return out


def _check_target(out: str, force: bool, hf: bool) -> None:
    """Refuse an existing target unless `force`; `force` replaces only an earlier export."""
    if not os.path.lexists(out):
        return
    if not force:
        raise CheckpointError(f"export target {out} exists; choose another path, or pass --force to replace it")
    if hf:
        other = sorted(n for n in os.listdir(out) if n not in HF_FILES and not n.endswith(".safetensors")) \
            if os.path.isdir(out) else [os.path.basename(out)]
        if other:
            raise CheckpointError(f"export target {out} holds {other[:5]}, which an export does not write: --force "
                                  f"replaces an earlier export only; choose another folder")
    elif os.path.isdir(out):
        raise CheckpointError(f"export target {out} is a directory; give the .pt file to write")
    if os.path.ismount(out):  # removing it fails with EBUSY, after --force emptied it
        raise CheckpointError(f"export target {out} is a mount point, which --force cannot replace; export into a "
                              f"folder inside it (e.g. {os.path.join(out, 'export')}) or elsewhere")


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def target_error(out: str, exc: OSError) -> CheckpointError:
    """One error naming export target `out`, the errno and its file, and what to do."""
    code = errno.errorcode.get(exc.errno or 0, "")
    where = f" ({exc.filename})" if exc.filename and str(exc.filename) != out else ""
    hint = TARGET_HINTS.get(exc.errno or 0, "export to another path")
    return CheckpointError(f"export target {out} not written: {exc.strerror or exc} [{code}]{where}; {hint}")


@contextlib.contextmanager
def _writing(out: str, part: str) -> Iterator[None]:
    """Writing export target `out` through `part`: an OSError becomes :func:`target_error`, and
    the partial `part` is removed."""
    try:
        yield
    except OSError as exc:
        with contextlib.suppress(OSError):
            _remove(part)
        raise target_error(out, exc) from exc


def write_safetensors(tensors: dict[str, torch.Tensor], folder: str, max_shard_bytes: int) -> list[str]:
    """``model.safetensors``, or shards plus ``model.safetensors.index.json`` (Hugging Face's
    layout) when the tensors exceed `max_shard_bytes`; returns the files written."""
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in tensors.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, value in tensors.items():
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += nbytes
    if len(shards) == 1:
        save_file(tensors, os.path.join(folder, SAFETENSORS), metadata={"format": "pt"})
        return [SAFETENSORS]
    files = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    for file, shard in zip(files, shards):
        save_file(shard, os.path.join(folder, file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in tensors.values())},
             "weight_map": {name: file for file, shard in zip(files, shards) for name in shard}}
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    return [*files, INDEX]


def _export_hf(layers: dict[int, dict[str, torch.Tensor]], spec: ModelSpec | None, why: str, path: str, out: str,
               max_shard_bytes: int) -> int:
    if spec is None:
        raise CheckpointError(f"--format hf needs the model the checkpoint was trained with, and {why}")
    save_config = getattr(spec, "save_config", None)
    if save_config is None or getattr(spec, "export_name", None) is None:
        raise ConfigError(f"model {spec.name!r} (checkpoint {path}) has no Hugging Face form (its ModelSpec sets no "
                          f"save_config/export_name; model=hf does): export it with --format pt")
    mismatch = _check_layers(spec, layers, path)
    if mismatch:
        raise CheckpointError(mismatch)
    tensors = named(layers, spec, tied_once=True)
    as_stored = getattr(spec, "as_stored", None)
    if as_stored is not None:  # as the model's library stores it (a MoE's experts one by one)
        tensors = {name: t.contiguous() for name, t in as_stored(tensors).items()}

    def write(folder: str) -> None:
        save_config(folder)
        write_safetensors(tensors, folder, max_shard_bytes)

    _write_folder(out, write)
    return len(tensors)


def _write_folder(out: str, write: Callable[[str], None]) -> None:
    """``write(folder)`` into ``<out>.part``, renamed to `out` when complete (no ``.part`` left on failure)."""
    part = out.rstrip("/") + ".part"
    with _writing(out, part):
        _remove(part)
        os.makedirs(part)
        try:
            write(part)
        except BaseException:
            shutil.rmtree(part, ignore_errors=True)
            raise
        _remove(out)
        os.rename(part, out)


def export(path: str, out: str, format: str = "pt", force: bool = False,
           max_shard_bytes: int = DEFAULT_MAX_SHARD, merge_lora: bool = False) -> int:
    """Write the model of checkpoint `path` (or the newest under a checkpoints root) to `out`
    (see the module docstring).  Runs in one process, no process group.

    Args:
        path: a ``step_<n>`` checkpoint or a checkpoints root.
        out: the ``.pt`` file (``pt``) or the folder (``hf``) to write.
        format: ``pt`` (one ``torch.save`` file), ``hf`` (``config.json`` + safetensors) or ``peft``
            (a LoRA run's adapter folder: :mod:`pipeflow.checkpoint.export_lora`).
        force: replace an earlier export at `out`.
        max_shard_bytes: ``hf``: the largest safetensors file before sharding.
        merge_lora: ``hf`` (or ``pt``) of a LoRA run: the base its meta names with the adapters merged in.

    Returns:
        The number of tensors written.

    Raises:
        CheckpointError: a damaged checkpoint; `out` exists (without `force`), is a mount point,
            or cannot be written (naming it and the errno); ``hf`` without the run's model.
            ConfigError: ``hf`` for a model without ``save_config``.
    """
    if format not in FORMATS:
        raise ConfigError(f"export format {format!r} is not one of {list(FORMATS)}")
    if format == "peft" and merge_lora:
        raise ConfigError("--merge-lora merges the adapters into the base: use it with --format hf or pt; "
                          "--format peft writes the adapters alone")
    path = resolve(path, path)  # a checkpoint, or the newest under a root
    base = export_lora.base_of(path)  # a LoRA run's checkpoint: its adapters alone, the base named
    if (format == "peft" or merge_lora) and base is None:
        asked = "--format peft" if format == "peft" else "--merge-lora"
        raise ConfigError(f"checkpoint {path} was not saved by a LoRA run (its meta.json names no base model): "
                          f"{asked} needs adapters; export the whole model with --format pt or --format hf")
    _check_target(out, force, hf=format != "pt")
    layers = read_layers(path)
    spec, why = model_of(path)
    if base is None:
        check_complete(path, layers, spec, why)
    else:
        if format == "peft":
            write, count = export_lora.adapter_folder(path, layers, spec, why)
            _write_folder(out, write)
            return count
        if not merge_lora:
            raise ConfigError(f"checkpoint {path} holds LoRA adapters only (its base is named, not copied): export "
                              f"them with --format peft, or the merged model with --format hf --merge-lora")
        layers, spec = export_lora.merged_layers(path, layers, spec, why, config_file(path))
    if format == "hf":
        return _export_hf(layers, spec, why, path, out, max_shard_bytes)
    if spec is not None and getattr(spec, "export_name", None) is None:
        why = f"model {spec.name!r} maps no layer key to an original name (its ModelSpec sets no export_name)"
    elif spec is not None:
        why = _check_layers(spec, layers, path)
    if spec is not None and not why:
        model = named(layers, spec, tied_once=False)
    else:
        log.warning("note: writing <layer index>.<key> names (they load into nn.ModuleList(spec.build_all())): %s", why)
        model = {f"{i}.{key}": value for i in sorted(layers) for key, value in layers[i].items()}
    with _writing(out, out + ".part"):
        with open(out + ".part", "wb") as f:  # opened here: torch.save's own open says no errno
            torch.save(model, f)
        os.replace(out + ".part", out)
    return len(model)


def _size(text: str) -> int:
    """``5GB``, ``500MB``, ``64KB`` or a number of bytes."""
    units = {"GB": 1024**3, "MB": 1024**2, "KB": 1024, "B": 1}
    upper = text.strip().upper()
    for unit, factor in units.items():
        if upper.endswith(unit) and upper[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(upper[: -len(unit)]) * factor)
    if upper.isdigit():
        return int(upper)
    raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 5GB, 500MB, 1048576)")


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeflow.checkpoint export [--format pt|hf] [--force] <checkpoint> <out>``;
    returns the exit status (``--help`` prints the usage and exits 0)."""
    parser = argparse.ArgumentParser(
        prog="python -m pipeflow.checkpoint", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Work with the checkpoints train.py writes (train.save_every) under <run_dir>/checkpoints.",
        epilog="examples:\n"
               "  python -m pipeflow.checkpoint export outputs/<time>/checkpoints model.pt\n"
               "  python -m pipeflow.checkpoint export --format hf outputs/<time>/checkpoints exported/\n"
               "  python -m pipeflow.checkpoint gather node0/step_00000020 node1/step_00000020 merged/step_00000020\n"
               "  python -m pipeflow.checkpoint pin outputs/<time>/checkpoints/step_00000020",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser(
        "export", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="the whole model from any dp/pp/shard layout, under the model's own names",
        description="Write the model of a checkpoint, merged from whatever layout saved it.\n\n"
                    "--format pt (default): one torch.save state dict. For from_module and model=hf runs its keys\n"
                    "  are the original module's state_dict names (module.load_state_dict(torch.load(out)));\n"
                    "  otherwise, or without the run's config.yaml, <layer index>.<key> (loads into\n"
                    "  nn.ModuleList(spec.build_all())), with a note saying why.\n"
                    "--format hf: a folder with config.json and model.safetensors (sharded with\n"
                    "  model.safetensors.index.json beyond --max-shard-size) under the model's own parameter\n"
                    "  names, tied weights once: AutoModelForCausalLM.from_pretrained(out) loads it. Needs a\n"
                    "  model with a Hugging Face form (model=hf).\n"
                    "A model.lora run's checkpoints hold its adapters only (the base is named in meta.json):\n"
                    "  --format peft writes the adapter folder peft.PeftModel.from_pretrained(base, out) loads;\n"
                    "  --format hf --merge-lora reads the base and writes it with the adapters merged in.\n\n"
                    "The model is read from the run's config.yaml (<run_dir>/checkpoints/step_<n>/../../).\n"
                    "An existing target is an error; --force replaces an earlier export.")
    exp.add_argument("checkpoint", help="a step_<n> directory or a checkpoints root (its newest)")
    exp.add_argument("out", help="the .pt file (--format pt) or the folder (--format hf) to write")
    exp.add_argument("--format", choices=FORMATS, default="pt", help="pt: one torch.save file (default); "
                     "hf: config.json + safetensors for from_pretrained; peft: a LoRA run's adapter folder for "
                     "peft.PeftModel.from_pretrained")
    exp.add_argument("--merge-lora", action="store_true", help="--format hf (or pt) of a LoRA run: the base its "
                     "checkpoint names, the adapters merged in")
    exp.add_argument("--force", action="store_true", help="replace an earlier export at <out>")
    exp.add_argument("--max-shard-size", type=_size, default=DEFAULT_MAX_SHARD, metavar="SIZE",
                     help="--format hf: the largest safetensors file before sharding (default 5GB)")
    checkpoint_gather.add_parser(sub)
    pin = sub.add_parser("pin", help="keep a checkpoint whatever train.keep_last says",
                         description="Pin a checkpoint (a PINNED file in its folder): train.keep_last never removes "
                                     "it; --unpin lets it go again.")
    pin.add_argument("checkpoint", help="a step_<n> directory")
    pin.add_argument("--unpin", action="store_true", help="remove the pin")
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers and not log.handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.command == "gather":
        return _gather(args.parts, args.out)
    if args.command == "pin":
        try:
            retention.pin(args.checkpoint, pinned=not args.unpin)
        except ConfigError as exc:
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        print(f"{'unpinned' if args.unpin else 'pinned'} {args.checkpoint}")
        return 0
    try:
        count = export(args.checkpoint, args.out, format=args.format, force=args.force,
                       max_shard_bytes=args.max_shard_size, merge_lora=args.merge_lora)
    except (CheckpointError, ConfigError) as exc:  # the message names the file and what to do
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # one not met while writing the target (that one is named above)
        print(f"error: {type(exc).__name__}: {exc}; check that path, or export elsewhere", file=sys.stderr)
        return 1
    print(f"wrote {count} tensors to {args.out}")
    return 0


def _gather(parts: list[str], out: str) -> int:
    """``gather``: the exit status (errors printed as one line naming the part and the fix)."""
    try:
        checkpoint_gather.gather(parts, out)
    except (CheckpointError, ConfigError, OSError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"gathered {len(parts)} parts into {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
