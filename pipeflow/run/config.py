"""Typed configuration: dataclass schemas registered in Hydra's ConfigStore, checked once at start.

YAML files under ``configs/`` hold the values; these dataclasses are their schemas (types and
defaults), so a typo in an override (``pipeline.num_microbatch=4``) fails at once.
"""
from __future__ import annotations

import copy
import difflib
import inspect
import os
from dataclasses import dataclass, field, is_dataclass, make_dataclass
from typing import Any, Callable, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from pipeflow.errors import ConfigError
from pipeflow.runtime.expert_parallel import check_expert_parallel
from pipeflow.run.config_values import check_counts, check_deadlines, check_layout_counts
from pipeflow.schedules.offload import check_mode
from pipeflow.runtime.mesh_order import parse_order
from pipeflow.models.gpt import build_gpt
from pipeflow.models.hf import build_hf
from pipeflow.models.mlp import build_mlp
from pipeflow.models.module_spec import build_module
from pipeflow.models.sleep import build_sleep
from pipeflow.models.zoo import build_resnet, build_torchvision


def model_schema(builder: Callable[..., Any], name: str | None = None) -> type:
    """The config schema of a model: ``_target_`` naming `builder`, then one field per keyword
    argument of its signature, typed by its annotation, defaulting to the builder's default.

    The builder is the one source of a model's defaults; the schema only reads them. A user's
    model gets a typed config group the same way:
    ``ConfigStore.instance().store(group="model", name="base_mine", node=model_schema(build_mine))``.

    Args:
        builder: a function returning a ModelSpec, every parameter a keyword with a default.
        name: the schema's class name; default ``<Builder>Config``.

    Returns:
        A dataclass type for Hydra's ConfigStore.

    Raises:
        ConfigError: a parameter has no default (the schema could not default it).
    """
    hints = get_type_hints(builder)
    fields: list[tuple[str, Any, Any]] = [("_target_", str, field(default=f"{builder.__module__}.{builder.__qualname__}"))]
    for param in inspect.signature(builder).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.default is param.empty:
            raise ConfigError(f"{builder.__qualname__}({param.name}) has no default; a model schema needs one")
        default = param.default  # a nested config (model.moe) as a fresh copy per instance
        spec = field(default_factory=lambda d=default: copy.deepcopy(d)) if is_dataclass(default) else field(default=default)
        fields.append((param.name, hints.get(param.name, Any), spec))
    doc = (builder.__doc__ or "").strip().splitlines()
    cls_name = name or "".join(part.title() for part in builder.__name__.split("_")) + "Config"
    return make_dataclass(cls_name, fields, namespace={"__doc__": doc[0] if doc else None, "__module__": __name__})


# The built-in models' schemas (``model=gpt|mlp|resnet18|resnet50|sleep|torchvision|module|hf``): their defaults are the builders'.
GPTModelConfig = model_schema(build_gpt, "GPTModelConfig")
MLPModelConfig = model_schema(build_mlp, "MLPModelConfig")
ResNetModelConfig = model_schema(build_resnet, "ResNetModelConfig")
SleepModelConfig = model_schema(build_sleep, "SleepModelConfig")
TorchvisionModelConfig = model_schema(build_torchvision, "TorchvisionModelConfig")
ModuleModelConfig = model_schema(build_module, "ModuleModelConfig")
HFModelConfig = model_schema(build_hf, "HFModelConfig")  # model=hf: transformers is imported only when it builds


@dataclass
class ScheduleConfig:
    """Which pipeline schedule runs (``schedule=1f1b``, ``schedule=zbv``, ... or ``schedule=custom``)."""

    name: str = "1f1b"
    path: str | None = None  # schedule=custom: the file of actions per rank


@dataclass
class PipelineConfig:
    """How the batch is split and where layers go."""

    num_microbatches: int = 8
    split_points: list[Any] | None = None  # first layer (index or name) of stages 1..S-1
    stages_per_rank: int | None = None  # model chunks per rank; None: the schedule's own
    placement: str | None = None  # loop | v; None: the schedule's own
    stage_to_rank: list[int] | None = None  # explicit placement: pipeline rank of each stage
    max_activations: float | None = None  # schedule=auto: micro-batches of a rank's share a rank may hold; null: p
    balance: str = "uniform"  # uniform | params | time | memory (ignored with split_points)
    profile: bool = True  # profile layers (on pipeline rank 0) for the partition table
    checkpoint_activations: Any = False  # true | false | n: recompute every n-th layer in backward
    offload: str = "none"  # none | auto | all: held activations copied to host memory in the pipeline's gaps


