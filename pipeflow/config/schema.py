"""Typed configuration: dataclass schemas registered in Hydra's ConfigStore, checked once at start.

YAML files under ``configs/`` hold the values; these dataclasses are their schemas (types and
defaults), so a typo in an override (``pipeline.num_microbatch=4``) fails at once, with the
nearest keys named (:mod:`pipeflow.config.keys`), and an old key name read as its new one
(:mod:`pipeflow.config.renames`).  Each section checks itself in ``__post_init__`` when
:func:`typed_config` makes the composed config typed objects (once, at start); the checks that
span sections are :mod:`pipeflow.config.checks`, the model schemas
:mod:`pipeflow.config.models`, one schema per data source :mod:`pipeflow.config.data`,
the closed sets of words :mod:`pipeflow.config.choices`; their names are importable from here too.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from pipeflow.errors import ConfigError
from pipeflow.observability.trackers import chosen_trackers
from pipeflow.config.checks import (BACKENDS, DTYPES, RESUME_WORDS, SHARD_MODES, STORAGES, auto_replicas,
                                        check_comm, check_across_sections, check_paths, check_sequence_parallel,
                                        check_targets, resolve_layout, tensor_degree)
from pipeflow.config.choices import (SPIKE_ACTIONS, Backend, Balance, CheckpointMode, CheckpointStorage, Choice,
                                     DropoutRng, OffloadMode, Overlong, ParamDtype, Placement, Precision, RecvPosting,
                                     SaveErrorAction, ShapeMode, ShardMode, SplitSearch, TextLevel, TokenDtype)
from pipeflow.config.data import (DATA_SCHEMAS, ChatDataConfig, Cifar10DataConfig, DataConfig, FakeDataConfig,
                                      FileDataConfig, GaussianDataConfig, ImageDataConfig, ImageFolderDataConfig,
                                      MarkovDataConfig, MnistDataConfig, TextDataConfig, TokenDataConfig,
                                      TokensDataConfig, check_data_links, schema_node, typed_data)
from pipeflow.config.keys import config_keys, install_key_suggestions, suggest_keys
from pipeflow.config.models import (GPTModelConfig, HFModelConfig, MLPModelConfig, ModuleModelConfig,
                                        ResNetModelConfig, SleepModelConfig, TorchvisionModelConfig, model_schema)
from pipeflow.config.values import check_section_counts
from pipeflow.runtime.parallel.mesh_order import parse_order
from pipeflow.schedules.offload import check_mode


@dataclass
class ScheduleConfig:
    """Which pipeline schedule runs (``schedule=1f1b``, ``schedule=zbv``, ... or ``schedule=custom``)
    and its own settings; each ``configs/schedule/<name>.yaml`` sets those it takes."""

    name: str = "1f1b"
    path: str | None = None  # schedule=custom: the file of actions per rank
    stages_per_rank: int | None = None  # model chunks per rank (v); None: the schedule's own
    placement: Placement | None = None  # loop | v: which stages a rank holds; None: the schedule's own
    stage_to_rank: list[int] | None = None  # explicit placement: pipeline rank of each stage
    # schedule=auto: the activations a rank may hold, in micro-batches of a rank's share; null: p (1F1B's)
    max_inflight_microbatches: float | None = None

    def __post_init__(self) -> None:
        """Checked when the composed config becomes this object (:func:`typed_config`)."""
        check_section_counts("schedule", self)
        limit = self.max_inflight_microbatches
        if limit is not None and limit < 1:
            raise ConfigError(f"schedule.max_inflight_microbatches={limit} must be at least 1 (micro-batches of a "
                              "rank's share), or null for 1F1B's p")


@dataclass
class PipelineConfig:
    """How the batch is split and where layers go."""

    num_microbatches: int = 8
    split_points: list[Any] | None = None  # first layer (index or name) of stages 1..S-1
    balance: Balance = Balance.uniform  # uniform | params | time | memory (ignored with split_points)
    profile: bool = True  # profile layers (on pipeline rank 0) for the partition table
    checkpoint_activations: Any = False  # true | false | n: recompute every n-th layer in backward
    offload: OffloadMode = OffloadMode.none  # none | auto | all: held activations copied to host memory in the pipeline's gaps
    overlap_pairs: bool = True  # dualpipev: each paired F and B run interleaved, one's all_to_all behind the other's compute

    def __post_init__(self) -> None:
        """Checked when the composed config becomes this object (:func:`typed_config`)."""
        from pipeflow.runtime.precision import checkpoint_every  # torch-heavy: only when checking

        check_section_counts("pipeline", self)
        checkpoint_every(self.checkpoint_activations)
        check_mode(self.offload)


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
class BatchRampConfig:
    """``train.batch_ramp``: the global batch grows from ``start`` by ``increment`` samples over the
    first ``samples`` samples to ``data.batch_size`` (Megatron's ``rampup_batch_size``); unset: no ramp."""

    start: int | None = None  # the first steps' global batch (samples); null: no ramp
    increment: int | None = None  # samples added at each growth
    samples: int | None = None  # samples trained by the time the batch is full

    @property
    def on(self) -> bool:
        """Whether the run ramps its batch."""
        return self.start is not None

    def __post_init__(self) -> None:
        """All three keys or none."""
        given = {key: getattr(self, key) for key in ("start", "increment", "samples")}
        if any(v is not None for v in given.values()) and any(v is None for v in given.values()):
            missing = ", ".join(f"train.batch_ramp.{k}" for k, v in given.items() if v is None)
            raise ConfigError(f"train.batch_ramp needs start, increment and samples; {missing} is not set")


@dataclass
class SpikeConfig:
    """``train.spike``: a step whose loss or gradient norm rises far above the recent steps'
    (pipeflow/run/spikes.py); the same judgement on every rank, before the optimizer step."""

    action: str = "warn"  # off | warn (log it) | skip (drop its update) | rollback (to the last checkpoint, skipping its batches)
    window: int = 50  # recent accepted steps the median and deviation are taken over
    threshold: float = 6.0  # robust deviations (1.4826 x median absolute deviation) above the median
    min_rise: float = 0.1  # and at least this fraction above the median
    max_rollbacks: int = 3  # action=rollback: then stop with LossSpikeError

    def __post_init__(self) -> None:
        """Checked when the composed config becomes this object."""

        if self.action not in SPIKE_ACTIONS:
            raise ConfigError(f"train.spike.action={self.action!r} is unknown; valid: {', '.join(SPIKE_ACTIONS)}")
        if self.window < 2 or self.threshold <= 0 or self.min_rise < 0 or self.max_rollbacks < 0:
            raise ConfigError(f"train.spike: window={self.window} must be >= 2, threshold={self.threshold} > 0, "
                              f"min_rise={self.min_rise} >= 0 and max_rollbacks={self.max_rollbacks} >= 0")


@dataclass
class TrainConfig:
    """The loop: how long, how often to log and evaluate, where to write."""

    max_steps: int = 300
    log_every: int = 25  # steps per log interval: the console's step line, TensorBoard's and the trackers' points
    eval_every: int = 100
    eval_batches: int = 4
    param_dtype: ParamDtype = ParamDtype.float32  # parameters, gradients and optimizer state (the master weights)
    run_dir: str | None = None  # default: an explicit hydra.run.dir, else outputs/<timestamp>; chosen by rank 0
    precision: Precision = Precision.fp32  # the autocast compute dtype (fp32: none); weights stay in train.param_dtype
    save_every: int = 0  # write a checkpoint every n steps (and at the end); 0: never
    # keep only the K newest complete checkpoints (and pinned ones: python -m pipeflow.checkpoint pin); null: all
    keep_last: int | None = None
    # shared: one run directory every host sees; local: each host its own disk, each writes its
    # ranks' part (python -m pipeflow.checkpoint gather merges them); docs/guides/multinode.md "Storage"
    checkpoint_storage: CheckpointStorage = CheckpointStorage.shared
    checkpoint_replicas: int = 1  # local storage: hosts that hold each part (K - 1 may be lost)
    checkpoint_mode: CheckpointMode = CheckpointMode.sync  # sync | async (a thread writes) | async_process
    on_save_error: SaveErrorAction = SaveErrorAction.stop  # a failed background save: stop, or warn and go on
    resume: str | None = None  # a checkpoint dir, a checkpoints root, or "auto" (<run_dir>/checkpoints)
    # the global batch ramped up from start samples (each size whole micro-batches; lr and token
    # counts follow samples): docs/guides/long-run.md
    batch_ramp: BatchRampConfig = field(default_factory=BatchRampConfig)
    spike: SpikeConfig = field(default_factory=SpikeConfig)  # loss spikes: warn, skip the step, or roll back
    dropout_rng: DropoutRng = DropoutRng.sample  # sample: keyed by sample and layer, alike on any layout; rank: by rank
    check_finite: bool = False  # stop at the first NaN/Inf loss or gradient, naming the stage (fp16 overflow: skipped)
    # signals that save a checkpoint at the next step boundary and end the job (exit code 75): a
    # scheduler's before it kills a job, Ctrl-C (again 5 s later: quit unsaved); [] or null: off
    save_on_signal: Any = field(default_factory=lambda: ["SIGTERM", "SIGINT"])  # a name, a list of names, or false
    # torch.compile each layer (its forward and its backward; split-backward schedules compute B
    # and W once each); docs/guides/compile.md
    compile: bool = False
    compile_mode: str = "default"  # default | max-autotune-no-cudagraphs (CUDA-graph modes are refused)
    compile_backend: str = "inductor"  # inductor | aot_eager (the same graphs, no code generated: tests, debugging)

    def __post_init__(self) -> None:
        """Checked when the composed config becomes this object (:func:`typed_config`)."""
        from pipeflow.runtime.compile import check_options  # torch-heavy: only when checking
        from pipeflow.runtime.precision import compute_dtype

        check_section_counts("train", self)
        if self.param_dtype not in DTYPES:
            raise ConfigError(f"train.param_dtype={self.param_dtype!r} is not one of {', '.join(DTYPES)}")
        compute_dtype(self.precision)
        if self.checkpoint_storage not in STORAGES:
            raise ConfigError(f"train.checkpoint_storage={self.checkpoint_storage!r} is not one of "
                              f"{', '.join(STORAGES)}: shared (one run directory every host sees) or local (each "
                              "host its own disk)")
        check_options(self.compile_mode, self.compile_backend)
        if self.checkpoint_replicas < 1 or (self.checkpoint_replicas > 1 and self.checkpoint_storage != "local"):
            raise ConfigError(f"train.checkpoint_replicas={self.checkpoint_replicas}: how many hosts hold each host's "
                              "part of a train.checkpoint_storage=local checkpoint (its own disk and the next hosts'): "
                              "1 or more, and more than 1 only with train.checkpoint_storage=local")
        if self.checkpoint_mode == "async_process" and self.checkpoint_storage == "local":
            raise ConfigError("train.checkpoint_mode=async_process writes through one writer process per rank on a "
                              "group of the whole job, which cannot write each host's own part: with "
                              "train.checkpoint_storage=local use train.checkpoint_mode=async (a background thread)")


@dataclass
class ParallelConfig:
    """The process layout: ``parallel.dp`` x ``parallel.pp`` x ``parallel.cp`` x ``parallel.tp`` = world size."""

    dp: Any = 1  # replicas; auto: world size / (pp x tp), so one command fits any node count (needs pp)
    pp: Any = None  # default: world size / (dp x tp); auto: replan's
    # what each stage's data-parallel group shards: none (full replicas), optimizer (ZeRO-1:
    # AdamW state and update), full (FSDP2: parameters and gradients too)
    shard: ShardMode = ShardMode.none
    # tensor parallel: each stage's layers split over tp ranks (innermost: a node's GPUs); auto: replan's
    tp: Any = 1
    # with tp > 1: norms, dropout and the activations between stages sharded along the sequence
    sequence_parallel: bool = False
    # the mesh's dimensions outermost first (the innermost's groups are consecutive ranks: one
    # host's), e.g. [pp,dp,tp]; auto: the order with the fastest predicted step on the links
    # measured at start ([dp,pp,tp] on one host)
    order: Any = "auto"
    # expert parallelism (model.moe): each stage's experts split over its dp ranks; 1 or parallel.dp
    ep: int = 1
    # context parallelism: each sequence split over cp ranks (two chunks each, head and tail), every
    # attention layer passing key/value blocks round their ring; just outside tp unless the order names cp
    cp: int = 1
    replan: bool = False  # at each start, the auto degrees for the world that met

    def __post_init__(self) -> None:
        """Checked when the composed config becomes this object (:func:`typed_config`)."""
        check_section_counts("parallel", self)
        if self.shard not in SHARD_MODES:
            raise ConfigError(f"parallel.shard={self.shard!r} is unknown; valid: {', '.join(SHARD_MODES)} "
                              "(none: full replicas, optimizer: ZeRO-1, full: FSDP2)")
        parse_order(self.order)


@dataclass
class CommConfig:
    """Point-to-point communication."""

    timeout_s: float = 300.0
    first_step_timeout_s: float = 900.0
    join_timeout_s: float = 120.0  # every rank must have joined the process group by then (ranks missing are named)
    # what the stages tell each other of the tensors they send: static (learnt at the first step),
    # per_step (relearnt when stage 0's input shape changes; one broadcast per step) or
    # per_microbatch (every micro-batch its own shapes; one small message per stage boundary per
    # step; chosen by itself with data.variable_lengths or a batch that does not split evenly)
    shapes: ShapeMode = ShapeMode.static
    # gloo: post the next step's recvs before computing (ahead), at their own step (at_step), or
    # time both over the first training steps and keep the faster (auto)
    post_recvs: RecvPosting = RecvPosting.auto

    def __post_init__(self) -> None:
        """Checked when the composed config becomes this object (:func:`typed_config`)."""
        check_comm(self)


@dataclass
class DistConfig:
    """Backend and device; default: NCCL on ``cuda:LOCAL_RANK`` when CUDA is present, else gloo/CPU."""

    backend: Backend | None = None  # null: nccl with CUDA, else gloo
    device: str | None = None

    def __post_init__(self) -> None:
        """Checked when the composed config becomes this object (:func:`typed_config`)."""
        if self.backend is not None and self.backend not in BACKENDS:
            raise ConfigError(f"dist.backend={self.backend!r} is unknown; valid: {', '.join(BACKENDS)} (or null: "
                              "automatic)")


@dataclass
class MetricsConfig:
    """What is measured and written: TensorBoard under ``<run_dir>/tb``, traces of chosen steps
    (``<run_dir>/trace.json``, ``timeline_step<N>.png``), the console progress bar."""

    tensorboard: bool = True  # <run_dir>/tb: loss, lr, grad norm, throughput, per-stage times, bubble, memory; false: removed from trackers
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
    # where the run's figures go (rank 0): any of tensorboard (<run_dir>/tb), wandb (WANDB_MODE,
    # WANDB_PROJECT respected), mlflow (MLFLOW_TRACKING_URI, else <run_dir>/mlflow.db); a resumed
    # run continues the same tracker runs (<run_dir>/trackers.json)
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    project: str | None = None  # the W&B project and MLflow experiment; null: WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME, else pipeflow
    # a rank whose compute, or a link whose transfers, run this many times their own prediction
    # for 2 log intervals is named while it happens (pipeflow/observability/stragglers.py); null: off
    straggler_factor: float | None = 1.5

    def __post_init__(self) -> None:
        """Checked when the composed config becomes this object (:func:`typed_config`)."""
        check_section_counts("metrics", self)
        chosen_trackers(self.trackers, self.tensorboard)
        if self.straggler_factor is not None and self.straggler_factor <= 1.0:
            raise ConfigError(f"metrics.straggler_factor={self.straggler_factor} must be above 1 (times a rank's or "
                              f"link's own prediction), or null to watch for no stragglers")


@dataclass
class PlanConfig:
    """The planner, ``python -m pipeflow.plan`` (see pipeflow/plan.py); train.py ignores it."""

    top: int = 10  # layouts printed
    memory_limit_gb: float | None = None  # per pipeline rank; null: no limit
    schedules: list[str] | None = None  # null: every built-in schedule
    microbatches: list[int] | None = None  # null: every count that divides data.batch_size
    max_chunks: int = 4  # stages per rank tried by schedules that take any count
    splits: SplitSearch = SplitSearch.balanced  # balanced (time, memory, uniform) | all (every split; small models)
    comm_latency_ms: float | None = None  # per communicating step; null: measured (2 local processes)
    action_overhead_ms: float | None = None  # the runtime's own cost per F/B/W action; null: measured
    repeats: int = 5  # timed runs per layer when profiling
    optimizer_factor: float = 2.0  # optimizer state bytes per parameter byte (AdamW: 2)
    csv: str | None = None  # also write every simulated layout to this CSV file
    # a run directory (its costs.json): rank layouts with what that run measured; with plan.hardware,
    # its links timed at start and per-layer profile replace the preset's figures (docs/guides/cluster-planning.md)
    calibration: str | None = None
    rehearse: int = 0  # CPU hosts: build the k fastest layouts as train.py would and re-rank them by their rehearsed step
    # tensor-parallel sizes searched beside the schedules (each pick: parallel.tp=N, dp x pp x N processes);
    # null: parallel.tp alone.  Their collectives are costed over this link (a node's NVLink by default)
    tp_sizes: list[int] | None = None
    # the link tp's collectives are costed over: null takes plan.hardware's link within a host,
    # else 150 GB/s and 10 us (an NVLink-class node); set, they override plan.hardware's
    tp_bandwidth_gbps: float | None = None
    tp_latency_us: float | None = None
    # context-parallel sizes searched (docs/guides/long-context.md); null: parallel.cp, doubled while nothing fits
    cp_sizes: list[int] | None = None
    # pipeline.offload modes tried with every layout (none | auto | all), their copies over a
    # device-host link of this bandwidth each way, on a copy engine beside compute (a GPU's PCIe);
    # null: measured on this machine's device as train.py measures it (a CPU: memcpys on the compute thread)
    offload_modes: list[OffloadMode] = field(default_factory=lambda: [OffloadMode.none])
    host_link_gbps: float | None = None
    # a cluster you do not have (docs/guides/cluster-planning.md): a preset (a100_sxm_80gb, h100_sxm, h200_sxm, b200) or a
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


# the sections typed_config makes objects of: every one but model (typed by its builder's signature)
SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(Config)  # type: ignore[misc]
                             if f.name != "model"}


