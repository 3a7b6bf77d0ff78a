"""A ``model=hf`` folder, checked before anything is built: ``model.path``, its config.json and
the headers of its safetensors files; each loaded tensor checked to be finite.

:func:`load_config` and :meth:`SafetensorsWeights.check` run inside ``build_hf``, so on every rank
and before any collective: a damaged folder is one named line on every rank, within seconds.
They read only config.json and the files' headers (names, shapes, offsets), never the tensors.
"""
from __future__ import annotations

import contextlib
import functools
import glob
import json
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from pipeflow.errors import CheckpointError, ConfigError
from pipeflow.models.hf_convert import Fused
from pipeflow.models.hf_forms import TESTED, causal_lm_classes
from pipeflow.models.materialise import check_finite

TESTED_TRANSFORMERS = ("5.25",)  # major.minor versions the exactness tests ran on
CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
FIX = "re-download or re-export it"
FOLDER_FIX = "re-download or re-export the model folder"
SHOWN = 3  # tensors listed by name in one message


def check_path(path: str | None) -> str:
    """``model.path`` as a folder that holds config.json; returns the config.json path.

    Raises:
        ConfigError: no path, a path that does not exist, a file, or a folder without config.json.
    """
    if not path:
        raise ConfigError("model=hf needs model.path=<a local folder with config.json [and *.safetensors]>")
    if not os.path.exists(path):
        raise ConfigError(f"model.path={path!r} does not exist; give a local Hugging Face model folder "
                          f"(config.json [and *.safetensors])")
    if not os.path.isdir(path):
        raise ConfigError(f"model.path={path!r} is a file, not a folder; give the folder that holds config.json "
                          f"[and *.safetensors] (model.path={os.path.dirname(os.path.abspath(path))!r}?)")
    config = os.path.join(path, CONFIG)
    if not os.path.isfile(config):
        raise ConfigError(f"model.path={path!r} has no config.json; give a local Hugging Face model folder")
    return config


def read_config_json(file: str) -> dict[str, Any]:
    """config.json's keys.

    Raises:
        ConfigError: the file is not JSON, or holds something else than an object.
    """
    try:
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ConfigError(f"{file} is not JSON ({type(exc).__name__}: {exc}); model=hf reads the model's config "
                          f"from it: {FOLDER_FIX}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{file} holds a JSON {type(raw).__name__}, not an object of config keys "
                          f"({{\"model_type\": ..., ...}}); {FOLDER_FIX}")
    return raw


def check_architecture(raw: dict[str, Any], file: str) -> str:
    """The model_type config.json names, agreeing with its ``architectures``: a tested family's or
    one transformers has a ``*ForCausalLM`` for (whose forwards :func:`~pipeflow.models.hf_forms.
    family` then checks).

    Raises:
        ConfigError: model_type and architectures contradict each other (both named), or
            transformers has no ``*ForCausalLM`` of that model_type.
    """
    model_type = raw.get("model_type")
    architectures = raw.get("architectures") or []
    if not isinstance(architectures, list):
        architectures = [architectures]
    classes = {**causal_lm_classes(), **{kind: cls for kind, (_, cls) in TESTED.items()}}
    wanted = classes.get(model_type)
    if wanted is not None and all(a == wanted for a in architectures):
        return model_type
    types_of = {cls: kind for kind, cls in classes.items()}
    claimed = [a for a in architectures if a in types_of and a != wanted]
    if claimed and wanted is not None:
        raise ConfigError(f"{file} contradicts itself: model_type {model_type!r} but architectures {architectures} "
                          f"({claimed[0]} is model_type {types_of[claimed[0]]!r}); correct whichever is wrong, "
                          f"or {FOLDER_FIX}")
    named = ", ".join(map(str, architectures)) or "no architectures"
    raise ConfigError(f"model=hf does not support {named} (model_type {model_type!r}, {file}): transformers has no "
                      f"*ForCausalLM of that model_type; model=hf trains text decoders (docs/reference/hf-families.md)")


def load_config(path: str | None) -> Any:
    """The Hugging Face config in `path` (a folder with config.json), checked to be supported.

    Raises:
        ConfigError: a path that is no such folder, a config.json that is not a JSON object, whose
            model_type and architectures disagree, of an unsupported architecture, or that
            transformers refuses.
    """
    file = check_path(path)
    model_type = check_architecture(read_config_json(file), file)
    import transformers
    from transformers import AutoConfig

    version = ".".join(transformers.__version__.split(".")[:2])
    if version not in TESTED_TRANSFORMERS:
        warnings.warn(f"transformers {transformers.__version__} is untested with pipeflow's model=hf "
                      f"(tested: {', '.join(TESTED_TRANSFORMERS)}); check the results", stacklevel=3)
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # a value the config class refuses
        raise ConfigError(f"{file}: transformers cannot read it as a {model_type} config "
                          f"({type(exc).__name__}: {exc}); fix that key or {FOLDER_FIX}") from exc


