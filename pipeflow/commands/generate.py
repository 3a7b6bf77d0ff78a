"""``torchrun --nproc-per-node N -m pipeflow.generate [overrides] train.resume=<checkpoint> generate.prompts=<file>``:
text from a trained model, its layers split over the N processes as a pipeline (rank s: stage s).

The run's config is the ``config.yaml`` saved beside the checkpoint (``<run_dir>/config.yaml``
for ``<run_dir>/checkpoints/step_<n>``), so ``train.resume=<checkpoint>`` alone suffices; the
``key=value`` overrides given apply on top of it (a group choice such as ``model=hf`` is the
saved config's already and is ignored).  Without a saved config the overrides are composed as
train.py composes them; without a checkpoint the model's own weights are used (``model=hf``: the
folder's safetensors).  The layers are loaded by index (:func:`pipeflow.checkpoint.saving.load`),
whatever pipeline trained them; a LoRA run's checkpoint (``model.lora``) holds its adapters only,
loaded over the base ``model.path`` holds (checked against the base the checkpoint names) and
merged into it.

Each line of ``generate.prompts`` is one prompt: ``model=hf``: raw text tokenised by the model's
tokenizer (``tokenizer(line)``; with ``generate.chat=true`` one user turn of its chat template with
the generation prompt); ``model=gpt``: space-separated token ids.  The completions are printed
one per prompt (a single prompt's text is streamed as it is made) and, with ``generate.output``,
written as one JSON line per prompt ``{"prompt": ..., "completion": ...}``.  The loop itself is
:mod:`pipeflow.runtime.decode`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
from typing import Any, Sequence

import torch
import torch.distributed as dist
import yaml
from omegaconf import DictConfig, OmegaConf

from pipeflow.errors import ConfigError, PipeflowError
from pipeflow.config.renames import rename_override_text
from pipeflow.config.saved import upgrade_saved
from pipeflow.runtime.decode import PromptBatch, Sampler, generate, left_padded

log = logging.getLogger("pipeflow")
USAGE = """usage: torchrun --nproc-per-node N -m pipeflow.generate [key=value ...] train.resume=<checkpoint|auto> \\
           generate.prompts=<file> [generate.<key>=value ...]

Generate text from a model trained with pipeflow, its layers split over the N processes.
The run's config.yaml beside the checkpoint is read; key=value overrides apply on top of it.