def typed_config(cfg: Any) -> Config:
    """The composed config as typed objects, each section checked once by its ``__post_init__``
    (OmegaConf does not run it while composing): ``cfg.train`` a :class:`TrainConfig`, ...;
    ``model`` stays as composed (its schema is its builder's signature).  An untyped section (a
    user's YAML read without the schemas) is merged onto its schema first.

    Raises:
        ConfigError: naming the key, its value and what to change.
    """
    sections: dict[str, Any] = {}
    for name, schema in SECTIONS.items():
        try:
            if name == "data":  # each source its own schema (pipeflow.config.data)
                sections[name] = typed_data(cfg[name] if name in cfg else schema_node(DataConfig))
                continue
            if name in cfg and OmegaConf.get_type(cfg[name]) is schema:  # composed on its schema: typed
                sections[name] = OmegaConf.to_object(cfg[name])  # already (a tenth of a merge's time)
                continue
            node = schema_node(schema)
            if name in cfg:  # resolved where it stands: an interpolation may name another section
                node = OmegaConf.merge(node, OmegaConf.to_container(cfg[name], resolve=True, throw_on_missing=True))
            sections[name] = OmegaConf.to_object(node)
        except MissingMandatoryValue as exc:
            key = str(exc.full_key)
            key = key if key.startswith(f"{name}.") else f"{name}.{key}"
            raise ConfigError(f"{key} is not set (???): give it a value, {key}=<value>") from exc
    check_data_links(cfg)
    return Config(model=OmegaConf.select(cfg, "model", throw_on_missing=False), **sections)