@dataclass
class DataConfig:
    """Where batches come from: ``markov`` (made locally), ``text`` (a local file), ``tokens``
    (token files read through memory maps), ``chat`` (conversations, prompts masked), ``gaussian``,
    or images: ``cifar10``, ``mnist``, ``imagefolder`` (under ``data.root``), ``fakedata``."""

    name: str = "markov"
    batch_size: int = 32
    seq_len: int = 64
    vocab_size: int = 64
    num_tokens: int = 200_000
    path: str | None = None
    # text, tokens, chat: a held-out file, folder or glob (data.path's formats) train.eval_every
    # evaluates on, data.path then trained on whole; null: the last val_fraction of data.path
    eval_path: str | None = None
    level: str = "byte"  # text: "byte" (vocab 256) or "char"
    val_fraction: float = 0.1
    in_features: int = 32
    num_classes: int = 10
    root: str = "data"
    download: bool = False
    image_size: int | None = None
    fake_size: int = 1024
    seed: int = 1234
    variable_lengths: bool = False  # token data: each micro-batch its own sequence length
    min_seq_len: int | None = None  # with variable_lengths: lengths drawn from min_seq_len..seq_len (null: seq_len // 4)
    token_dtype: str = "uint16"  # tokens: the dtype of headerless files (uint16 or uint32; .npy files carry their own)
    pack_documents: bool = False  # tokens: inputs (tokens, document ids), documents split at eos_id
    eos_id: int | None = None  # tokens: the end-of-document id (checked against model.vocab_size)
    overlong: str = "drop"  # chat: a conversation longer than seq_len + 1 tokens: drop | truncate | error
    tokenizer: str | None = None  # chat: the folder of the tokenizer and chat template (null: model.path)


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then cosine decay, global grad-norm clipping."""

    lr: float = 3e-3
    min_lr: float = 3e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_steps: int = 20
    grad_clip: float = 1.0  # 0 disables clipping
    fused: bool | None = None  # fused AdamW (one kernel for every tensor's update); null: on CUDA, not on the CPU


@dataclass
class TrainConfig:
    """The loop: how long, how often to log and evaluate, where to write."""

    max_steps: int = 300
    log_every: int = 25
    eval_every: int = 100
    eval_batches: int = 4
    dtype: str = "float32"
    run_dir: str | None = None  # default: an explicit hydra.run.dir, else outputs/<timestamp>; chosen by rank 0
    precision: str = "fp32"  # fp32 | bf16 | fp16: autocast compute dtype; weights stay in train.dtype
    save_every: int = 0  # write a checkpoint every n steps (and at the end); 0: never
    # shared: one run directory every host sees; local: each host its own disk, each writes its
    # ranks' part (python -m pipeflow.checkpoint gather merges them); docs/multinode.md "Storage"
    checkpoint_storage: str = "shared"
    resume: str | None = None  # a checkpoint dir, a checkpoints root, or "auto" (<run_dir>/checkpoints)
    check_finite: bool = False  # stop at the first NaN/Inf loss or gradient, naming the stage (fp16 overflow: skipped)
    # signals that save a checkpoint at the next step boundary and end the job (exit code 75):
    # what a cluster scheduler sends before it kills a job; [] or null: off
    save_on_signal: Any = field(default_factory=lambda: ["SIGTERM"])  # a name, a list of names, or false
    # torch.compile each layer (its forward and its backward; split-backward schedules compute B
    # and W once each); docs/performance.md
    compile: bool = False
    compile_mode: str = "default"  # default | max-autotune-no-cudagraphs (CUDA-graph modes are refused)
    compile_backend: str = "inductor"  # inductor | aot_eager (the same graphs, no code generated: tests, debugging)


@dataclass
class ParallelConfig:
    """The process layout: ``parallel.dp`` x ``parallel.pp`` x ``parallel.tp`` = world size."""

    dp: Any = 1  # replicas; auto: world size / (pp x tp), so one command fits any node count (needs pp)
    pp: int | None = None  # default: world size / (dp x tp)
    # what each stage's data-parallel group shards: none (full replicas), optimizer (ZeRO-1:
    # AdamW state and update), full (FSDP2: parameters and gradients too)
    shard: str = "none"
    # tensor parallel: each stage's layers split over tp ranks (innermost: the GPUs of a node)
    tp: int = 1
    # with tp > 1: norms, dropout and the activations between stages sharded along the sequence
    sequence_parallel: bool = False
    # the mesh's dimensions outermost first (the innermost's groups are consecutive ranks: one
    # host's), e.g. [pp,dp,tp]; auto: the order with the fastest predicted step on the links
    # measured at start ([dp,pp,tp] on one host)
    order: Any = "auto"
    # expert parallelism (model.moe): each stage's experts split over its dp ranks; 1 or parallel.dp
    ep: int = 1


@dataclass
class CommConfig:
    """Point-to-point communication."""

    timeout_s: float = 300.0
    first_step_timeout_s: float = 900.0
    join_timeout_s: float = 120.0  # every rank must have joined the process group by then (ranks missing are named)
    dynamic_shapes: bool = False  # relearn shapes when stage 0's input shape changes (one broadcast per step)
    # every micro-batch its own shapes (one small message per stage boundary per step); on by
    # itself with data.variable_lengths or a batch that does not split into equal micro-batches
    variable_shapes: bool = False
    # gloo: post the next step's recvs before computing (true), at their own step (false), or
    # time both over the first training steps and keep the faster (auto); Pipeline.recvs_ahead
    recvs_ahead: Any = "auto"


@dataclass
class DistConfig:
    """Backend and device; default: NCCL on ``cuda:LOCAL_RANK`` when CUDA is present, else gloo/CPU."""

    backend: str | None = None
    device: str | None = None


@dataclass
class MetricsConfig:
    """What is measured and written: TensorBoard under ``<run_dir>/tb``, traces of chosen steps
    (``<run_dir>/trace.json``, ``timeline_step<N>.png``), the console progress bar."""

    tensorboard: bool = True  # <run_dir>/tb: loss, lr, grad norm, throughput, per-stage times, bubble, memory
    log_every: int | None = None  # steps per log interval (console line + TensorBoard points); None: train.log_every
    trace_steps: list[int] = field(default_factory=list)  # e.g. [5]: every action of step 5 -> trace.json, timeline_step5.png
    progress_bar: bool = True  # tqdm bar on rank 0 (only when stderr is a terminal)
    # steps whose tensor memory (params, grads, optimizer state, activations, comm buffers) is
    # measured by category beside the prediction; [1]: the first step with optimizer state; []: off
    memory_steps: list[int] = field(default_factory=lambda: [1])
    # on CUDA: every n-th step after the warm-up records each action's CUDA events (per-stage
    # figures, bubble, calibration); the others are timed by the host without draining the device.
    # On the CPU every step is recorded (free)
    timed_every: int = 10
    # the start-of-run prediction on the CPU: steps of the program rehearsed with stand-in layers
    # that cost what the profile says (pipeflow.planning.rehearsal); null: about 1.5 s worth per
    # lowering when train.max_steps >= 25, else none; 0: none (the modelled prediction)
    rehearse_steps: int | None = None


@dataclass
class PlanConfig:
    """The planner, ``python -m pipeflow.plan`` (see pipeflow/plan.py); train.py ignores it."""

    top: int = 10  # layouts printed
    memory_limit_gb: float | None = None  # per pipeline rank; null: no limit
    schedules: list[str] | None = None  # null: every built-in schedule
    microbatches: list[int] | None = None  # null: every count that divides data.batch_size
    max_chunks: int = 4  # stages per rank tried by schedules that take any count
    splits: str = "balanced"  # balanced (time, memory, uniform) | all (every split; small models)
    comm_latency_ms: float | None = None  # per communicating step; null: measured (2 local processes)
    action_overhead_ms: float | None = None  # the runtime's own cost per F/B/W action; null: measured
    repeats: int = 5  # timed runs per layer when profiling
    optimizer_factor: float = 2.0  # optimizer state bytes per parameter byte (AdamW: 2)
    csv: str | None = None  # also write every simulated layout to this CSV file
    # a run directory (its costs.json): rank layouts with what that run measured; with plan.hardware,
    # its links timed at start and per-layer profile replace the preset's figures (docs/cluster_planning.md)
    calibration: str | None = None
    rehearse: int = 0  # CPU hosts: build the k fastest layouts as train.py would and re-rank them by their rehearsed step
    # tensor-parallel degrees searched beside the schedules (each pick: parallel.tp=N, dp x pp x N processes);
    # null: parallel.tp alone.  Their collectives are costed over this link (a node's NVLink by default)
    tp: list[int] | None = None
    # the link tp's collectives are costed over: null takes plan.hardware's link within a host,
    # else 150 GB/s and 10 us (an NVLink-class node); set, they override plan.hardware's
    tp_bandwidth_gbps: float | None = None
    tp_latency_us: float | None = None
    # pipeline.offload modes tried with every layout (none | auto | all), their copies over a
    # device-host link of this bandwidth each way, on a copy engine beside compute (a GPU's PCIe);
    # null: measured on this machine's device as train.py measures it (a CPU: memcpys on the compute thread)
    offload: list[str] = field(default_factory=lambda: ["none"])
    host_link_gbps: float | None = None
    # a cluster you do not have (docs/cluster_planning.md): a preset (a100_sxm_80gb, h100_sxm, h200_sxm, b200) or a
    # YAML file; layers costed by a roofline instead of profiled, tp x pp x dp searched for plan.gpus GPUs
    hardware: str | None = None
    gpus: int | None = None  # with plan.hardware: the GPUs to lay the model on
    train_tokens: float | None = None  # with plan.hardware: tokens of the whole run, for its GPU-hours
    gpu_hour_price: float | None = None  # with plan.hardware: price of one GPU-hour, for the run's cost


@dataclass
class Config:
    """The whole job."""

    model: Any = MISSING
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)


def register_configs() -> None:
    """Register the schemas with Hydra's ConfigStore (called before ``@hydra.main`` runs), and
    make Hydra's error for an unknown key suggest the nearest known ones (:func:`suggest_keys`)."""
    install_key_suggestions()
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="model", name="base_gpt", node=GPTModelConfig)
    cs.store(group="model", name="base_mlp", node=MLPModelConfig)
    cs.store(group="model", name="base_resnet", node=ResNetModelConfig)
    cs.store(group="model", name="base_sleep", node=SleepModelConfig)
    cs.store(group="model", name="base_torchvision", node=TorchvisionModelConfig)
    cs.store(group="model", name="base_module", node=ModuleModelConfig)
    cs.store(group="model", name="base_hf", node=HFModelConfig)
    cs.store(group="schedule", name="base_schedule", node=ScheduleConfig)
    cs.store(group="pipeline", name="base_pipeline", node=PipelineConfig)
    cs.store(group="data", name="base_data", node=DataConfig)
    cs.store(group="optim", name="base_optim", node=OptimConfig)
    cs.store(group="metrics", name="base_metrics", node=MetricsConfig)
    cs.store(group="plan", name="base_plan", node=PlanConfig)


