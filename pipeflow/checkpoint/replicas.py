"""Host-local checkpoints that outlive their host: each part kept on other hosts too, and a
checkpoint assembled from what the hosts hold when the hosts changed.

With ``train.checkpoint_storage=local`` each host writes its own ranks' part of a checkpoint to
its own disk (:mod:`pipeflow.checkpoint.storage`).  A pipeline across hosts with no data-parallel copy
holds each stage on one host only, so a lost host takes its part along.  With
``train.checkpoint_replicas=K`` (K >= 2) each host's first rank, once its part is committed,
sends it to the first ranks of the next K - 1 hosts (in host order, wrapping round), which keep
it under ``<checkpoints>/replicas/<host>/step_<n>``, verified against the part's digests; a save
is reported (and ``latest`` pointed) only once every copy is in place.  Any K - 1 hosts may then
be lost.  The copies travel over a gloo group of the hosts' first ranks, a chunk at a time.

At a restart (``train.resume=auto``) on hosts other than those that saved — fewer after a loss,
more after a join, a layout re-planned (``parallel.replan``) — :func:`choose` takes the newest
step whose every part some host holds (its own or a copy), sends each part to every host that
lacks it, and each host merges them (:func:`pipeflow.checkpoint.gather.gather`) into
``<checkpoints>/assembled/step_<n>``: a whole checkpoint that every rank loads from, under any
layout, then removed.  On the hosts that saved, nothing is sent: each reads its own part.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from pipeflow.errors import CheckpointError
from pipeflow.checkpoint import integrity, retention
from pipeflow.checkpoint.find import META, candidates, read_meta, verify
from pipeflow.checkpoint.gather import gather
from pipeflow.checkpoint.storage import HostPart, choose_local, host_part

log = logging.getLogger("pipeflow")

REPLICAS = "replicas"  # <checkpoints>/replicas/<host>/step_<n>: another host's part, kept here
ASSEMBLED = "assembled"  # <checkpoints>/assembled/step_<n>: a whole checkpoint merged at a restart
CHUNK = 16 << 20  # bytes per message: a part of any size travels in pieces


def _listing(folder: str) -> list[tuple[str, int]]:
    """Every file of part `folder` (``meta.json`` last) with its size."""
    names = [*integrity.data_files(folder), META]
    return [(rel, os.path.getsize(os.path.join(folder, rel))) for rel in names]


def _chunks(listing: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """(file, offset, size) of each message that carries `listing`'s files."""
    return [(rel, at, min(CHUNK, size - at)) for rel, size in listing for at in range(0, size, CHUNK)]


def _read(folder: str, piece: tuple[str, int, int]) -> torch.Tensor:
    rel, at, size = piece
    with open(os.path.join(folder, rel), "rb") as f:
        f.seek(at)
        return torch.frombuffer(bytearray(f.read(size)), dtype=torch.uint8)


def _write(folder: str, piece: tuple[str, int, int], data: torch.Tensor) -> None:
    rel, at, _ = piece
    path = os.path.join(folder, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "r+b" if os.path.exists(path) else "wb") as f:
        f.seek(at)
        f.write(data.numpy().tobytes())


def _start(listing: list[tuple[str, int]], folder: str) -> None:
    """Empty files for `listing` in `folder` (a zero-byte file has no message)."""
    for rel, _ in listing:
        path = os.path.join(folder, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "wb").close()


def _header(listing: list[tuple[str, int]] | None) -> torch.Tensor:
    data = json.dumps(listing).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _p2p(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group: Any) -> None:
    ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in recvs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def pass_folder(send: str | None, dst: int | None, into: str | None, src: int | None, group: Any) -> None:
    """Send folder `send` to global rank `dst` while receiving into `into` the folder global rank
    `src` sends (either side may be None); both ranks' files travel in :data:`CHUNK` pieces."""
    out = _listing(send) if send is not None else []
    header = _header(out)
    size_in = torch.zeros(1, dtype=torch.int64)
    _p2p([(torch.tensor([header.numel()]), dst)] if send is not None else [],
         [(size_in, src)] if into is not None else [], group)
    header_in = torch.empty(int(size_in), dtype=torch.uint8)
    _p2p([(header, dst)] if send is not None else [], [(header_in, src)] if into is not None else [], group)
    listing_in = json.loads(header_in.numpy().tobytes()) if into is not None else []
    if into is not None:
        _start(listing_in, into)
    mine, theirs = _chunks(out), _chunks(listing_in)
    for k in range(max(len(mine), len(theirs))):
        buffer = torch.empty(theirs[k][2], dtype=torch.uint8) if k < len(theirs) else None
        _p2p([(_read(send, mine[k]), dst)] if k < len(mine) else [],  # type: ignore[arg-type]
             [(buffer, src)] if buffer is not None else [], group)
        if buffer is not None:
            _write(into, theirs[k], buffer)  # type: ignore[arg-type]


def _broadcast_folder(folder: str | None, src: int, into: str, group: Any) -> None:
    """Global rank `src` broadcasts `folder` to the group, whose other ranks write it into `into`."""
    sending = dist.get_rank() == src
    listing = _listing(folder) if sending else None  # type: ignore[arg-type]
    header = _header(listing) if sending else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([header.numel()], dtype=torch.int64)
    dist.broadcast(size, src, group=group)
    if not sending:
        header = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(header, src, group=group)
    listing = json.loads(header.numpy().tobytes())
    if not sending:
        _start(listing, into)
    for piece in _chunks(listing):
        data = _read(folder, piece) if sending else torch.empty(piece[2], dtype=torch.uint8)  # type: ignore[arg-type]
        dist.broadcast(data, src, group=group)
        if not sending:
            _write(into, piece, data)