generate.<key> (default):
  prompts (required)    a text file, one prompt a line (model=gpt: space-separated token ids)
  max_new_tokens (64)   the most tokens made per prompt (also cut at the model's context)
  temperature (0.0)     0: greedy; else sample from softmax(logits / temperature)
  top_p (1.0)           sample within the smallest set of tokens whose probability reaches top_p
  seed (0)              the sampling generator's seed
  batch_size (8)        prompts per micro-batch (left-padded); micro-batches flow through the stages
  in_flight (0)         micro-batches in flight at once (0: all; 1: one after another)
  output (null)         a file of JSON lines {"prompt": ..., "completion": ...}, one per prompt
  chat (false)          wrap each line as one user turn of the tokenizer's chat template
  eos_token_id (null)   an id or list of ids that end a completion (null: the model's)
  tokenizer (null)      a tokenizer folder (null: data.tokenizer, else model.path)

See docs/guides/generate.md."""


@dataclasses.dataclass
class GenerateOptions:
    """``generate.*``: what to generate from and how (see :data:`USAGE`)."""

    prompts: str | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 8
    in_flight: int = 0
    output: str | None = None
    chat: bool = False
    eos_token_id: int | list[int] | None = None
    tokenizer: str | None = None


_PATHS = ("prompts", "output", "tokenizer")  # taken as written (a YAML reading would turn "007" into 7)


def _option_value(name: str, text: str, item: str) -> Any:
    """The value of ``generate.<name>=<text>``, checked against the option's kind.

    Raises:
        ConfigError: a value of another kind, naming the override.
    """
    parsed = yaml.safe_load(text) if text else None
    if name in _PATHS:
        return text if parsed is not None else None
    if name == "eos_token_id":
        ids = parsed if isinstance(parsed, list) else [parsed]
        fits = parsed is None or all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        kind = "token id or a list of them"
    else:
        kind = type(getattr(GenerateOptions(), name)).__name__
        if kind == "float" and isinstance(parsed, str):  # YAML reads 1e-30 (no dot) as text
            with contextlib.suppress(ValueError):
                parsed = float(parsed)
        fits = type(parsed).__name__ == kind or (kind == "float" and type(parsed) is int)
    if not fits:
        raise ConfigError(f"{item!r}: generate.{name} takes a {kind}")
    return float(parsed) if kind == "float" else parsed


def parse_options(overrides: Sequence[str]) -> tuple[GenerateOptions, list[str]]:
    """The ``generate.*`` overrides as options, and the other overrides (for the run's config).

    Raises:
        ConfigError: an unknown ``generate.`` key, or a value of the wrong kind.
    """
    options, rest = GenerateOptions(), []
    fields = {f.name: f for f in dataclasses.fields(GenerateOptions)}
    for item in overrides:
        key, sep, value = item.lstrip("+").partition("=")
        if not key.startswith("generate."):
            rest.append(item)
            continue
        name = key.removeprefix("generate.")
        if name not in fields or not sep:
            raise ConfigError(f"{item!r}: generate.<key>=value with key one of {', '.join(fields)}")
        setattr(options, name, _option_value(name, value, item))
    if options.temperature < 0 or not 0 < options.top_p <= 1 or options.batch_size < 1 or options.max_new_tokens < 0:
        raise ConfigError("generate.temperature must be >= 0, generate.top_p in (0, 1], generate.batch_size >= 1 "
                          "and generate.max_new_tokens >= 0")
    return options, rest


def _given(overrides: Sequence[str], key: str) -> str | None:
    """The value the last ``key=value`` of `overrides` gives (as written), or None."""
    values = [item.partition("=")[2] for item in overrides if item.lstrip("+").partition("=")[0] == key]
    return values[-1] if values else None


def run_config(overrides: Sequence[str]) -> tuple[DictConfig, str | None]:
    """The run's config (its saved ``config.yaml`` with `overrides` on top, else composed from them
    as train.py composes them) and the checkpoint ``train.resume`` names (None: none).

    Raises:
        ConfigError: ``parallel.cp`` > 1, ``train.resume=auto`` without ``train.run_dir``, a path with no checkpoint, an
            override of a key the saved config lacks (``+key=value`` adds one), or overrides Hydra
            cannot compose.
    """
    from pipeflow.checkpoint.find import checkpoints_of, find_latest
    from pipeflow.checkpoint.exporting import config_file

    cp = _given(overrides, "parallel.cp")
    if cp not in (None, "1"):
        raise ConfigError(f"parallel.cp={cp}: generation splits the model's layers over the processes, not its "
                          f"sequences (context parallelism is for training long sequences); drop parallel.cp, a "
                          f"checkpoint trained with cp generates on any number of processes")
    resume, path = _given(overrides, "train.resume"), None
    if resume in ("auto", "'auto'"):
        run_dir = _given(overrides, "train.run_dir")
        if not run_dir:
            raise ConfigError("train.resume=auto needs train.run_dir=<the run's directory>; or name the checkpoint")
        path = find_latest(os.path.join(run_dir, "checkpoints"))
    elif resume and resume not in ("null", "None"):
        found = checkpoints_of(resume)
        path = found[0] if found else None
    if resume and resume not in ("null", "None") and path is None:
        raise ConfigError(f"train.resume={resume} holds no complete checkpoint (a step_<n> directory with "
                          f"meta.json): name a checkpoint, its run directory, or train.run_dir with train.resume=auto")
    saved = config_file(path) if path is not None else ""
    if not os.path.isfile(saved):
        return _composed(overrides), path
    base = upgrade_saved(OmegaConf.load(saved), saved)  # a run from before a rename: today's key names
    OmegaConf.set_struct(base, True)  # a misspelt key is an error, as train.py's overrides are
    for item in map(rename_override_text, overrides):  # an old key: warned, under its new name
        key, _, value = item.lstrip("+").partition("=")
        if "." not in key:
            log.warning("%s ignored: the run's saved %s already chooses its %s", item, saved, key)
            continue
        try:
            OmegaConf.update(base, key, yaml.safe_load(value) if value else None, force_add=item.startswith("+"))
        except Exception as exc:  # noqa: BLE001 - OmegaConf's errors name the key; one line says what to do
            raise ConfigError(f"{item}: {saved} has no {key} ({type(exc).__name__}); check the key, or add it with "
                              f"+{item.lstrip('+')}") from exc
    OmegaConf.update(base, "train.resume", path)
    return base, path  # type: ignore[return-value]


def _composed(overrides: Sequence[str]) -> DictConfig:
    """The config train.py would get for `overrides` (Hydra's errors as one ConfigError line)."""
    from pipeflow.commands.plan.command import compose_config

    try:
        return compose_config(overrides)
    except Exception as exc:  # noqa: BLE001 - Hydra's composition errors name the override
        raise ConfigError(f"the overrides {' '.join(overrides)} cannot be composed: {exc}") from exc


def stage_decoder(cfg: DictConfig, spec: Any, layers: dict[int, Any]) -> Any:
    """This rank's layers as a cached decoder stage (:mod:`pipeflow.models.hf_decode` or ``gpt_decode``).

    Raises:
        ConfigError: a model generation does not support yet.
    """
    if spec.name.startswith("hf-"):
        from pipeflow.models.hf_decode import HFStageDecoder
        from pipeflow.models.hf_folder import load_config

        return HFStageDecoder(load_config(cfg.model.path), layers)
    if spec.name == "gpt":
        from pipeflow.models.gpt_decode import GPTStageDecoder

        return GPTStageDecoder(layers, len(spec.layers), int(cfg.model.block_size))
    raise ConfigError(f"generation supports model=hf and model=gpt; this run's model is {spec.name!r}")


def split(layers: int, stages: int) -> list[range]:
    """`layers` split into `stages` contiguous ranges, as even as counts go (the first ones longer).

    Raises:
        ConfigError: more stages than layers.
    """
    if stages > layers:
        raise ConfigError(f"{stages} processes for a model of {layers} layers: run at most {layers} processes")
    cuts = [layers * s // stages for s in range(stages + 1)]
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def read_prompts(path: str) -> list[str]:
    """The prompts of file `path`: its lines that are not blank.

    Raises:
        ConfigError: the file cannot be read, or holds no prompt.
    """
    try:
        with open(path) as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
    except OSError as exc:
        raise ConfigError(f"generate.prompts={path!r} cannot be read ({exc}): a text file, one prompt a line") from exc
    if not lines:
        raise ConfigError(f"generate.prompts={path!r} holds no prompt (it is empty or blank): write one prompt a line")
    return lines


class Prompts:
    """Reads prompts into token ids and completions back to text, for ``model=hf`` (the model's
    tokenizer) or ``model=gpt`` (space-separated ids)."""

    def __init__(self, cfg: DictConfig, options: GenerateOptions, hf: bool) -> None:
        self.options, self.tokenizer = options, None
        self.vocab_size = OmegaConf.select(cfg, "model.vocab_size", default=None)
        if hf:
            from transformers import AutoTokenizer

            folder = options.tokenizer or OmegaConf.select(cfg, "data.tokenizer") or cfg.model.path
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
            except (OSError, ValueError) as exc:
                raise ConfigError(f"no tokenizer in {folder!r} ({exc}); name one with generate.tokenizer=<folder>") from exc
        elif options.chat:
            raise ConfigError("generate.chat=true needs a tokenizer with a chat template: model=gpt has none")

    def encode(self, line: str) -> list[int]:
        """One prompt line as token ids."""
        if self.tokenizer is None:
            try:
                ids = [int(t) for t in line.split()]
            except ValueError as exc:
                raise ConfigError(f"model=gpt prompts are space-separated token ids; {line!r} is not") from exc
            outside = [i for i in ids if i < 0 or (self.vocab_size is not None and i >= self.vocab_size)]
            if outside:
                where = f"generate.prompts={self.options.prompts!r}: prompt {line!r} has token id {outside[0]}"
                if self.vocab_size is None:
                    raise ConfigError(f"{where}: token ids are 0 or more")
                raise ConfigError(f"{where}, outside the model's vocabulary 0..{self.vocab_size - 1} "
                                  f"(model.vocab_size={self.vocab_size})")
            return ids
        if self.options.chat:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": line}], add_generation_prompt=True,
                                                     tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return list(self.tokenizer(line)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """Generated ids as text (special tokens dropped), or as space-separated ids."""
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def stop_ids(self, cfg: DictConfig) -> tuple[list[int], int]:
        """The end-of-sequence ids (``generate.eos_token_id``, else the model's generation config,
        which may list several) and the id fed to stopped rows."""
        eos: Any = self.options.eos_token_id
        pad = None
        if self.tokenizer is not None:
            from transformers import GenerationConfig

            try:
                generation = GenerationConfig.from_pretrained(str(cfg.model.path))
            except OSError:  # no generation_config.json: the model config's
                from pipeflow.models.hf_folder import load_config

                generation = GenerationConfig.from_model_config(load_config(cfg.model.path))
            eos = generation.eos_token_id if eos is None else eos
            pad = generation.pad_token_id if generation.pad_token_id is not None else self.tokenizer.pad_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return [int(e) for e in eos], int(pad if pad is not None else eos[0] if eos else 0)


def main(argv: list[str] | None = None) -> int:
    """Generate on this process's stage; rank 0 prints (and writes) the completions."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    try:
        options, overrides = parse_options(argv)
        if not options.prompts:
            raise ConfigError("generate.prompts=<file> is required: a text file, one prompt a line")
        cfg, path = run_config(overrides)
        return run(cfg, path, options)
    except PipeflowError as exc:
        print(f"pipeflow.generate: {exc}", file=sys.stderr)
        return 1


def run(cfg: DictConfig, path: str | None, options: GenerateOptions) -> int:
    """Join (or start) the process group, generate on this rank's stage from checkpoint `path` (if
    any), rank 0 reporting; returns the exit status."""
    from pipeflow.runtime.world.distributed import choose_device, end_process_group, init_distributed

    backend, device = choose_device(cfg.dist.backend, cfg.dist.device)
    owned = not dist.is_initialized()  # a caller's group (tests) is left to the caller
    init_distributed(backend, device, cfg.comm.first_step_timeout_s, cfg.comm.join_timeout_s)
    try:
        _generate(cfg, path, options, device)
    except BaseException:
        if owned:  # no barrier: a peer waiting on this rank learns of the failure from the closed group
            end_process_group(None)
        raise
    if owned:
        end_process_group(cfg.comm.timeout_s)
    return 0


def _generate(cfg: DictConfig, path: str | None, options: GenerateOptions, device: torch.device) -> None:
    """This rank's part: its stage built and loaded, the prompts read, the loop run, rank 0's report."""
    from pipeflow.run.builder import build_spec
    from pipeflow.commands.generate_weights import load_weights, merge_adapters
    from pipeflow.runtime.transport import P2PComm

    rank, world = dist.get_rank(), dist.get_world_size()
    spec = build_spec(cfg.model)
    ranges = split(len(spec.layers), world)
    dtype = getattr(torch, cfg.train.param_dtype)
    built = spec.build_layers(ranges[rank], device, dtype)
    layers = {i: layer.eval() for i, layer in zip(ranges[rank], built)}
    if path is not None:
        load_weights(cfg, spec, path, layers)
    if spec.lora is not None:
        merge_adapters(layers)
    prompts = Prompts(cfg, options, spec.name.startswith("hf-"))
    decoder = stage_decoder(cfg, spec, layers)
    lines = read_prompts(options.prompts)
    eos, pad = prompts.stop_ids(cfg)
    ids = [prompts.encode(line) for line in lines]
    b = options.batch_size
    batches: list[PromptBatch] = [left_padded(ids[k:k + b], pad, options.max_new_tokens, decoder.context, device)
                                  for k in range(0, len(ids), b)]
    comm = None
    if world > 1:
        comm = P2PComm(None, device)
        comm.warmup()
    stream = _Stream(prompts) if rank == 0 and len(lines) == 1 else None
    made = generate(decoder, batches, Sampler(options.temperature, options.top_p, options.seed), eos, pad, comm,
                    dtype, options.in_flight, on_tokens=stream)
    if made is not None:
        completions = [prompts.decode(row) for batch in made for row in batch]
        _report(lines, completions, options.output, streamed=stream is not None)


class _Stream:
    """Prints one prompt's completion as it is made (its new text after each token)."""

    def __init__(self, prompts: Prompts) -> None:
        self.prompts, self.shown = prompts, ""

    def __call__(self, g: int, made: list[list[int]]) -> None:
        text = self.prompts.decode(made[0])
        if text.startswith(self.shown):
            print(text[len(self.shown):], end="", flush=True)
            self.shown = text


def _report(lines: list[str], completions: list[str], output: str | None, streamed: bool) -> None:
    """Print each completion (already streamed: a newline) and write the JSON lines."""
    if streamed:
        print()
    else:
        for line, completion in zip(lines, completions):
            print(json.dumps({"prompt": line, "completion": completion}, ensure_ascii=False))
    if output:
        with open(output, "w") as f:
            for line, completion in zip(lines, completions):
                f.write(json.dumps({"prompt": line, "completion": completion}, ensure_ascii=False) + "\n")