def damage(file: str) -> str:
    """What is wrong with a safetensors file whose header safetensors refused (read from its
    first bytes: the 8-byte header length, the JSON header, the data offsets it lists)."""
    size = os.path.getsize(file)
    if size < 8:
        return f"it holds {size} bytes, less than the 8-byte header length: truncated or empty"
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if 8 + length > size:
            return (f"its header length ({length} bytes) runs past the end of the file ({size} bytes): truncated, "
                    f"or not a safetensors file")
        try:
            header = json.loads(f.read(length))
            end = 8 + length + max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                                   default=0)
        except Exception:  # noqa: BLE001 - any malformed header is described alike
            return "its header is not valid safetensors JSON: the header is damaged"
    if end > size:
        return (f"its header describes {end} bytes but the file holds {size}: truncated (an interrupted download "
                f"or copy)")
    if end < size:
        return f"it holds {size - end} bytes beyond the {end} its header describes: damaged"
    return "its header is damaged"


class SafetensorsWeights:
    """The safetensors files of a folder: their headers checked against the model on every rank,
    then read one tensor at a time (each rank only its own).

    Args:
        folder: holds ``*.safetensors`` (and optionally ``model.safetensors.index.json``).
        sources: the model tensors the checkpoint's names make (:func:`~pipeflow.models.hf_convert.
            checkpoint_sources`: transformers' conversion mapping); None: each name is the model's.
    """

    def __init__(self, folder: str, sources: Callable[[list[str]], dict[str, str | Fused]] | None = None) -> None:
        self.folder = folder
        self.files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        self._where: dict[str, str] | None = None
        self._shapes: dict[str, list[int]] = {}
        self._make_sources = sources
        self._sources: dict[str, str | Fused] = {}

    def _indexed_files(self) -> dict[str, str]:
        """Tensor name -> file, from ``model.safetensors.index.json``.

        Raises:
            CheckpointError: the index is not JSON, has no weight_map, or names a missing file.
        """
        index = os.path.join(self.folder, INDEX)
        try:
            with open(index, encoding="utf-8") as f:
                mapping = json.load(f)["weight_map"]
            where = {k: os.path.join(self.folder, v) for k, v in mapping.items()}
        except Exception as exc:  # noqa: BLE001 - not JSON, no weight_map, not a mapping of names
            raise CheckpointError(f"{index} is not a safetensors index ({type(exc).__name__}: {exc}); "
                                  f"{FIX}") from exc
        absent = sorted({file for file in where.values() if not os.path.isfile(file)})
        if absent:
            raise CheckpointError(f"{index} names {absent[0]}, which is missing (an incomplete download?); "
                                  f"{FOLDER_FIX}")
        return where

    def _read_header(self, file: str) -> dict[str, list[int]]:
        """The names and shapes file `file` holds (its header only).

        Raises:
            CheckpointError: safetensors cannot read the header (truncated, damaged).
        """
        from safetensors import safe_open

        try:
            with safe_open(file, framework="pt") as f:
                return {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
        except Exception as exc:  # noqa: BLE001 - SafetensorError, or an OSError reading it
            raise CheckpointError(f"{file} is not a readable safetensors file: {damage(file)}; {FIX} "
                                  f"(safetensors: {exc})") from exc

    def where(self) -> dict[str, str]:
        """Tensor name -> the file that holds it (from the index, else each file's header); every
        header read once."""
        if self._where is None:
            indexed = os.path.exists(os.path.join(self.folder, INDEX))
            where = self._indexed_files() if indexed else {}
            for file in sorted(set(where.values())) if indexed else self.files:
                shapes = self._read_header(file)
                self._shapes.update(shapes)
                if not indexed:
                    where.update({name: file for name in shapes})
            self._where = where
            names = list(where)
            self._sources = self._make_sources(names) if self._make_sources else {name: name for name in names}
        return self._where

    def _source(self, key: str, aliases: dict[str, str]) -> str | Fused | None:
        """What makes model tensor `key` (its alias's, for a tied head), None where nothing does."""
        self.where()
        found = self._sources.get(key)
        return found if found is not None else self._sources.get(aliases.get(key, key))

    def _shape(self, source: str | Fused) -> list[int] | None:
        if isinstance(source, Fused):
            return source.shape(self._shapes) if all(n in self._shapes for n in source.names()) else None
        return self._shapes.get(source)

    def check(self, expected: dict[str, list[int]], aliases: dict[str, str]) -> None:
        """Every tensor of the model (name -> shape, e.g. the meta skeleton's state dict) is in a
        file with that shape (headers only: cheap, run on every rank before anything is built).

        Raises:
            CheckpointError: a file cannot be read.
            ConfigError: a tensor is in no file, or in one with another shape.
        """
        where = self.where()
        missing, wrong = [], []
        for key, shape in expected.items():
            source = self._source(key, aliases)
            have = self._shape(source) if source is not None else None
            if have is None:
                missing.append(key)
            elif have != shape:
                named = f"{source!r} in {where[source]}" if isinstance(source, str) else (
                    f"{key!r} fused from {len(source.names())} tensors ({source.names()[0]!r}, ...)")
                wrong.append(f"{named} has shape {have}, the model's is {shape}")
        if missing:
            more = len(missing) - SHOWN
            listed = ", ".join(map(repr, missing[:SHOWN])) + (f" and {more} more" if more > 0 else "")
            raise ConfigError(f"{len(missing)} tensor(s) of the model {self.folder}/{CONFIG} describes are in none "
                              f"of the safetensors files in {self.folder!r} "
                              f"({[os.path.basename(f) for f in self.files]}): {listed}; the weights are not this "
                              f"config's model: {FOLDER_FIX}")
        if wrong:
            raise ConfigError(f"tensor {wrong[0]}" + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else "")
                              + f": the weights do not match {self.folder}/{CONFIG}; {FOLDER_FIX}")

    def load_into(self, piece: nn.Module, layer: str, aliases: dict[str, str],
                  rows: dict[str, tuple[int, int]] | None = None) -> None:
        """Copy the piece's tensors (its keys are the model's names) from the files; a key in `rows`
        holds rows ``lo .. hi`` of the stored tensor (an ep rank's experts): only those are read.

        Raises:
            ConfigError: a tensor is in no file, or its shape differs from the model's.
            CheckpointError: a tensor holds NaN or Inf.
        """
        from safetensors import safe_open

        where = self.where()
        by_file: dict[str, list[tuple[str, Tensor]]] = {}  # each file opened once for the piece's tensors
        fused: list[tuple[str, Fused, Tensor]] = []
        for key, target in piece.state_dict(keep_vars=True).items():
            source = self._source(key, aliases)
            if source is None:
                raise ConfigError(f"layer {layer!r}: tensor {key!r} is in none of the safetensors files in "
                                  f"{self.folder!r} ({[os.path.basename(f) for f in self.files]})")
            if isinstance(source, Fused):
                fused.append((key, source, target))
            else:
                by_file.setdefault(where[source], []).append((source, target, (rows or {}).get(key)))
        for file, tensors in by_file.items():
            with safe_open(file, framework="pt") as f:
                for name, target, part in tensors:
                    read = ((lambda n=name: f.get_tensor(n)) if part is None
                            else (lambda n=name, p=part: f.get_slice(n)[p[0]:p[1]]))
                    self._copy(layer, f"{name!r} in {file}", read, target)
        with contextlib.ExitStack() as opened:
            handles: dict[str, Any] = {}

            def read(name: str) -> Tensor:
                file = where[name]
                if file not in handles:
                    handles[file] = opened.enter_context(safe_open(file, framework="pt"))
                return handles[file].get_tensor(name)

            for key, source, target in fused:  # only this layer's experts are read (only this rank's, in `rows`)
                self._copy(layer, f"{key!r} (fused from {source.names()[0]!r} ...)",
                           functools.partial(source.assemble, read, (rows or {}).get(key)), target)

    @staticmethod
    def _copy(layer: str, what: str, read: Callable[[], Tensor], target: Tensor) -> None:
        """Copy ``read()`` into `target`, its shape and finiteness checked."""
        value = read()
        if list(value.shape) != list(target.shape):
            raise ConfigError(f"layer {layer!r}: tensor {what} has shape {list(value.shape)}, the model's is "
                              f"{list(target.shape)}")
        with torch.no_grad():
            target.copy_(value)
        check_finite(target, f"layer {layer!r}: tensor {what}")