def check_values(cfg: Any) -> Config:
    """The checks that need neither the world size nor a process group: every section's own
    (counts, deadlines, dtypes, modes; each section's ``__post_init__``), run once by making the
    composed config typed objects (:func:`typed_config`).  ``train.py`` runs them before joining,
    so a bad ``comm.join_timeout_s`` is named as such, not as a rank that never arrived.

    Raises:
        ConfigError: naming the key, its value and the values allowed.
    """
    return typed_config(cfg)


def check_config(cfg: Any, world_size: int) -> tuple[int, int]:
    """Check what can be checked before anything is built: each section's values
    (:func:`check_values`), then what spans sections (:func:`check_across_sections`); returns (dp, pp).

    Raises:
        ConfigError: naming the key and what to change.
    """
    check_values(cfg)
    return check_across_sections(cfg, world_size)


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
    for source, data_schema in DATA_SCHEMAS.items():  # data=<source>: configs/data/<source>.yaml names base_<source>
        cs.store(group="data", name=f"base_{source}", node=data_schema)


__all__ = [  # the schemas, and the checks and key helpers read from here by their callers
    "BACKENDS", "Backend", "Balance", "CheckpointStorage", "Choice", "OffloadMode", "Overlong", "ParamDtype",
    "Precision", "ShardMode", "SplitSearch", "TextLevel", "TokenDtype", "ChatDataConfig", "Cifar10DataConfig", "CommConfig", "Config", "DATA_SCHEMAS", "DTYPES",
    "DataConfig", "DistConfig", "FakeDataConfig", "FileDataConfig", "GPTModelConfig", "GaussianDataConfig",
    "ImageDataConfig", "ImageFolderDataConfig", "MarkovDataConfig", "MnistDataConfig", "TextDataConfig",
    "TokenDataConfig", "TokensDataConfig",
    "HFModelConfig", "MLPModelConfig", "MetricsConfig", "ModuleModelConfig", "OptimConfig", "ParallelConfig",
    "PipelineConfig", "Placement", "PlanConfig", "RESUME_WORDS", "RecvPosting", "ResNetModelConfig", "SHARD_MODES",
    "STORAGES", "ScheduleConfig", "ShapeMode", "SleepModelConfig", "TorchvisionModelConfig", "TrainConfig",
    "auto_replicas", "check_across_sections", "check_comm", "check_config", "check_paths", "check_sequence_parallel", "check_targets",
    "check_values", "config_keys", "install_key_suggestions", "model_schema", "register_configs", "resolve_layout",
    "suggest_keys", "tensor_degree", "typed_config", "typed_data",
]
