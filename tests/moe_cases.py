"""Cases run inside every rank of a gloo group (see mp_harness): the pipelined mixture-of-experts GPT
against the unsplit one (float64).

The world is pp 2 x dp (world / 2): ranks 2d and 2d + 1 are replica d's pipeline.  Each case
builds this rank's stages and, in the same process, the unsplit reference; both train `steps`
AdamW steps on the same batches (the second routes with the biases the first moved).  The reference runs every micro-batch of every replica itself,
each inside :func:`aux_loss_scope` with its weight (the aux loss per layer and micro-batch, as the
pipeline defines it), and sums the weighted losses.  Returns the worst relative differences of the
total loss (cross entropy + aux), gradients and parameters, and whether the routers' token counts
(and bias) equal the reference's.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pipeflow.models import build_gpt
from pipeflow.models.aux_loss import aux_loss_scope
from pipeflow.models.spec import run_layers
from pipeflow.planning.partition import partition_layers
from pipeflow.runtime.events import EventRecorder
from pipeflow.runtime.parallel.expert_parallel import is_expert_parameter, split_experts
from pipeflow.runtime.pipeline import Pipeline
from pipeflow.runtime.parallel.routing import RoutingSync
from pipeflow.runtime.stage import as_tuple, build_stages, layers_by_index
from pipeflow.runtime.transport import P2PComm
from pipeflow.schedules import build_schedule

DTYPE = torch.float64
VOCAB, SEQ, EXPERTS = 32, 8, 4
_GROUPS: dict[int, tuple[Any, Any]] = {}  # world size -> (this rank's pipeline group, its dp group)


def _groups() -> tuple[Any, Any]:
    """pp 2 x dp: ranks (2d, 2d + 1) a pipeline, (r, r + 2, ...) a dp group (made once, by every rank)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world not in _GROUPS:
        if world == 2:
            _GROUPS[world] = (None, None)
        else:
            pipes = [dist.new_group([2 * d, 2 * d + 1]) for d in range(world // 2)]
            dps = [dist.new_group(list(range(r, world, 2))) for r in range(2)]
            _GROUPS[world] = (pipes[rank // 2], dps[rank % 2])
    return _GROUPS[world]


def moe_spec(balance: str = "aux_loss", capacity: float | None = None, every: int = 1) -> Any:
    """A small MoE GPT of 8 layers (6 blocks): 4 experts, top 2, a shared expert, z-loss on."""
    moe = {"experts": EXPERTS, "top_k": 2, "shared_experts": 1, "expert_hidden": 24, "balance": balance,
           "aux_loss_coef": 0.05, "z_loss_coef": 0.01, "bias_update_rate": 0.01, "capacity_factor": capacity,
           "every": every}
    return build_gpt(vocab_size=VOCAB, block_size=SEQ, n_layer=6, n_head=2, n_embd=16, moe=moe)


def _batches(step: int, dp: int, m: int, variable: bool) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """[replica][micro-batch] -> (tokens, targets); with `variable` each its own length (8 down to 3)."""
    gen = torch.Generator().manual_seed(100 + step)
    out = []
    for d in range(dp):
        rows = []
        for i in range(m):
            length = SEQ - (3 * (i + d)) % 6 if variable else SEQ
            rows.append((torch.randint(VOCAB, (2, length), generator=gen), torch.randint(VOCAB, (2, length), generator=gen)))
        out.append(rows)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    err = (a - b).abs().max().item()
    return err / scale if scale > 0 else err


def _interleaving(pipe: Pipeline, events: list) -> dict[str, int]:
    """How many of this rank's overlapped pairs had an exchange of their B recorded before their F
    ended (and how many pairs ran): the sub-steps of two micro-batches interleaved."""
    program = pipe.programs[pipe.posting.for_training(pipe._coalescing)]
    spans = {e.name: (e.start, e.end) for e in events if e.kind in ("F", "B", "W")}
    exchanges = sorted(e.start for e in events if e.kind == "a2a")
    pairs = [(str(program[k].action), str(program[k + 1].action)) for k in range(len(program) - 1) if program[k + 1].paired]
    interleaved = sum(1 for f, b in pairs
                      if any(spans[b][0] <= t <= spans[f][1] for t in exchanges) and spans[b][0] < spans[f][1])
    return {"pairs": len(pairs), "interleaved": interleaved}


def moe_equivalence(schedule: str, m: int, checkpoint_every: int = 0, balance: str = "aux_loss",
                    capacity: float | None = None, variable: bool = False, every: int = 1, steps: int = 2,
                    ep: bool | str = False, overlap: bool = True) -> dict[str, Any]:
    """Train the MoE GPT pipelined (pp 2 x dp world/2) and unsplit; worst relative differences.
    With `ep`, each stage's experts are split over its dp ranks (ep = dp; None on one process pair);
    ``ep="where_dp"``: split where there are dp ranks, else run as without.  `overlap`:
    ``pipeline.overlap_pairs`` (dualpipev's pairs interleaved); with it and ep the last step is
    recorded, and ``interleaved`` counts the pairs whose B computed (an exchange of it recorded)
    before their F ended, ``pairs`` the pairs."""
    pipe_group, dp_group = _groups()
    world, rank = dist.get_world_size(), dist.get_rank()
    dp, d = world // 2, rank // 2
    if ep == "where_dp":
        ep = dp > 1
    if ep and dp == 1:
        return {"skipped": True}
    spec = moe_spec(balance, capacity, every)
    plan = build_schedule(schedule, 2, m)
    ranges = partition_layers(len(spec.layers), plan.num_stages, names=spec.layer_names())
    comm = P2PComm(pipe_group, torch.device("cpu"), timeout_s=60.0)
    stages = build_stages(spec, ranges, plan.stages_of(comm.rank), dtype=DTYPE, checkpoint_every=checkpoint_every)
    recorder = EventRecorder()
    pipe = Pipeline(stages, plan, comm, shapes="per_microbatch" if variable else "static", recorder=recorder,
                    overlap_pairs=overlap)
    mine = layers_by_index(stages, ranges)
    if ep:  # the dp group is the ep group: each rank keeps E / dp experts of every MoE layer
        split_experts(mine.values(), dp_group, dp, recorder)
    sync = RoutingSync(mine, len(spec.layers), EXPERTS)
    reference = spec.build_all(dtype=DTYPE)
    ref_sync = RoutingSync(dict(enumerate(reference)), len(spec.layers), EXPERTS)
    named = [(name, p, reference[i].get_parameter(name)) for i, layer in mine.items() for name, p in layer.named_parameters()]
    pairs = [(p, q) for _, p, q in named]
    worst_experts = sum(1 for name, _, _ in named if is_expert_parameter(name))
    opt = torch.optim.AdamW([p for p, _ in pairs], lr=1e-2)
    opt_ref = torch.optim.AdamW([q for layer in reference for q in layer.parameters()], lr=1e-2)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0, "aux": 0.0, "counts_equal": True, "losses_compared": 0,
             "dropped": 0.0, "bias": 0.0}
    last = plan.num_stages - 1
    for step in range(steps):
        data = _batches(step, dp, m, variable)
        total = sum(y.numel() for rows in data for _, y in rows)
        weights = [[dp * y.numel() / total for _, y in rows] for rows in data]  # as the Trainer weighs them
        loss_ref = torch.zeros((), dtype=DTYPE)
        for rows, ws in zip(data, weights):  # every replica's micro-batches, each weighed as its share
            for (x, y), w in zip(rows, ws):
                with aux_loss_scope(w / dp):
                    loss_ref = loss_ref + w / dp * spec.loss_fn(run_layers(reference, x), y)
        loss_ref.backward()
        ref_stats = ref_sync.packet(torch.device("cpu"))
        ref_sync.balance(ref_stats)
        ref_figures = ref_sync.figures(ref_stats.tolist(), 1)
        inputs = [as_tuple(x) for x, _ in data[d]] if 0 in stages else None
        targets = [y for _, y in data[d]] if last in stages else None
        if ep and step == steps - 1:
            recorder.start()
        loss = pipe.run(inputs, targets, loss_weights=weights[d])
        if recorder.on:
            worst.update(_interleaving(pipe, recorder.stop()))
        own = torch.zeros(1, dtype=DTYPE) if loss is None else loss.detach().reshape(1) / dp
        packet = torch.cat([own, sync.packet(torch.device("cpu"))])
        dist.all_reduce(packet)  # the Trainer's one all-reduce: loss and the routers' statistics
        sync.balance(packet[1:])
        figures = sync.figures(packet[1:].tolist(), dp)
        for name, p, _ in named:
            if dp > 1 and not (ep and is_expert_parameter(name)):  # an ep = dp expert is on one rank only:
                dist.all_reduce(p.grad, group=dp_group)  # its gradient already holds every replica's tokens
            p.grad /= dp
        if last in stages:
            worst["loss"] = max(worst["loss"], abs(packet[0].item() + figures.aux - loss_ref.item() - ref_figures.aux)
                                / abs(loss_ref.item() + ref_figures.aux))
            worst["losses_compared"] += 1
        worst["aux"] = max(worst["aux"], abs(figures.aux - ref_figures.aux) / ref_figures.aux)
        worst["counts_equal"] &= figures.tokens == ref_figures.tokens and figures.dropped == ref_figures.dropped
        worst["dropped"] += sum(figures.dropped.values())
        worst["grad"] = max([worst["grad"]] + [_rel(p.grad, q.grad) for p, q in pairs])
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
        worst["param"] = max([worst["param"]] + [_rel(p.detach(), q.detach()) for p, q in pairs])
        for i, router in sync.routers.items():
            if balance == "bias":
                worst["bias"] = max(worst["bias"], _rel(router.expert_bias, ref_sync.routers[i].expert_bias))
                worst["bias_moved"] = float(router.expert_bias.abs().max())
    worst["aux_value"] = figures.aux
    worst["expert_params"] = worst_experts
    return worst


def moe_trainer_fit(steps: int = 3, ep: int = 1, variable: bool = True, pp: int = 2) -> dict[str, Any]:
    """``Trainer.fit`` (the builder's path: the routers' statistics in the step's one all-reduce,
    read back a step late, biases moved on the device) of a tied MoE GPT on pp 2 x dp (world / 2)
    against the unsplit model trained per micro-batch; worst relative differences of every step's
    loss (cross entropy + aux) and of the final parameters and biases, and the run's MoE summary.
    Each micro-batch its own sequence length (data.variable_lengths): their weights differ, and
    the MoE layers of stage 0, which holds no loss, must weigh their aux loss by them.

    With `ep` > 1 (``parallel.ep``; ep < dp: each expert on dp / ep ranks) each rank holds 1/ep of
    the experts; the checkpoint saved at the end is then resumed with ``parallel.ep=1`` (every
    expert on every rank, loaded by its global index): ``resumed`` is the worst difference of those
    weights from the unsplit model's."""
    from omegaconf import OmegaConf

    from pipeflow.data import loss_counts, microbatch_inputs, microbatch_targets, shard
    from pipeflow.run.builder import build_run
    from pipeflow.runtime.tied import tie_in_place
    from scale_cases import Reference, make_config, rel_diff

    world = dist.get_world_size()
    dp, m = world // pp, 2
    cfg = make_config(dp, "1f1b", m, optim__fused=True, train__max_steps=steps, data__variable_lengths=variable,
                      data__min_seq_len=3, parallel__ep=ep, train__save_every=steps if ep > 1 else 0)
    OmegaConf.update(cfg, "model.moe", {"experts": EXPERTS, "top_k": 2, "aux_loss_coef": 0.05, "balance": "bias",
                                        "bias_update_rate": 0.01, "z_loss_coef": 0.01}, merge=True)
    trainer = build_run(cfg, torch.device("cpu"))
    result = trainer.fit()
    reference = Reference(cfg)
    tie_in_place(reference.spec, dict(enumerate(reference.layers)))
    ref_sync = RoutingSync(dict(enumerate(reference.layers)), len(reference.layers), EXPERTS)
    ref_losses = []
    for step in range(steps):
        batch = reference.batches.train.get(step)
        total = loss_counts(batch[1])
        loss = torch.zeros((), dtype=DTYPE)
        for d in range(dp):
            x, y = shard(batch, d, dp)
            for (xi,), yi in zip(microbatch_inputs(x, m, torch.device("cpu"), DTYPE), microbatch_targets(y, m, torch.device("cpu"))):
                w = yi.numel() / total
                with aux_loss_scope(w):
                    loss = loss + w * reference.spec.loss_fn(run_layers(reference.layers, xi), yi)
        loss.backward()
        stats = ref_sync.packet(torch.device("cpu"))
        ref_sync.balance(stats)
        ref_losses.append(float(loss.detach()) + ref_sync.figures(stats.tolist(), 1).aux)
        reference.step(step)

    def worst(run: Any) -> float:  # weights and biases against the reference's, by name (experts: global index)
        return max(rel_diff(t, reference.layers[i].state_dict()[k])
                   for i, layer in layers_by_index(run.parts.stages, run.ranges).items() for k, t in layer.state_dict().items())

    out = {"loss": max(abs(a - b) / abs(b) for a, b in zip(trainer.history, ref_losses)),
           "param": worst(trainer), "moe": result["moe"], "steps": len(trainer.history),
           "bias_moved": max(float(r.expert_bias.abs().max()) for r in trainer.loop.update.routing.routers.values()),
           "experts_held": sum(len(r.experts) for r in trainer.loop.update.routing.routers.values())}
    if ep > 1:  # the same run directory, every expert on every rank now
        OmegaConf.update(cfg, "parallel.ep", 1)
        OmegaConf.update(cfg, "train.resume", "auto")
        resumed = build_run(cfg, torch.device("cpu"))
        out["resumed_at"] = resumed.resume()
        out["resumed"] = worst(resumed)
        out["experts_after_resume"] = sum(len(r.experts) for r in resumed.loop.update.routing.routers.values())
        resumed.close()
    return out