# --------------------------------------------------------------------- unknown keys, _target_
def config_keys(cfg: Any) -> list[str]:
    """Every dotted key of `cfg` (leaves and inner nodes), missing values included."""
    keys: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        for key in node:
            path = f"{prefix}{key}"
            keys.append(path)
            child = node._get_node(key) if OmegaConf.is_config(node) else None
            if OmegaConf.is_dict(child):
                walk(child, f"{path}.")

    walk(cfg, "")
    return keys


def suggest_keys(key: str, known: list[str], count: int = 2) -> list[str]:
    """The known keys nearest to the unknown `key` (difflib): when its parent exists, the
    parent's keys whose last name is nearest to its last name; else the nearest whole keys."""
    parent, _, leaf = key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == parent}
    if parent in known or not parent:
        return [siblings[name] for name in difflib.get_close_matches(leaf, list(siblings), n=count, cutoff=0.6)]
    return difflib.get_close_matches(key, known, n=count, cutoff=0.8)


def _with_suggestion(exc: Exception, overrides: list[Any], cfg: Any) -> Exception | None:
    """Hydra's 'Could not override' error for an unknown key, with a did-you-mean (None: another error)."""
    from hydra.errors import ConfigCompositionException

    text = str(exc)
    if not text.startswith("Could not override '"):
        return None
    key = text[len("Could not override '"):].split("'", 1)[0]
    value = next((o.input_line.partition("=")[2] for o in overrides if o.key_or_group == key), "...")
    close = suggest_keys(key, config_keys(cfg))
    if not close:
        return None
    options = " or ".join(f"{k}={value}" for k in close)
    return ConfigCompositionException(
        f"Could not override '{key}': the config has no such key. Did you mean {options}?\n"
        f"(To add a new key anyway: +{key}={value})"
    )


