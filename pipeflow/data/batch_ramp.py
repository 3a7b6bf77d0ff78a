"""Batch-size ramp-up (``train.batch_ramp``), with Megatron's ``rampup_batch_size`` semantics: the
global batch starts at ``start`` samples and grows by ``increment`` each time another
``samples / ((data.batch_size - start) / increment)`` samples have been trained, reaching
``data.batch_size`` once ``samples`` have.

Every size is a whole number of the full batch's micro-batches (a micro-batch keeps its rows; a
size runs fewer of them), so step k's batch is the one a run of that size would train: a step
draws its samples as a source of that batch size does (:meth:`RampedBatches.get`), the learning
rate follows the samples trained (:meth:`BatchRamp.position`), and the whole ramp is a function
of the step, so a checkpoint resumes mid-ramp exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeflow.errors import ConfigError


@dataclass
class BatchRamp:
    """The ramp of one run: sizes in samples, and the micro-batches each size is.

    Args:
        start, increment, samples: ``train.batch_ramp``'s keys.
        full: ``data.batch_size``, the global batch once ramped.
        dp: the replicas (each runs the same number of micro-batches).
        microbatches: ``pipeline.num_microbatches``, each replica's at the full batch.
    """

    start: int
    increment: int
    samples: int
    full: int
    dp: int
    microbatches: int
    _consumed: list[int] = field(default_factory=lambda: [0], init=False, repr=False)

    def __post_init__(self) -> None:
        unit = self.rows * self.dp  # one more micro-batch on every replica
        if not 0 < self.start < self.full or self.increment < 1 or self.samples < 1:
            raise ConfigError(f"train.batch_ramp: start={self.start}, increment={self.increment}, samples="
                              f"{self.samples} must be 0 < start < data.batch_size={self.full}, increment >= 1 and "
                              f"samples >= 1")
        if (self.full - self.start) % self.increment:
            raise ConfigError(f"train.batch_ramp: data.batch_size={self.full} - start={self.start} is no multiple of "
                              f"increment={self.increment}: the ramp would not end at the full batch; pick an "
                              f"increment that divides {self.full - self.start}")
        odd = [size for size in self.sizes() if size % unit]
        if odd:
            raise ConfigError(
                f"train.batch_ramp: batch sizes {odd} are no whole number of micro-batches on each of dp={self.dp} "
                f"replicas (a micro-batch: {self.rows} samples, data.batch_size={self.full} over dp x "
                f"pipeline.num_microbatches={self.dp * self.microbatches}); start and increment must be multiples "
                f"of {unit}")

    @property
    def rows(self) -> int:
        """Samples in one micro-batch of one replica, the same at every size."""
        return self.full // (self.dp * self.microbatches)

    def sizes(self) -> list[int]:
        """Every batch size of the ramp, the full one last."""
        return list(range(self.start, self.full + 1, self.increment))

    def size_after(self, consumed: int) -> int:
        """The global batch once `consumed` samples have been trained (Megatron's rule)."""
        if consumed > self.samples:
            return self.full
        per_increment = self.samples / ((self.full - self.start) // self.increment)
        return min(self.full, self.start + int(consumed // per_increment) * self.increment)

    def consumed_before(self, step: int) -> int:
        """Samples trained by steps 0 .. `step` - 1."""
        while len(self._consumed) <= step:
            done = self._consumed[-1]
            self._consumed.append(done + self.size_after(done))
        return self._consumed[step]

    def size(self, step: int) -> int:
        """The global batch of step `step`."""
        return self.size_after(self.consumed_before(step))

    def microbatches_at(self, step: int) -> int:
        """Micro-batches each replica runs at step `step`."""
        return self.size(step) // (self.rows * self.dp)

    def position(self, step: int) -> float:
        """Step `step` in full batches trained before it: the learning-rate schedule's step."""
        return self.consumed_before(step) / self.full

    def steps_to(self, size: int) -> int:
        """The first step that trains `size` samples (a size of the ramp)."""
        step = 0
        while self.size(step) < size:
            step += 1
        return step

    def describe(self) -> str:
        """``4 -> 8 -> 12 -> 16 samples (micro-batches per replica 1 -> 2 -> 3 -> 4) from steps 0, 2, 3, 4``."""
        sizes = self.sizes()
        return (f"{' -> '.join(map(str, sizes))} samples (micro-batches per replica "
                f"{' -> '.join(str(s // (self.rows * self.dp)) for s in sizes)}) from steps "
                f"{', '.join(str(self.steps_to(s)) for s in sizes)}; full after {self.samples} samples")


def lr_position_end(ramp: BatchRamp | None, max_steps: int) -> float:
    """The learning-rate schedule's last step: ``train.max_steps`` in full batches trained (without
    a ramp: ``max_steps``)."""
    return float(max_steps) if ramp is None else ramp.position(max_steps)


class RampedBatches:
    """A training source under a ramp: ``get(step)`` is ``source.take(step, consumed, size)``, the
    batch of step `step`'s size that follows the samples trained before it."""

    def __init__(self, source: Any, ramp: BatchRamp) -> None:
        if not hasattr(source, "take"):
            raise ConfigError(f"train.batch_ramp: the training data ({type(source).__name__}) cannot give a batch of "
                              f"another size (it has no take(step, start, count)); drop train.batch_ramp or give the "
                              f"source that method")
        self.source, self.ramp = source, ramp
        self.batch_size = ramp.full

    def get(self, step: int) -> Any:
        """Batch `step`: ``ramp.size(step)`` samples."""
        return self.source.take(step, self.ramp.consumed_before(step), self.ramp.size(step))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)
