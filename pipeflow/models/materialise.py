"""Build a module on the meta device, then materialise it one piece (one layer) at a time.

`skeleton(constructor)` runs a user's constructor under ``torch.device("meta")``: no parameter or
buffer value is computed or held. `skeleton(constructor, buffers=True)` keeps buffers real
instead (every parameter is moved to ``meta`` the moment it is registered, so parameters are made
and dropped one at a time): it is built only when a layer holds a buffer that no
``reset_parameters`` recomputes (a causal mask, rotary tables computed in a user's ``__init__``),
and only that layer's buffers are copied from it. Parameters shared by two modules (tied
embeddings) stay one Parameter in both.

`materialise(piece)` gives a piece of the skeleton real parameters: zeros, then every
submodule's own ``reset_parameters`` (or ``_reset_parameters``, as ``nn.MultiheadAttention``),
then the user's per-layer init hook, all under the seeded RNG the ModelSpec sets for that layer;
or `StateDictFile` copies the piece's own tensors from a state dict file of the unsplit model
(memory-mapped: each rank reads only its own tensors).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import Tensor, nn

from pipeflow.errors import CheckpointError, ConfigError, UnsafeCheckpointError

InitHook = Callable[[str, nn.Module], None]  # (qualified name in the whole model, module)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Inside: every parameter registered on any module is replaced by a meta copy (once)."""
    original = nn.Module.register_parameter

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def skeleton(constructor: Callable[[], nn.Module], buffers: bool = False) -> nn.Module:
    """Run `constructor()` with its parameters (and, unless `buffers`, its buffers) on ``meta``.

    A constructor that cannot run on the meta device (``.item()`` on a tensor it made, say) is
    run with real buffers instead. The global RNG is left as it was.

    Args:
        constructor: builds the whole model, e.g. ``lambda: torchvision.models.resnet50()``.
        buffers: keep buffers real (on the CPU), as the constructor computes them.

    Returns:
        The model, its parameters on ``meta``.

    Raises:
        ConfigError: the constructor returned something that is not an ``nn.Module``.
    """
    with torch.random.fork_rng(devices=[]), _parameters_on_meta():
        if buffers:
            model = constructor()
        else:
            try:
                with torch.device("meta"):
                    model = constructor()
            except Exception:  # data-dependent construction: real buffers, parameters still on meta
                model = constructor()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model constructor {constructor!r} returned {type(model).__name__}, expected an nn.Module")
    return model


def has_reset(module: nn.Module) -> bool:
    """True when `module` recomputes its own tensors (``reset_parameters`` / ``_reset_parameters``)."""
    return callable(getattr(module, "reset_parameters", None)) or callable(getattr(module, "_reset_parameters", None))


def meta_buffers(piece: nn.Module) -> list[tuple[str, bool, bool]]:
    """(name, persistent, owner resets it) of every buffer of `piece` still on the meta device."""
    found = []
    for owner_name, owner in piece.named_modules():
        for leaf, buf in owner._buffers.items():
            if buf is not None and buf.device.type == "meta":
                name = f"{owner_name}.{leaf}" if owner_name else leaf
                found.append((name, leaf not in owner._non_persistent_buffers_set, has_reset(owner)))
    return found


def is_meta(module: nn.Module) -> bool:
    """True when any parameter of `module` lives on the meta device."""
    return any(p.device.type == "meta" for p in module.parameters())


def zero_parameters(module: nn.Module, device: torch.device) -> None:
    """Replace every meta parameter and buffer by zeros on `device` (tied copies stay one)."""
    made: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and param.device.type == "meta":
                if id(param) not in made:
                    zeros = torch.zeros(param.shape, dtype=param.dtype, device=device)
                    made[id(param)] = nn.Parameter(zeros, requires_grad=param.requires_grad)
                sub._parameters[name] = made[id(param)]
        for name, buf in list(sub._buffers.items()):
            if buf is not None and buf.device.type == "meta":
                sub._buffers[name] = torch.zeros(buf.shape, dtype=buf.dtype, device=device)


