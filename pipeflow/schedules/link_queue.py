"""Transfers that queue on their link: a directed pair of ranks sends one message after the other,
a burst at line rate, the rest at the link's sustained rate (a token bucket, as ``tc tbf`` and a
switch's buffers behave).  The simulator's engine (:mod:`~pipeflow.schedules.sim_engine`) asks
:class:`LinkQueues` when each transfer ends, in channel order.
"""
from __future__ import annotations

from dataclasses import dataclass

Channel = tuple[int, int]  # (src rank, dst rank)


@dataclass(frozen=True)
class Bucket:
    """A link whose transfers queue on it and that passes a burst at line rate (a token bucket,
    as ``tc tbf`` and many switches' buffers behave; with no burst, a link that serializes its
    transfers at its sustained rate).

    A transfer of n bytes starts once both sides are posted and the link has sent what was queued
    before it; the bytes covered by the tokens then cost the transfer's own seconds (the
    runtime's ``transfer``: latency plus the line rate), the rest ``per_byte_s`` each (the
    sustained rate), refilling the tokens at that rate up to ``burst_bytes``.

    Attributes:
        nbytes: the transfer's bytes.
        per_byte_s: the sustained seconds per byte.
        line_per_byte_s: seconds per byte within the burst (what ``transfer`` charges).
        burst_bytes: the tokens a full bucket holds.
    """

    nbytes: float
    per_byte_s: float
    line_per_byte_s: float = 0.0
    burst_bytes: float = 0.0


class LinkQueues:
    """Each channel's link: when it is free, and the tokens its bucket held then."""

    def __init__(self) -> None:
        self.state: dict[Channel, tuple[float, float]] = {}  # (free at, tokens then)

    def through(self, channel: Channel, bucket: Bucket, start: float, transfer_s: float) -> float:
        """When a transfer ready at `start` ends on `channel`'s link: it begins once the link has
        sent what queued before it, its bytes within the tokens cost `transfer_s` (the runtime's
        transfer: latency and line rate), the rest the sustained rate; tokens refill at that rate."""
        free, tokens = self.state.get(channel, (0.0, bucket.burst_bytes))
        begin = max(start, free)
        if bucket.per_byte_s > 0:
            tokens = min(bucket.burst_bytes, tokens + (begin - free) / bucket.per_byte_s)
        excess = max(0.0, bucket.nbytes - tokens)
        queued = excess * bucket.per_byte_s  # how long the link sends at its sustained rate
        self.state[channel] = (begin + queued, max(0.0, tokens - bucket.nbytes))
        return begin + transfer_s + excess * max(0.0, bucket.per_byte_s - bucket.line_per_byte_s)