def replicate(root: str, final: str, part: HostPart, replicas: int, keep_last: int | None) -> None:
    """Each host's first rank: its committed part `final` to the next ``replicas - 1`` hosts' first
    ranks, theirs received into ``<root>/replicas/<host>/``, each copy verified then renamed into
    place (collective over ``part.leaders``; the hosts' other ranks call nothing).

    Raises:
        CheckpointError: a copy that arrived damaged (naming it).
    """
    count = len(part.hosts)
    me = next(i for i, (_, ranks) in enumerate(part.hosts) if ranks[0] == part.first)
    name = os.path.basename(final)
    for j in range(1, min(replicas, count)):
        to, frm = part.hosts[(me + j) % count], part.hosts[(me - j) % count]
        folder = os.path.join(root, REPLICAS, frm[0])
        tmp = os.path.join(folder, f"{name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        pass_folder(final, to[1][0], tmp, frm[1][0], part.leaders)
        problem = verify(tmp, collective=False)
        if problem is not None:
            raise CheckpointError(f"the copy of host {frm[0]}'s part of {name} arrived damaged: {problem}")
        target = os.path.join(folder, name)
        shutil.rmtree(target, ignore_errors=True)
        os.rename(tmp, target)
        retention.prune(folder, keep_last)


def _holdings(root: str, part: HostPart) -> dict[str, Any]:
    """What this host holds (its first rank reads it): step name -> {host: the part's folder}, and
    each step's saving hosts."""
    held: dict[str, dict[str, str]] = {}
    saved: dict[str, list[list[Any]]] = {}

    def note(path: str) -> None:
        try:
            meta = read_meta(path)
        except CheckpointError:
            return
        if meta.get("storage") != "local":
            return
        name = os.path.basename(path)
        held.setdefault(name, {}).setdefault(str(meta.get("host")), path)
        saved.setdefault(name, [[h, list(r)] for h, r in meta.get("hosts", [])])

    for path in candidates(root):
        note(path)
    copies = os.path.join(root, REPLICAS)
    for host in sorted(os.listdir(copies)) if os.path.isdir(copies) else []:
        for path in candidates(os.path.join(copies, host)):
            note(path)
    return {"held": held, "saved": saved}


def choose(resume: str | None, root: str) -> tuple[str | None, bool]:
    """:func:`pipeflow.checkpoint.storage.choose_local`, and where the hosts changed since the save, a
    checkpoint assembled from the parts the hosts hold (collective).  Returns (the checkpoint,
    whether it was assembled: every rank then reads it whole).

    Raises:
        CheckpointError / ConfigError: as :func:`~pipeflow.checkpoint.storage.choose_local`, and an
            assembly that failed on some host (naming it).
    """
    if resume != "auto":
        return choose_local(resume, root), False
    part = host_part()
    leader = dist.get_rank() == part.first
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, _holdings(root, part) if leader else None)
    hosts = [[name, list(ranks)] for name, ranks in part.hosts]
    offers = {ranks[0]: views[ranks[0]] for _, ranks in part.hosts}
    names = sorted({n for v in offers.values() for n in v["held"]}, reverse=True)
    for name in names:
        saved = next(v["saved"][name] for v in offers.values() if name in v["saved"])
        if saved == hosts:  # the hosts that saved it: each reads its own part, as always
            if all(name in v["held"] and host in v["held"][name] for (host, _), v in zip(part.hosts, offers.values())):
                return choose_local(resume, root), False
        sources = {}
        for host, _ in saved:
            holder = next((r for r, v in offers.items() if host in v["held"].get(name, {})), None)
            if holder is None:
                break
            sources[host] = (holder, offers[holder]["held"][name][host])
        if len(sources) < len(saved):
            continue
        return _assemble(root, name, saved, sources, part), True
    if dist.get_rank() == 0 and names:
        log.warning("train.resume=auto: no checkpoint whose every host's part a host here holds (its own or a copy: "
                    "train.checkpoint_replicas); starting fresh from step 0 in %s", root)
    return None, False


def _assemble(root: str, name: str, saved: list[list[Any]], sources: dict[str, tuple[int, str]],
              part: HostPart) -> str:
    """Every host's first rank gets each part of step `name` (broadcast by the host holding it)
    and merges them into ``<root>/assembled/<name>`` (collective)."""
    rank = dist.get_rank()
    leader = rank == part.first
    base = os.path.join(root, ASSEMBLED)
    incoming = os.path.join(base, ".incoming")
    out = os.path.join(base, name)

    def receive_and_merge() -> None:
        shutil.rmtree(base, ignore_errors=True)
        os.makedirs(incoming)
        paths = []
        for host, _ in saved:
            holder, path = sources[host]
            into = os.path.join(incoming, host)
            _broadcast_folder(path if rank == holder else None, holder, into, part.leaders)
            paths.append(path if rank == holder else into)
        gather(paths, out)
        shutil.rmtree(incoming, ignore_errors=True)

    done = integrity.attempt(receive_and_merge if leader else lambda: None, rank)
    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, done)
    errors = sorted({e for o in outcomes for e in o.errors})
    if errors:
        raise CheckpointError(f"train.resume=auto: assembling {name} from the hosts' parts failed: "
                              + "; ".join(f"rank {r}: {text}" for r, text in errors))
    if rank == 0:
        held = ", ".join(f"{host}'s from rank {sources[host][0]}" for host, _ in saved)
        log.info("assembled %s from the parts the hosts hold (%s): the hosts changed since it was saved", name, held)
    return out


def discard(path: str) -> None:
    """After every rank loaded assembled checkpoint `path`: each host's first rank removes it."""
    dist.barrier()
    if dist.get_rank() == host_part().first:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