def install_key_suggestions() -> None:
    """Wrap Hydra's override step so that an unknown key's error names the nearest known keys
    (``pipeline.num_microbatch=4`` -> ``Did you mean pipeline.num_microbatches=4?``), for
    ``@hydra.main`` and ``hydra.compose`` alike.  Hydra has no hook for it: its (private)
    ``ConfigLoaderImpl._apply_overrides_to_config`` is wrapped once; where it is missing (another
    Hydra), the errors stay Hydra's own."""
    try:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra.errors import ConfigCompositionException
    except ImportError:
        return
    apply = getattr(ConfigLoaderImpl, "_apply_overrides_to_config", None)
    if apply is None or getattr(apply, "_pipeflow_suggests", False):
        return

    def apply_with_suggestions(overrides: list[Any], cfg: Any) -> None:
        try:
            apply(overrides, cfg)
        except ConfigCompositionException as exc:
            better = _with_suggestion(exc, overrides, cfg)
            if better is None:
                raise
            raise better from exc.__cause__

    apply_with_suggestions._pipeflow_suggests = True  # type: ignore[attr-defined]
    ConfigLoaderImpl._apply_overrides_to_config = staticmethod(apply_with_suggestions)


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
            "pipeflow.models.mlp.build_mlp), or pick a built-in model=gpt|mlp|resnet18|... (see docs/models.md)"
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
    dp, tp = parallel.dp, tensor_degree(parallel)
    check_layout_counts(parallel)
    if world_size % tp:
        raise ConfigError(f"parallel.tp={tp} does not divide the world size {world_size}; choose a tp that divides "
                          f"{world_size} (the GPUs of a node, e.g. 8)")
    if dp == "auto":
        dp = auto_replicas(parallel.pp, tp, world_size)
    if world_size % (dp * tp):
        raise ConfigError(
            f"parallel.dp={dp} does not divide the world size {world_size}"
            + (f" / parallel.tp={tp}" if tp > 1 else "") + f"; choose a dp that divides {world_size // tp}"
        )
    pp = parallel.pp if parallel.pp is not None else world_size // (dp * tp)
    if dp * pp * tp != world_size:
        shape = f"parallel.dp={dp} x parallel.pp={pp}" + (f" x parallel.tp={tp}" if tp > 1 else "")
        raise ConfigError(
            f"{shape} = {dp * pp * tp} processes, but the world size is {world_size}; launch with torchrun "
            f"--nproc-per-node {dp * pp * tp} or set parallel.pp={world_size // (dp * tp)}"
        )
    return dp, pp


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
    if not OmegaConf.select(cfg, "parallel.sequence_parallel", default=False):
        return
    tp = tensor_degree(cfg.parallel)
    if tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1 (it splits the sequence over the tp "
                          "ranks of a stage)")
    if OmegaConf.select(cfg, "data.variable_lengths", default=False):
        raise ConfigError(f"parallel.sequence_parallel=true with data.variable_lengths=true: every sequence length must "
                          f"split into parallel.tp={tp} equal slices; set one of them to false")
    seq_len = OmegaConf.select(cfg, "data.seq_len", default=None)
    if seq_len is not None and seq_len % tp:
        raise ConfigError(f"parallel.sequence_parallel=true: data.seq_len={seq_len} does not split into parallel.tp={tp} "
                          f"equal slices; choose a length divisible by {tp}")


