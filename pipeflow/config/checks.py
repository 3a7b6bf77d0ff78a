"""The checks of a composed config that span its sections, once at start, each naming the key to
change: builders set (``_target_``), the world's layout (dp x pp x tp), sequence parallelism,
expert parallelism, the batch against the micro-batches, and the paths.  Each section checks its
own values (counts, deadlines, dtypes, modes) in its ``__post_init__`` when
:func:`pipeflow.config.schema.check_values` makes the config typed; the schemas are
:mod:`pipeflow.config.schema`'s."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from pipeflow.errors import ConfigError
from pipeflow.config.data import TextDataConfig, TokenDataConfig, typed_data
from pipeflow.config.keys import config_keys
from pipeflow.config.values import check_deadlines, check_layout_counts
from pipeflow.runtime.parallel.expert_parallel import check_expert_parallel

if TYPE_CHECKING:
    from pipeflow.config.schema import ParallelConfig


def check_targets(cfg: Any) -> None:
    """The model config names its builder (``model._target_``), and every ``_target_`` under
    ``model`` is set (``model=module`` needs ``model.module._target_``, your module's class).

    Raises:
        ConfigError: naming the key to set, with an example.
    """
    model = OmegaConf.select(cfg, "model", throw_on_missing=False)
    if model is None or not OmegaConf.is_dict(model):
        return
    if "_target_" not in model:
        raise ConfigError(
            "model has no _target_: a model config must name the function that builds the model; set "
            "model._target_=<import path of a function returning a pipeflow ModelSpec> (e.g. "
            "pipeflow.models.mlp.build_mlp), or pick a built-in model=gpt|mlp|resnet18|... (see docs/start/2-your-model.md)"
        )
    for path in [k for k in config_keys(model) if k == "_target_" or k.endswith("._target_")]:
        if OmegaConf.is_missing(model, path) or OmegaConf.select(model, path) in (None, ""):
            raise ConfigError(f"model.{path} is not set: {_target_hint(path)}")


def _target_hint(path: str) -> str:
    """What to put in ``model.<path>``."""
    if path == "module._target_":
        return ("model=module needs the import path of your nn.Module's class, e.g. "
                "model.module._target_=examples.your_module.GPT (its constructor's arguments: "
                "+model.module.<name>=<value>)")
    if path == "_target_":
        return "set model._target_=<import path of a function returning a pipeflow ModelSpec>"
    return f"set model.{path}=<import path of the class or function that {path.rsplit('.', 1)[0]} names>"


DTYPES = ("float32", "float64", "bfloat16", "float16")


def resolve_layout(parallel: ParallelConfig, world_size: int) -> tuple[int, int]:
    """(dp, pp) for this world size, with ``parallel.tp`` (:func:`tensor_degree`) ranks per stage.

    Raises:
        ConfigError: if dp x pp x tp does not equal the world size.
    """
    if parallel.pp == "auto":
        raise ConfigError("parallel.pp=auto is chosen when a run starts (parallel.replan=true); here give the "
                          "pipeline ranks, e.g. parallel.pp=4")
    dp, tp, cp = parallel.dp, tensor_degree(parallel), int(getattr(parallel, "cp", 1))
    check_layout_counts(parallel)
    width, across = tp * cp, (f" x parallel.cp={cp}" if cp > 1 else "") + (f" x parallel.tp={tp}" if tp > 1 else "")
    if world_size % width:
        raise ConfigError(f"parallel.tp={tp}{f' x parallel.cp={cp}' if cp > 1 else ''} does not divide the world size "
                          f"{world_size}; choose degrees that divide {world_size} (the GPUs of a node, e.g. 8)")
    if dp == "auto":
        dp = auto_replicas(parallel.pp, width, world_size)
    if world_size % (dp * width):
        raise ConfigError(
            f"parallel.dp={dp} does not divide the world size {world_size}"
            + (f" / {across.removeprefix(' x ')}" if width == tp else f" / ({across.removeprefix(' x ')})" if width > 1
               else "") + f"; choose a dp that divides {world_size // width}"
        )
    pp = parallel.pp if parallel.pp is not None else world_size // (dp * width)
    if dp * pp * width != world_size:
        shape = f"parallel.dp={dp} x parallel.pp={pp}{across}"
        raise ConfigError(
            f"{shape} = {dp * pp * width} processes, but the world size is {world_size}; launch with torchrun "
            f"--nproc-per-node {dp * pp * width} or set parallel.pp={world_size // (dp * width)}"
        )
    return dp, pp


def check_context_parallel(cfg: Any) -> None:
    """``parallel.cp``: each sequence cut into 2 x cp chunks of whole tokens, with what cp runs
    with so far.

    Raises:
        ConfigError: 2 x cp does not divide ``data.seq_len``, or cp with sequence parallelism,
            expert parallelism or variable-length micro-batches.
    """
    cp = int(OmegaConf.select(cfg, "parallel.cp", default=1) or 1)
    if cp == 1:
        return
    seq_len = OmegaConf.select(cfg, "data.seq_len", default=None)
    if isinstance(seq_len, int) and seq_len % (2 * cp):
        raise ConfigError(f"parallel.cp={cp} cuts each sequence into 2 x cp = {2 * cp} chunks (each rank a head and a "
                          f"tail chunk, so causal work is even), and data.seq_len={seq_len} is not a multiple of "
                          f"{2 * cp}: set data.seq_len to a multiple of {2 * cp} (pad the data) or choose another cp")
    refused = ((bool(cfg.parallel.sequence_parallel), "parallel.sequence_parallel"),
               (int(cfg.parallel.ep) > 1, f"parallel.ep={cfg.parallel.ep} (the experts' gradients are summed over "
                                          f"dp, not yet over the cp ranks that hold them too)"),
               (bool(OmegaConf.select(cfg, "data.variable_lengths", default=False)), "data.variable_lengths"))
    for bad, what in refused:
        if bad:
            raise ConfigError(f"parallel.cp={cp} does not run with {what} yet; set parallel.cp=1 or turn it off")


def auto_replicas(pp: int | None, tp: int, world_size: int) -> int:
    """``parallel.dp=auto``: the replicas that fill the world with `pp` x `tp` ranks each (an
    elastic job keeps its pipeline and changes its replicas as nodes come and go).

    Raises:
        ConfigError: pp not given, or pp x tp does not divide the world size.
    """
    if pp is None:
        raise ConfigError("parallel.dp=auto needs parallel.pp (the pipeline to replicate); set e.g. parallel.pp=2")
    if world_size % (pp * tp):
        shape = f"parallel.pp={pp}" + (f" x parallel.tp={tp}" if tp > 1 else "")
        raise ConfigError(f"parallel.dp=auto: {shape} = {pp * tp} ranks per replica does not divide the world size "
                          f"{world_size}; launch a multiple of {pp * tp} processes or change parallel.pp")
    return world_size // (pp * tp)


def check_sequence_parallel(cfg: Any) -> None:
    """Raise ConfigError for ``parallel.sequence_parallel`` where the sequence cannot be cut into tp
    equal slices: without tp, with variable lengths, or a sequence length tp does not divide."""
    if not cfg.parallel.sequence_parallel:
        return
    tp = tensor_degree(cfg.parallel)
    if tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1 (it splits the sequence over the tp "
                          "ranks of a stage)")
    data = typed_data(cfg.data)
    if not isinstance(data, TokenDataConfig):  # no sequence to split (images, features)
        return
    if data.variable_lengths:
        raise ConfigError(f"parallel.sequence_parallel=true with data.variable_lengths=true: every sequence length must "
                          f"split into parallel.tp={tp} equal slices; set one of them to false")
    seq_len = data.seq_len
    if seq_len % tp:
        raise ConfigError(f"parallel.sequence_parallel=true: data.seq_len={seq_len} does not split into parallel.tp={tp} "
                          f"equal slices; choose a length divisible by {tp}")


def tensor_degree(parallel: Any) -> int:
    """``parallel.tp`` as an int (0 stays 0, for the checks to refuse).

    Raises:
        ConfigError: ``auto``, which only a run that re-plans resolves (:mod:`pipeflow.run.replan`).
    """
    if parallel.tp == "auto":
        raise ConfigError("parallel.tp=auto is chosen when a run starts (parallel.replan=true); here give a "
                          "number (the planner: plan.tp_sizes lists the degrees it tries)")
    return int(parallel.tp)


SHARD_MODES = ("none", "optimizer", "full")


def check_context(cfg: Any) -> None:
    """A model with ``block_size`` positions (model=gpt) must fit the data's rows (``data.seq_len``).

    Raises:
        ConfigError: naming both keys and the two ways to agree.
    """
    block = OmegaConf.select(cfg, "model.block_size", default=None)
    seq_len = OmegaConf.select(cfg, "data.seq_len", default=None)
    if isinstance(block, int) and isinstance(seq_len, int) and seq_len > block:
        raise ConfigError(f"data.seq_len={seq_len} is longer than model.block_size={block}, the positions the model "
                          f"has: set model.block_size={seq_len} (or more), or data.seq_len={block}")


def check_across_sections(cfg: Any, world_size: int) -> tuple[int, int]:
    """What spans the sections, once each section is checked (:func:`pipeflow.config.schema.check_config`
    runs both); returns (dp, pp).

    Raises:
        ConfigError: naming the key and what to change.
    """
    dp, pp = resolve_layout(cfg.parallel, world_size)
    check_targets(cfg)
    check_context(cfg)
    check_sequence_parallel(cfg)
    check_context_parallel(cfg)
    experts = OmegaConf.select(cfg, "model.moe.experts", default=None)  # None (model=hf): known once built
    check_expert_parallel(cfg.parallel.ep, dp, tensor_degree(cfg.parallel), cfg.parallel.shard,
                          None if experts is None else int(experts))
    m, batch = cfg.pipeline.num_microbatches, cfg.data.batch_size
    if batch < dp * m:
        raise ConfigError(
            f"data.batch_size={batch} cannot be split into pipeline.num_microbatches={m} micro-batches "
            f"(x parallel.dp={dp}) of at least one row each; make the batch size at least {dp * m}"
        )
    check_paths(cfg)
    return dp, pp


STORAGES = ("shared", "local")  # train.checkpoint_storage
BACKENDS = ("nccl", "gloo", "mpi", "ucc")
RESUME_WORDS = ("auto", "none", "never", "latest", "")  # train.resume values that are not paths


def check_comm(comm: Any) -> None:
    """Deadlines must be positive, and the first step's at least the steady one (``comm.shapes``
    and ``comm.post_recvs`` are choices: Hydra refuses any other word while composing).

    Raises:
        ConfigError: naming the key and a value that works.
    """
    check_deadlines(comm)
    if comm.first_step_timeout_s < comm.timeout_s:
        raise ConfigError(
            f"comm.first_step_timeout_s={comm.first_step_timeout_s} is shorter than "
            f"comm.timeout_s={comm.timeout_s}; the first step (shape negotiation, lazy start-up) "
            f"needs the longer deadline: set comm.first_step_timeout_s>={comm.timeout_s}"
        )


def check_paths(cfg: Any) -> None:
    """The files the config names must exist: data.path (data=text), schedule.path
    (schedule=custom), train.resume (when it is a path).

    Raises:
        ConfigError: naming the key, the path, and what to set instead.
    """
    data = typed_data(cfg.data)
    data_path = data.path if isinstance(data, TextDataConfig) else None
    if data_path is not None and not os.path.isfile(data_path):
        raise ConfigError(f"data.path={data_path!r} is not a file; point data.path at a local text file")
    schedule_path = OmegaConf.select(cfg, "schedule.path")
    if cfg.schedule.name == "custom" and schedule_path is not None and not os.path.isfile(schedule_path):
        raise ConfigError(
            f"schedule.path={schedule_path!r} is not a file; schedule=custom needs a file of actions "
            f"per rank (see pipeflow/schedules/custom.py)"
        )
    resume = cfg.train.resume
    if isinstance(resume, str) and resume.lower() not in RESUME_WORDS and not os.path.exists(resume):
        raise ConfigError(
            f"train.resume={resume!r} does not exist; give an existing checkpoint, "
            f"train.resume=auto (the last good checkpoint of the run directory) or leave it unset"
        )