def reset_all(module: nn.Module) -> None:
    """Call each submodule's own ``reset_parameters`` (or ``_reset_parameters``), in module order."""
    for sub in module.modules():
        reset = getattr(sub, "reset_parameters", None) or getattr(sub, "_reset_parameters", None)
        if callable(reset):
            reset()


def copy_buffers(piece: nn.Module, source: nn.Module, names: list[str]) -> None:
    """Copy the buffers `names` (paths in the whole model) from `source` into `piece`."""
    with torch.no_grad():
        for name in names:
            owner, _, leaf = name.rpartition(".")
            value = source.get_buffer(name)
            target = piece.get_submodule(owner) if owner else piece
            target._buffers[leaf] = value.detach().clone()


def materialise(piece: nn.Module, init: InitHook | None = None, device: torch.device | str = "cpu") -> nn.Module:
    """Give `piece` real parameters on `device`, initialised as its modules initialise themselves.

    Parameters start at zero (so one that no module resets is deterministic), then every
    submodule's ``reset_parameters`` runs, then ``init(name, module)`` for every submodule, `name`
    being its path in the piece, which is its path in the whole model (`pieces.Piece` and traced
    parts keep the model's paths). Call it under a seeded RNG for reproducible weights.

    Args:
        piece: a module whose parameters are on the meta device (buffers may be real).
        init: the per-layer init hook (e.g. GPT-2's scaled init of residual projections).
        device: where the parameters go.

    Returns:
        `piece`, changed in place.
    """
    zero_parameters(piece, torch.device(device))
    with torch.no_grad():
        reset_all(piece)
        if init is not None:
            for name, sub in piece.named_modules():
                init(name, sub)
    return piece


def check_finite(tensor: Tensor, what: str, fix: str = "re-download or re-export it") -> None:
    """Refuse a loaded floating tensor that holds NaN or Inf (one pass over it, at load time).

    Args:
        tensor: the tensor just loaded.
        what: where it came from, e.g. ``"layer 'head': tensor 'lm_head.weight' in <file>"``.
        fix: what to do about the file.

    Raises:
        CheckpointError: naming `what`, the counts, and that training is not the cause.
    """
    if not tensor.is_floating_point() or bool(torch.isfinite(tensor).all()):
        return
    nan = int(torch.isnan(tensor).sum())
    inf = int(torch.isinf(tensor).sum())
    raise CheckpointError(f"{what} holds {nan} NaN and {inf} Inf of its {tensor.numel()} values: the weights "
                          f"file is damaged or was saved from a diverged run; {fix} (nothing has trained yet: "
                          f"not a learning-rate problem)")


