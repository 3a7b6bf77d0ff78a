"""Every error pipeflow raises, in one place.

Messages say what was wrong, where (rank, stage, micro-batch, action) and how to fix it.
"""
from __future__ import annotations


class PipeflowError(Exception):
    """Base class of all pipeflow errors."""


class ConfigError(PipeflowError, ValueError):
    """The configuration is invalid; the message names the key and what to change."""


class PartitionError(ConfigError):
    """Layers cannot be split into stages as asked (split points, stage count)."""


class ScheduleError(PipeflowError, ValueError):
    """A schedule or program is malformed: missing, duplicated or misordered actions."""


class DeadlockError(ScheduleError):
    """The simulator found that the lowered programs cannot make progress.

    Attributes:
        grid: a step x rank text grid marking where each rank is stuck.
    """

    def __init__(self, message: str, grid: str = "") -> None:
        super().__init__(f"{message}\n{grid}" if grid else message)
        self.grid = grid


class CommError(PipeflowError, RuntimeError):
    """A point-to-point transfer failed; the message names rank, peer and action."""


class PipelineTimeoutError(CommError):
    """A batched P2P call did not complete within `comm.timeout_s`."""


class UnsendableDtypeError(CommError):
    """A tensor that must cross between ranks has a dtype NCCL cannot send (int16, ...)."""


class ShapeMismatchError(PipeflowError, RuntimeError):
    """A stage produced tensors whose shapes or dtypes differ from what was negotiated."""


class StageError(PipeflowError, RuntimeError):
    """A user's layer raised inside a stage; the message names rank, stage, micro-batch, action."""


class ConfigMismatchError(ConfigError):
    """Ranks were started with different configs; the message lists each differing key per rank."""


class StageOutOfMemoryError(StageError):
    """A stage ran out of device memory; the message gives memory figures and the knobs to turn."""


class NonFiniteError(PipeflowError, FloatingPointError):
    """NaN or Inf in a loss or gradient (always checked; ``train.check_finite`` adds per-layer checks); names the stage and step."""


class AllTargetsMaskedError(PipeflowError, ValueError):
    """Every target of a training step's batch is masked (the loss's ``ignore_index``, -100): the
    step has no loss to learn from.  The message names the step and the rank that found it (every
    rank that holds the batch raises it, before any transfer)."""


class ChatDataError(ConfigError):
    """``data=chat`` cannot use a conversation: a row without messages, a message without a role,
    a role the chat template rejects, a conversation longer than the sequence with
    ``data.overlong=error``; the message names the file and line and how to fix it."""


class CheckpointError(PipeflowError, RuntimeError):
    """A checkpoint cannot be used: damaged (digest mismatch), incomplete, unreadable or outside
    its folder; the message names the file and how to go on."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint's ``.metadata`` pickle names a class that checkpoint metadata never holds; it
    was refused before anything in it ran.  The message names the file and the refused class."""


class CheckpointPeerLostError(CheckpointError, CommError):
    """A collective save or load lost a peer (it died, was stopped, or hangs); the message names the
    checkpoint, its step, what the ranks were doing and the backend's words."""


class RunDirNotSharedError(ConfigError):
    """The job's hosts do not see one run directory (each its own disk) while
    ``train.checkpoint_storage=shared``; the message lists which hosts see what and the fix."""


class RunDirLockedError(PipeflowError, RuntimeError):
    """Another live job holds the run directory; the message names its host and pid."""


class RunDirLostError(RunDirLockedError):
    """This job's run directory, its lock or the checkpoints folder it saved into vanished, or the
    lock now belongs to another job (seen at a save, which is refused, or within seconds by rank 0's
    lock watch, which stops every rank at the next step); the message names the directory, what
    was found and what to do."""


class JoinTimeoutError(CommError):
    """Not every rank joined the process group within ``comm.join_timeout_s``; names the missing ranks."""


class LaunchError(PipeflowError, RuntimeError):
    """The launcher (``python -m pipeflow.launch``) cannot start this node: an endpoint that does
    not resolve, no route to it, an address other hosts cannot reach; the message names the fix."""


class LossSpikeError(PipeflowError, RuntimeError):
    """``train.spike.action=rollback`` rolled back ``train.spike.max_rollbacks`` times and the loss
    spiked again, or found no checkpoint to roll back to; the message names the step and the figure."""


class TrackerError(PipeflowError, RuntimeError):
    """A tracker of ``metrics.trackers`` (W&B, MLflow) is not installed or cannot start; raised on
    every rank before the first step, the message says what to install or set."""


class OffloadError(PipeflowError, RuntimeError):
    """``pipeline.offload``: a held activation was needed while it was on the host (its reload was
    never issued or not waited for), or a group was offloaded or reloaded twice; the message names
    the stage and micro-batch."""


class DeprecatedKeyWarning(FutureWarning):
    """A config key under its old name (an override, a YAML file, a saved run's ``config.yaml``):
    it still works; the message names the new key (docs/reference/renames.md lists every rename)."""


class CompileFallbackWarning(UserWarning):
    """``train.compile``: a layer (or a stage's layers) runs eager, and why (a graph break, an
    unsupported op, a torch without the compiled backward split)."""


class LoraError(ConfigError):
    """``model.lora`` cannot be applied as asked: its targets match no module, match an embedding or
    the output head (out of scope), or adapt fused expert weights on a layout they do not run with
    (ep, tp, shard=full); the message names the key, the modules and what to change."""