def tensor_degree(parallel: Any) -> int:
    """``parallel.tp`` (1 where the config predates it or sets null; 0 stays 0, for the checks to refuse)."""
    tp = getattr(parallel, "tp", None)
    return 1 if tp is None else int(tp)


SHARD_MODES = ("none", "optimizer", "full")


def check_config(cfg: Any, world_size: int) -> tuple[int, int]:
    """Check what can be checked before anything is built; returns (dp, pp).

    Raises:
        ConfigError: naming the key and what to change.
    """
    check_values(cfg)
    dp, pp = resolve_layout(cfg.parallel, world_size)
    check_targets(cfg)
    parse_order(OmegaConf.select(cfg, "parallel.order", default="auto"))
    shard = OmegaConf.select(cfg, "parallel.shard", default="none")
    if shard not in SHARD_MODES:
        raise ConfigError(f"parallel.shard={shard!r} is unknown; valid: {', '.join(SHARD_MODES)} "
                          "(none: full replicas, optimizer: ZeRO-1, full: FSDP2)")
    check_sequence_parallel(cfg)
    check_expert_parallel(int(OmegaConf.select(cfg, "parallel.ep", default=1) or 1), dp, tensor_degree(cfg.parallel),
                          shard, int(OmegaConf.select(cfg, "model.moe.experts", default=0) or 0))
    m, batch = cfg.pipeline.num_microbatches, cfg.data.batch_size
    if batch < dp * m:
        raise ConfigError(
            f"data.batch_size={batch} cannot be split into pipeline.num_microbatches={m} micro-batches "
            f"(x parallel.dp={dp}) of at least one row each; make the batch size at least {dp * m}"
        )
    limit = cfg.pipeline.max_activations
    if limit is not None and limit < 1:
        raise ConfigError(f"pipeline.max_activations={limit} must be at least 1 (micro-batches of a rank's share), "
                          "or null for 1F1B's p")
    if cfg.train.dtype not in DTYPES:
        raise ConfigError(f"train.dtype={cfg.train.dtype!r} is not one of {', '.join(DTYPES)}")
    from pipeflow.runtime.compile import check_options  # torch-heavy: only when checking
    from pipeflow.runtime.precision import checkpoint_every, compute_dtype

    compute_dtype(cfg.train.precision)
    checkpoint_every(cfg.pipeline.checkpoint_activations)
    check_mode(OmegaConf.select(cfg, "pipeline.offload", default="none"))
    check_options(OmegaConf.select(cfg, "train.compile_mode", default="default"),
                  OmegaConf.select(cfg, "train.compile_backend", default="inductor"))
    check_paths(cfg)
    backend = OmegaConf.select(cfg, "dist.backend")
    if backend is not None and backend not in BACKENDS:
        raise ConfigError(f"dist.backend={backend!r} is unknown; valid: {', '.join(BACKENDS)} (or null: automatic)")
    return dp, pp


