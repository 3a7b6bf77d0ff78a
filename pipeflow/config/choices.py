"""The closed sets of words some config keys take (``comm.shapes=per_step``): Enums that Hydra
checks while composing, naming the allowed words, and that compare equal to their word."""
from __future__ import annotations

from enum import Enum


SPIKE_ACTIONS = ("off", "warn", "skip", "rollback")  # train.spike.action (pipeflow/run/spikes.py)


class Choice(str, Enum):
    """A config key's closed set of words (``comm.shapes=per_step``): compares equal to its word,
    prints as it, and Hydra refuses any other word naming the allowed ones."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class ShapeMode(Choice):
    """``comm.shapes``: how often the stages learn the shapes of what they receive."""

    static = "static"
    per_step = "per_step"
    per_microbatch = "per_microbatch"


class Placement(Choice):
    """``schedule.placement``: which stages a rank holds (loop: r, r+p, ...; v: r and 2p-1-r)."""

    loop = "loop"
    v = "v"


class RecvPosting(Choice):
    """``comm.post_recvs`` (gloo): when a step's recvs are posted."""

    ahead = "ahead"
    at_step = "at_step"
    auto = "auto"


class TextLevel(Choice):
    """``data.level`` (data=text): a token per byte (vocabulary 256) or per character of the file."""

    byte = "byte"
    char = "char"


class TokenDtype(Choice):
    """``data.token_dtype`` (data=tokens): the dtype of headerless token files (.npy carry their own)."""

    uint16 = "uint16"
    uint32 = "uint32"


class Overlong(Choice):
    """``data.overlong`` (data=chat): what a conversation longer than a row becomes."""

    drop = "drop"
    truncate = "truncate"
    error = "error"


class ParamDtype(Choice):
    """``train.param_dtype``: the dtype of parameters, gradients and optimizer state."""

    float32 = "float32"
    float64 = "float64"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Precision(Choice):
    """``train.precision``: the autocast compute dtype (fp32: none)."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class CheckpointStorage(Choice):
    """``train.checkpoint_storage``: one run directory every host sees, or each host its own disk."""

    shared = "shared"
    local = "local"


# made by call: "async" is a keyword, and Hydra takes a member by its name
CheckpointMode = Choice("CheckpointMode", [(word, word) for word in ("sync", "async", "async_process")])
CheckpointMode.__doc__ = "``train.checkpoint_mode``: write checkpoints while training waits, or in the background."


class DropoutRng(Choice):
    """``train.dropout_rng``: dropout masks keyed by sample and layer (any layout, the same
    masks), or drawn from each rank's own generator."""

    sample = "sample"
    rank = "rank"


class SaveErrorAction(Choice):
    """``train.on_save_error``: what a failed background save does to training."""

    stop = "stop"
    warn = "warn"


class ShardMode(Choice):
    """``parallel.shard``: what a stage's data-parallel group shards (none, ZeRO-1, FSDP2)."""

    none = "none"
    optimizer = "optimizer"
    full = "full"


class Backend(Choice):
    """``dist.backend``: the process group's backend (null: NCCL with CUDA, else gloo)."""

    nccl = "nccl"
    gloo = "gloo"
    mpi = "mpi"
    ucc = "ucc"


class Balance(Choice):
    """``pipeline.balance``: what the partition evens out over the stages."""

    uniform = "uniform"
    params = "params"
    time = "time"
    memory = "memory"


class OffloadMode(Choice):
    """``pipeline.offload`` (and ``plan.offload_modes``): which held activations go to host memory."""

    none = "none"
    auto = "auto"
    all = "all"


class SplitSearch(Choice):
    """``plan.splits``: the stage splits the planner tries."""

    balanced = "balanced"
    all = "all"
