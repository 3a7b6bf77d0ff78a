"""Data: locally made batches (synthetic, text files), token files on disk (tokens.py; prepare.py
makes them) and torchvision image sets, identical on every rank, and the split of a global batch
into shards and micro-batches."""
from pipeflow.data.batches import (
    IMAGE_DATA, TOKEN_DATA, Batches, build_batches, loss_counts, microbatch_counts, microbatch_inputs,
    microbatch_targets, sequence_lengths, shard, split_microbatches, varies,
)

__all__ = [
    "IMAGE_DATA", "TOKEN_DATA", "Batches", "build_batches", "loss_counts", "microbatch_counts", "microbatch_inputs",
    "microbatch_targets", "sequence_lengths", "shard",
    "split_microbatches", "varies",
]