def check_values(cfg: Any) -> None:
    """The checks that need neither the world size nor a process group: every count and deadline
    (:mod:`pipeflow.run.config_values`) and the ``comm.*`` settings.  ``train.py`` runs them before
    joining, so a bad ``comm.join_timeout_s`` is named as such, not as a rank that never arrived.

    Raises:
        ConfigError: naming the key, its value and the values allowed.
    """
    check_counts(cfg)
    check_comm(cfg.comm)
    storage = OmegaConf.select(cfg, "train.checkpoint_storage", default="shared")
    if storage not in STORAGES:
        raise ConfigError(f"train.checkpoint_storage={storage!r} is not one of {', '.join(STORAGES)}: shared (one run "
                          f"directory every host sees) or local (each host its own disk)")


STORAGES = ("shared", "local")  # train.checkpoint_storage
BACKENDS = ("nccl", "gloo", "mpi", "ucc")
RESUME_WORDS = ("auto", "none", "never", "latest", "")  # train.resume values that are not paths


def check_comm(comm: Any) -> None:
    """Deadlines must be positive, and the first step's at least the steady one.

    Raises:
        ConfigError: naming the key and a value that works.
    """
    if not (isinstance(comm.recvs_ahead, bool) or comm.recvs_ahead == "auto"):
        raise ConfigError(f"comm.recvs_ahead={comm.recvs_ahead!r} must be true, false or auto (default auto)")
    if comm.dynamic_shapes and comm.variable_shapes:
        raise ConfigError("comm.dynamic_shapes and comm.variable_shapes are both true; variable_shapes already "
                          "learns every micro-batch's shapes at every step: set comm.dynamic_shapes=false")
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
    data_path = OmegaConf.select(cfg, "data.path")
    if cfg.data.name == "text" and data_path is not None and not os.path.isfile(data_path):
        raise ConfigError(f"data.path={data_path!r} is not a file; point data.path at a local text file")
    schedule_path = OmegaConf.select(cfg, "schedule.path")
    if cfg.schedule.name == "custom" and schedule_path is not None and not os.path.isfile(schedule_path):
        raise ConfigError(
            f"schedule.path={schedule_path!r} is not a file; schedule=custom needs a file of actions "
            f"per rank (see pipeflow/schedules/custom.py)"
        )
    resume = OmegaConf.select(cfg, "train.resume", default=None)
    if isinstance(resume, str) and resume.lower() not in RESUME_WORDS and not os.path.exists(resume):
        raise ConfigError(
            f"train.resume={resume!r} does not exist; give an existing checkpoint, "
            f"train.resume=auto (the last good checkpoint of the run directory) or leave it unset"
        )