class StateDictFile:
    """The unsplit model's weights on disk, read a layer at a time: each rank reads only its own.

    Either a file written by ``torch.save(model.state_dict(), path)`` (memory-mapped: only the
    tensors a layer copies are read) or a directory written by
    ``torch.distributed.checkpoint.save(model.state_dict(), checkpoint_id=path)`` (DCP: each
    layer loads its own keys, without collectives).

    Args:
        path: the file or the DCP directory.
        holds: what its keys must be, for the message naming a key it lacks.
    """

    def __init__(self, path: str, holds: str = "the state dict of the unsplit model") -> None:
        self.path, self.holds = path, holds
        self._tensors: Mapping[str, Tensor] | None = None
        self._shapes: dict[str, list[int]] | None = None  # a DCP checkpoint's keys and shapes

    def _open(self) -> None:
        """Map the file, or read the DCP checkpoint's metadata (once)."""
        if self._tensors is not None or self._shapes is not None:
            return
        try:
            loaded: Any = torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)
        except FileNotFoundError:
            raise ConfigError(f"model.init_from={self.path!r} does not exist; give a file written by "
                              f"torch.save(model.state_dict(), path) or a torch.distributed.checkpoint "
                              f"directory") from None
        except IsADirectoryError:
            self._shapes = self._dcp_shapes()
            return
        except Exception as exc:  # not a zip checkpoint, or pickled objects beyond tensors
            raise ConfigError(f"model.init_from={self.path!r} could not be read as a state dict: {exc}") from exc
        if not isinstance(loaded, Mapping):
            raise ConfigError(f"model.init_from={self.path!r} holds a {type(loaded).__name__}, "
                              f"expected a state dict (torch.save(model.state_dict(), path))")
        self._tensors = loaded

    def _dcp_shapes(self) -> dict[str, list[int]]:
        from pipeflow.models.dcp_metadata import DCP_METADATA, read_dcp_metadata

        try:  # with the allowlist: a planted .metadata runs nothing
            metadata = read_dcp_metadata(os.path.join(self.path, DCP_METADATA))
        except UnsafeCheckpointError:
            raise
        except Exception as exc:
            raise ConfigError(f"model.init_from={self.path!r} is a directory but not a torch.distributed.checkpoint "
                              f"checkpoint: {exc}") from exc
        return {key: list(getattr(meta, "size", [])) for key, meta in metadata.state_dict_metadata.items()}

    def shapes(self) -> dict[str, list[int]]:
        """Every key of the unsplit model's state dict on disk, with its shape."""
        self._open()
        if self._tensors is not None:
            return {key: list(value.shape) for key, value in self._tensors.items()}
        return dict(self._shapes or {})

    def load_into(self, piece: nn.Module, layer: str) -> None:
        """Copy the piece's own tensors (its state dict keys are the model's) from disk.

        Raises:
            ConfigError: a key of the piece is missing on disk, or its shape differs.
        """
        self._open()
        targets = piece.state_dict(keep_vars=True)
        shapes = self.shapes() if self._tensors is None else None
        for key, target in targets.items():
            shape = list(self._tensors[key].shape) if self._tensors is not None and key in self._tensors else (
                shapes.get(key) if shapes is not None else None)
            if shape is None:
                raise ConfigError(f"layer {layer!r}: model.init_from={self.path!r} has no {key!r}; "
                                  f"it must hold {self.holds}")
            if shape != list(target.shape):
                raise ConfigError(f"layer {layer!r}: {key!r} in model.init_from={self.path!r} has shape "
                                  f"{shape}, the model's is {list(target.shape)}")
        with torch.no_grad():
            if self._tensors is not None:
                for key, target in targets.items():
                    target.copy_(self._tensors[key])
            elif targets:
                from torch.distributed.checkpoint import load

                from pipeflow.models.dcp_metadata import SafeReader

                load({key: t.data for key, t in targets.items()}, storage_reader=SafeReader(self.path), no_dist=True)
        for key, target in targets.items():
            check_finite(target, f"layer {layer!r}: {key!r} in model.init_from={self.path!r}",
                         "give another model.init_from or re-export it")


class LayerFile:
    """A layer builder that loads what it built from `file` under ``<layer index>.<key>``: the keys
    of ``nn.ModuleList(spec.build_all()).state_dict()``, which ``python -m pipeflow.checkpoint
    export`` writes for a model without original names (the built-in GPT, MLP, sleep model).
    On the meta device (parameter counting, export) nothing is read."""

    def __init__(self, file: StateDictFile, index: int, name: str, builder: Callable[..., nn.Module]) -> None:
        self.file, self.index, self.name, self.builder = file, index, name, builder

    def __call__(self, *args: Any, **kwargs: Any) -> nn.Module:
        """Build the layer, then copy its tensors from the file (a missing or mis-shaped key, or
        NaN/Inf in one, is an error naming the layer, the key and the file)."""
        layer = self.builder(*args, **kwargs)
        if isinstance(layer, nn.Module) and torch.get_default_device().type != "meta":
            self.file.load_into(nn.ModuleDict({str(self.index): layer}), self.name)
        return layer


def layers_from(layers: list[Any], init_from: str | None) -> list[Any]:
    """`layers` (LayerSpecs) whose builders load ``model.init_from`` (see :class:`LayerFile`);
    unchanged without it."""
    if not init_from:
        return layers
    file = StateDictFile(init_from, "the keys <layer index>.<key> of nn.ModuleList(spec.build_all()).state_dict(), "
                                    "as python -m pipeflow.checkpoint export writes for this model")
    return [dataclasses.replace(spec, builder=LayerFile(file, i, spec.name, spec.builder))
            for i, spec in enumerate(layers)]
