"""Cases run inside every rank of a gloo group (see mp_harness): pipelined vs unsplit model.

Each case builds the pipelined model for this rank and, in the same process, the unsplit
reference; both see the same batches and optimizer, and the case returns the worst relative
differences of loss, gradients and parameters seen on this rank.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeflow.runtime.transport import Deadlines, P2PComm, send_recv
from pipeflow.errors import PipeflowError
from pipeflow.models.spec import LayerSpec, ModelSpec, run_layers
from pipeflow.planning.partition import partition_layers
from pipeflow.runtime.pipeline import Pipeline
from pipeflow.runtime.posting import AheadTuner, Posting
from pipeflow.schedules import PipelineSchedule, build_schedule
from pipeflow.models import build_gpt, from_module
from pipeflow.models.zoo import build_resnet
from pipeflow.runtime.stage import as_tuple, build_stages, layers_by_index
from pipeflow.runtime.tied import TiedWeights, tie_in_place
from pipeflow.run.trainer import clip_grad_norm_global, unique_parameters
from toy_models import SKIP_SPLIT_POINTS, SkipNet, build_toy, mlp_sequential, random_batch

DTYPE = torch.float64
BATCH = 24  # divisible by every micro-batch count tested: 1, 2, 3, 4, 6, 8, 12, 24


def rel_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (0 for two zero tensors)."""
    scale = expected.abs().max().item()
    err = (actual - expected).abs().max().item()
    return err / scale if scale > 0 else err


def build_pipeline(
    spec: ModelSpec, schedule: PipelineSchedule, **kwargs: Any
) -> tuple[Pipeline, list[range], TiedWeights]:
    """This rank's stages of `spec` under `schedule`, uniform partition, float64 on CPU."""
    rank = dist.get_rank()
    ranges = partition_layers(len(spec.layers), schedule.num_stages, names=spec.layer_names())
    stages = build_stages(spec, ranges, schedule.stages_of(rank), dtype=DTYPE,
                          checkpoint_every=kwargs.pop("checkpoint_every", 0))
    comm = P2PComm(None, torch.device("cpu"), timeout_s=kwargs.pop("timeout_s", 120.0))
    comm.warmup()
    tied = TiedWeights(spec, ranges, schedule.stage_to_rank, layers_by_index(stages, ranges), list(range(comm.size)), rank)
    tied.sync_initial_values()
    return Pipeline(stages, schedule, comm, **kwargs), ranges, tied


def make_spec(model: str) -> ModelSpec:
    """The toy model `model`; ``gpt_tied`` is the small GPT with tied embedding and head; a
    suffix ``8`` makes it 8 layers (two chunks per rank on 4 ranks);
    ``resnet18`` the flattened torchvision ResNet-18 (run with BatchNorm in eval mode)."""
    if model in ("gpt_tied", "gpt_tied8"):
        n_layer = 6 if model == "gpt_tied8" else 4
        return build_gpt(vocab_size=64, block_size=16, n_layer=n_layer, n_head=2, n_embd=16, tie_embeddings=True)
    if model == "resnet18":
        return build_resnet("resnet18", num_classes=10)
    if model == "residual_mlp":  # the README's custom-model example
        from examples.custom_model import build_residual_mlp

        return build_residual_mlp(in_features=32, hidden=16, num_layers=4, num_classes=10)
    if model.startswith("module_"):  # an existing nn.Module split by from_module (tests/toy_models.py)
        return module_spec(model)
    if model == "gpt8":  # 8 layers: two chunks on each of 4 ranks
        return build_toy("gpt", n_layer=6)
    if model == "gpt_packed":  # fed (tokens, document ids): packed documents
        return build_toy("gpt")
    if model == "masked_mlp8":
        return build_toy("masked_mlp", num_layers=8)
    return build_toy(model)


def module_spec(model: str) -> ModelSpec:
    """from_module's three forms, each given a constructor: ``module_seq`` (an nn.Sequential, a
    child per layer), ``module_gpt_tied`` (examples/your_module.py's GPT, blocks form: an adapter
    before the blocks, the head tied to the token embedding, GPT-2 init per layer) and
    ``module_traced_skip`` (SkipNet traced, its first activation skipping three split points)."""
    if model == "module_seq":
        return from_module(mlp_sequential)
    if model == "module_gpt_tied":
        from examples.your_module import split_gpt

        return split_gpt(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=16)
    if model == "module_traced_skip":
        return from_module(SkipNet, split_points=SKIP_SPLIT_POINTS)
    raise ValueError(f"unknown from_module case {model!r}")


def unsplit_module(model: str) -> torch.nn.Module:
    """The nn.Module that `module_spec(model)` splits, built whole (the reference)."""
    if model == "module_seq":
        return mlp_sequential()
    if model == "module_gpt_tied":
        from examples.your_module import GPT

        return GPT(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=16)
    return SkipNet()


def make_batch(model: str, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets for `model` (images are 3 x 8 x 8)."""
    if model == "resnet18":
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(batch, 3, 8, 8, generator=gen, dtype=DTYPE), torch.randint(10, (batch,), generator=gen)
    if model.startswith("module_"):
        return random_batch("gpt" if model == "module_gpt_tied" else "mlp", batch, seed=seed)
    kind = "mlp" if model == "residual_mlp" else model.removesuffix("8").removesuffix("_tied")
    return random_batch(kind, batch, seed=seed)


def freeze_batchnorm(modules: Any) -> None:
    """BatchNorm on running statistics, so a micro-batch's normalisation equals the batch's."""
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, torch.nn.modules.batchnorm._BatchNorm):
                sub.eval()


def split_batch(pipe: Pipeline, x: torch.Tensor, y: torch.Tensor, m: int) -> tuple[list | None, list | None]:
    """Micro-batch inputs for stage 0's rank and targets for the last stage's rank."""
    inputs = [as_tuple(mb) for mb in x.chunk(m)] if 0 in pipe.stages else None
    last = pipe.schedule.num_stages - 1
    targets = list(y.chunk(m)) if last in pipe.stages else None
    return inputs, targets


def offload_plan(schedule: PipelineSchedule, mode: str) -> Any:
    """``pipeline.offload=mode``'s plan for `schedule` on unit costs over a link a copy engine runs
    beside compute (each group's copy a quarter of an F): ``auto`` then hides most groups."""
    from pipeflow.schedules.offload import HostLink, OffloadCosts
    from pipeflow.schedules.simulator import simulated_plan

    return simulated_plan(schedule, mode, OffloadCosts(lambda g: 1.0, HostLink(4.0, 4.0)), posting="ahead")


@dataclass
class ReferenceRun:
    """The unsplit model's AdamW steps on the whole batch: per step the loss, every parameter's
    gradient (after clipping) and its value after the step, each list in the order of ``index``."""

    layers: list[torch.nn.Module]  # the unsplit layers (their parameters pair with the stages')
    index: dict[int, int]  # id(parameter of `layers`) -> its index (tied parameters share one)
    module: torch.nn.Module | None  # from_module's cases: the user's module, trained instead of `layers`
    losses: list[torch.Tensor]
    grads: list[list[torch.Tensor]]
    values: list[list[torch.Tensor]]


@functools.lru_cache(maxsize=None)
def reference_run(model: str, steps: int, batch: int, clip: float, against_module: bool) -> ReferenceRun:
    """The reference of :func:`equivalence`, trained once per rank for every case that shares
    it (it depends on neither the schedule nor the micro-batching); kept for the world's life."""
    spec = make_spec(model)
    reference = spec.build_all(dtype=DTYPE)
    tie_in_place(spec, dict(enumerate(reference)))
    freeze_batchnorm(reference)
    params = unique_parameters(layer.parameters() for layer in reference)
    forward, module = functools.partial(run_layers, reference), None
    if against_module:
        module = unsplit_module(model).to(DTYPE)
        module.load_state_dict({k: v for layer in reference for k, v in layer.state_dict().items()})
        params, forward = list(module.parameters()), module
    run = ReferenceRun(reference, {id(p): i for i, p in enumerate(params)}, module, [], [], [])
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    for step in range(steps):
        x, y = make_batch(model, batch, seed=step)
        loss = spec.loss_fn(forward(x), y)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        run.losses.append(loss.detach())
        run.grads.append([p.grad.clone() for p in params])
        optimizer.step()
        optimizer.zero_grad()
        run.values.append([p.detach().clone() for p in params])
    return run


def equivalence(
    model: str, schedule: str, m: int, steps: int = 3, batch: int = BATCH, clip: float = 0.0,
    reversed_placement: bool = False, runtime: str = "default", against_module: bool = False,
    offload: str = "none", checkpoint_every: int = 0,
) -> dict[str, float]:
    """Train `steps` AdamW steps pipelined and unsplit; return worst relative differences.

    `runtime`: ``default`` (gloo: recvs posted a step ahead, each waited on by its consumer,
    sends waited after the action), ``at-step`` (the same, recvs posted at their own step),
    ``auto`` (the default runtime timing both postings, one step each, then keeping the faster),
    ``grouped`` (one post per step as with NCCL: recvs waited before the action, sends after)
    or ``strict`` (every op of a step completes before its action: the simulated semantics).

    With `clip` > 0, gradients are clipped by the global norm on both sides (pipelined: one
    all-reduce over the stages; unsplit: torch.nn.utils.clip_grad_norm_) before the step.
    With `reversed_placement`, rank r's stages run on rank p-1-r (``pipeline.stage_to_rank``).
    With `against_module` (from_module's models), the reference is the user's own nn.Module, its
    forward unchanged, loaded with the weights from_module made; parameters pair by name.
    `offload`: ``pipeline.offload``'s mode (:func:`offload_plan`); the bytes it moved are
    returned as ``offloaded`` (the last step's).  `checkpoint_every`: activation checkpointing.
    """
    p = dist.get_world_size()
    spec = make_spec(model)
    plan = build_schedule(schedule, p, m)
    if reversed_placement:  # rank r's stages move to rank p-1-r
        plan = build_schedule(schedule, p, m, stage_to_rank=[p - 1 - r for r in plan.stage_to_rank])
    postings = {
        "default": Posting(True), "at-step": Posting(False),
        "auto": Posting("auto", tuner=AheadTuner(trials=1, warmup=1)),  # auto decides after step 3
        "grouped": Posting(lowering="group"), "strict": Posting(lowering="rendezvous"),
    }
    moved = offload_plan(plan, offload) if offload != "none" else None
    pipe, ranges, tied = build_pipeline(spec, plan, posting=postings[runtime], offload=moved,
                                        checkpoint_every=checkpoint_every)
    freeze_batchnorm(st.module for st in pipe.stages.values())
    ref = (reference_run.__wrapped__ if model == "resnet18" else reference_run)(model, steps, batch, clip, against_module)
    if against_module:
        pairs = [(mine, ref.index[id(ref.module.get_parameter(name))]) for stage in pipe.stages.values()
                 for layer in stage.module for name, mine in layer.named_parameters()]
    else:
        pairs = [(mine, ref.index[id(theirs)]) for s, stage in pipe.stages.items()
                 for layer, idx in zip(stage.module, ranges[s])
                 for mine, theirs in zip(layer.parameters(), ref.layers[idx].parameters())]
    mine_params = unique_parameters([[a for a, _ in pairs]])
    opt_pipe = torch.optim.AdamW(mine_params, lr=1e-2)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0, "losses_compared": 0, "params_compared": len(pairs)}
    for step in range(steps):
        x, y = make_batch(model, batch, seed=step)
        loss = pipe.run(*split_batch(pipe, x, y, m))
        tied.reduce_grads()
        if clip > 0:
            norm, _ = clip_grad_norm_global(mine_params, clip, None, torch.zeros(1, dtype=DTYPE), tied.duplicates())
            worst["norm_before_clip"] = norm
        if loss is not None:
            worst["loss"] = max(worst["loss"], rel_diff(loss, ref.losses[step]))
            worst["losses_compared"] += 1
        for mine, i in pairs:
            worst["grad"] = max(worst["grad"], rel_diff(mine.grad, ref.grads[step][i]))
        opt_pipe.step()
        opt_pipe.zero_grad()
        for mine, i in pairs:
            worst["param"] = max(worst["param"], rel_diff(mine.detach(), ref.values[step][i]))
    if runtime == "auto":
        worst["ahead_choice"] = pipe.posting.tuner.choice
    if pipe.offloaded is not None:
        worst["offloaded"] = pipe.offloaded.bytes
        worst["groups_offloaded"] = pipe.offloaded.groups
    return worst


def ragged_batch(model: str, m: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """m micro-batches that differ in shape: BATCH + 1 rows split as evenly as they go (so the last
    ones are a row short) and, for the GPT, each its own sequence length (16 down to 5);
    ``gpt_packed`` inputs are (tokens, document ids)."""
    x, y = make_batch(model.removesuffix("_packed"), BATCH + 1, seed)
    xs, ys = list(x.tensor_split(m)), list(y.tensor_split(m))
    if model.startswith("gpt"):
        lengths = [16 - (5 * i) % 12 for i in range(m)]
        xs, ys = [t[:, :n] for t, n in zip(xs, lengths)], [t[:, :n] for t, n in zip(ys, lengths)]
    if model == "gpt_packed":  # documents of 1..4 tokens packed into each sequence
        gen = torch.Generator().manual_seed(seed)
        docs = [torch.randint(4, x.shape, generator=gen).eq(0).long().cumsum(1) for x in xs]
        return [(x, d) for x, d in zip(xs, docs)], ys  # type: ignore[misc]
    return xs, ys


def variable_equivalence(model: str, schedule: str, m: int, steps: int = 3, offload: str = "none") -> dict[str, float]:
    """Micro-batches of different shapes in one step (``per_microbatch`` shapes: rows that do not
    split evenly, GPT sequence lengths that differ): pipelined training equals the unsplit model
    on the batch's element-weighted mean loss (each micro-batch's mean loss weighted n_i / N);
    worst relative differences of loss, gradients and parameters, and the receive buffers the
    pool made after the first step (steady state: none)."""
    spec = make_spec(model)
    plan = build_schedule(schedule, dist.get_world_size(), m)
    pipe, ranges, tied = build_pipeline(spec, plan, shapes="per_microbatch",
                                        offload=offload_plan(plan, offload) if offload != "none" else None)
    reference = spec.build_all(dtype=DTYPE)
    tie_in_place(spec, dict(enumerate(reference)))
    pairs = [
        (mine, ref)
        for s, stage in pipe.stages.items()
        for layer, idx in zip(stage.module, ranges[s])
        for mine, ref in zip(layer.parameters(), reference[idx].parameters())
    ]
    mine_params = unique_parameters([[a for a, _ in pairs]])
    ref_params = unique_parameters(layer.parameters() for layer in reference)
    opt_pipe, opt_ref = torch.optim.AdamW(mine_params, lr=1e-2), torch.optim.AdamW(ref_params, lr=1e-2)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0, "losses_compared": 0, "params_compared": len(pairs)}
    last = plan.num_stages - 1
    for step in range(steps):
        xs, ys = ragged_batch(model, m, seed=step)
        total = sum(y.numel() for y in ys)
        weights = [y.numel() / total for y in ys]
        loss_ref = sum(w * spec.loss_fn(run_layers(reference, x), y) for w, x, y in zip(weights, xs, ys))
        loss_ref.backward()
        inputs = [as_tuple(x) for x in xs] if 0 in pipe.stages else None
        loss = pipe.run(inputs, list(ys) if last in pipe.stages else None, loss_weights=weights)
        tied.reduce_grads()
        if loss is not None:
            worst["loss"] = max(worst["loss"], rel_diff(loss, loss_ref.detach()))
            worst["losses_compared"] += 1
        worst["grad"] = max([worst["grad"]] + [rel_diff(a.grad, b.grad) for a, b in pairs])
        opt_pipe.step(), opt_ref.step()
        opt_pipe.zero_grad(), opt_ref.zero_grad()
        worst["param"] = max([worst["param"]] + [rel_diff(a.detach(), b.detach()) for a, b in pairs])
        if step == 0:
            allocated = pipe.buffers.allocated
    worst["buffers_after_first_step"] = pipe.buffers.allocated - allocated
    return worst


def chunked_microbatch_counts(schedule: str, p: int) -> tuple[int, int, int]:
    """Three micro-batch counts `schedule` accepts on p ranks with 2 chunks each, the smallest
    first (all divide BATCH)."""
    if schedule == "interleaved_1f1b":  # m a multiple of p
        return (p, 2 * p, 3 * p)
    if schedule == "dualpipev":  # m >= 2p
        return (2 * p, 3 * p, 6 * p)
    return (1, 3, 8)


def equivalence_nth_count(model: str, schedule: str, k: int, **kwargs: Any) -> dict[str, float]:
    """:func:`equivalence` with the k-th of :func:`chunked_microbatch_counts` for this world size."""
    m = chunked_microbatch_counts(schedule, dist.get_world_size())[k]
    return {**equivalence(model, schedule, m, **kwargs), "microbatches": m}


def eval_matches(model: str, m: int) -> float:
    """Forward-only evaluation loss vs the unsplit model (relative difference; 0 off the last rank)."""
    spec = build_toy(model)
    pipe, _, _ = build_pipeline(spec, build_schedule("1f1b", dist.get_world_size(), m))
    x, y = random_batch(model, BATCH, seed=7)
    with torch.no_grad():
        expected = spec.loss_fn(run_layers(spec.build_all(dtype=DTYPE), x), y)
    loss = pipe.eval(*split_batch(pipe, x, y, m))
    held = sum(st.activations_held() for st in pipe.stages.values())
    if held:
        raise AssertionError(f"evaluation kept {held} activations")
    return 0.0 if loss is None else rel_diff(loss, expected)


def dynamic_shapes(model: str = "masked_mlp", m: int = 2) -> float:
    """With comm.shapes=per_step, a smaller batch mid-run renegotiates and stays exact."""
    spec = build_toy(model)
    pipe, _, _ = build_pipeline(spec, build_schedule("1f1b", dist.get_world_size(), m), shapes="per_step")
    reference = spec.build_all(dtype=DTYPE)
    worst = 0.0
    for step, batch in enumerate((BATCH, BATCH // 2, BATCH)):
        x, y = random_batch(model, batch, seed=step)
        with torch.no_grad():
            expected = spec.loss_fn(run_layers(reference, x), y)
        loss = pipe.eval(*split_batch(pipe, x, y, m))
        if loss is not None:
            worst = max(worst, rel_diff(loss, expected))
    return worst


def transfer_time() -> float:
    """schedule=auto's transfer cost, measured on the live pipeline group: every rank the same."""
    from pipeflow.planning.costs.comm import measure_transfer_s

    comm = P2PComm(None, torch.device("cpu"), timeout_s=60.0)
    return measure_transfer_s(comm, 64 * 1024, repeats=5)


def send_recv_ring() -> list[float]:
    """send_recv to the next rank and from the previous one in one batched call."""
    rank, size = dist.get_rank(), dist.get_world_size()
    got = send_recv(torch.full((3,), float(rank)), (rank + 1) % size, (rank - 1) % size)
    return got.tolist()


def shape_change_is_an_error(model: str = "masked_mlp", m: int = 2) -> str:
    """Without dynamic shapes, a smaller batch is a ShapeMismatchError on the sender and a
    PipelineTimeoutError (not a hang) on the ranks waiting for it.  Breaks the group: run last."""
    spec = build_toy(model)
    # the negotiating step may take its time; the recv that never comes is waited for 0.5 s
    pipe, _, _ = build_pipeline(spec, build_schedule("1f1b", dist.get_world_size(), m), timeout_s=None)
    pipe.comm.deadlines = Deadlines(10.0, 0.5)
    for batch in (BATCH, BATCH // 2):
        x, y = random_batch(model, batch, seed=0)
        try:
            pipe.run(*split_batch(pipe, x, y, m))
        except PipeflowError as exc:
            time.sleep(2.0)  # stay alive so that peers see their deadline, not our exit
            return f"{type(exc).__name__}: {exc}"
        pipe.comm.deadlines.first_step_done()
    return "no error"


def events_recorded(model: str = "masked_mlp", m: int = 4, schedule: str = "1f1b", **sizes: Any) -> dict[str, int]:
    """With the pipeline's recorder on, one run records every compute action and batched call,
    each comm event named by what it posted or, posting nothing, by the recv it waited for."""
    spec = build_toy(model, **sizes)
    pipe, _, _ = build_pipeline(spec, build_schedule(schedule, dist.get_world_size(), m))
    pipe.recorder.start()
    x, y = random_batch(model, BATCH, seed=3)
    pipe.run(*split_batch(pipe, x, y, m))
    counts: dict[str, int] = {}
    for event in pipe.recorder.stop():
        if event.end < event.start:
            raise AssertionError(f"event {event} ends before it starts")
        if not event.name:
            raise AssertionError(f"event {event} has no name")
        counts[event.kind] = counts.get(event.kind, 0) + 1
    return counts


def only_own_layers(m: int = 4) -> str:
    """Each rank builds only its own layers: a builder raises when called on another rank."""
    p, rank = dist.get_world_size(), dist.get_rank()
    schedule = build_schedule("1f1b", p, m)
    num_layers = 2 * p
    ranges = partition_layers(num_layers, schedule.num_stages)
    owner = {i: schedule.stage_to_rank[s] for s, r in enumerate(ranges) for i in r}

    def guarded_linear(index: int) -> torch.nn.Module:
        if owner[index] != rank:
            raise RuntimeError(f"layer {index} built on rank {rank}, but rank {owner[index]} owns it")
        return torch.nn.Linear(8, 8)

    spec = ModelSpec("guarded", [LayerSpec(f"l{i}", guarded_linear, (i,)) for i in range(num_layers)],
                     loss_fn=lambda out, y: torch.nn.functional.mse_loss(out, y))
    pipe, _, _ = build_pipeline(spec, schedule)
    x, y = torch.randn(BATCH, 8, dtype=DTYPE), torch.randn(BATCH, 8, dtype=DTYPE)
    pipe.run(*split_batch(pipe, x, y, m))
    foreign = next(i for i, r in owner.items() if r != rank)
    try:
        spec.build_layers([foreign])
    except RuntimeError as exc:
        return f"built only own layers; foreign build raised: {exc}"
    return "foreign build did not raise"


def module_own_bytes(model: str = "module_gpt_tied", m: int = 4) -> dict[str, int]:
    """from_module on this rank, under tensor accounting: the spec (the model built on meta) and
    this rank's layers; returns the bytes allocated, its layers' bytes and the whole model's."""
    from tensor_accounting import AllocatedBytes, held_bytes

    schedule = build_schedule("1f1b", dist.get_world_size(), m)
    with AllocatedBytes() as acc:
        spec = make_spec(model)
        ranges = partition_layers(len(spec.layers), schedule.num_stages, names=spec.layer_names())
        own = [i for s in schedule.stages_of(dist.get_rank()) for i in ranges[s]]
        layers = spec.build_layers(own)
    with torch.device("meta"):
        whole = held_bytes(spec.build_all())
    return {"allocated": acc.total, "own": held_bytes(layers), "whole": whole}


def memory_matches(model: str = "gpt", schedule: str = "1f1b", m: int = 4, offload: str = "none") -> dict[str, Any]:
    """The second step's tensor memory (AdamW's state exists), measured by the accountant after
    every action, beside `tensor_memory`'s prediction from the profiled layers (and loss), on this
    rank; with `offload` (:func:`offload_plan`) also the bytes offloaded, measured and predicted."""
    from pipeflow.planning.layout import stage_bytes
    from pipeflow.planning.profile import profile_layers
    from pipeflow.runtime.memory import MemoryAccountant
    from pipeflow.schedules import lower
    from pipeflow.schedules.memory import tensor_memory

    spec, rank = make_spec(model), dist.get_rank()
    sched = build_schedule(schedule, dist.get_world_size(), m)
    plan = offload_plan(sched, offload) if offload != "none" else None
    pipe, ranges, _ = build_pipeline(spec, sched, posting=Posting(True), offload=plan)
    optimizer = torch.optim.AdamW(unique_parameters(stage.parameters() for stage in pipe.stages.values()))
    accountant = MemoryAccountant(pipe.stages, optimizer, torch.device("cpu"))
    x, y = make_batch(model, BATCH, seed=1)
    for step in range(2):
        inputs, targets = split_batch(pipe, x, y, m)
        accountant.begin()
        pipe.run(inputs, targets, memory=accountant if step else None)
        optimizer.step()
        measured = accountant.end(pipe.comm_tensors())
        optimizer.zero_grad(set_to_none=True)
    sample, target = x.chunk(m)[0], y.chunk(m)[0]
    costs = stage_bytes(ranges, profile_layers(spec, sample, dtype=DTYPE, sample_target=target), sched,
                        sample.numel() * sample.element_size(), target.numel() * target.element_size())
    predicted = tensor_memory(sched, costs, programs=lower(sched, "ahead", offload=plan))[rank]
    moved = [step.offload[0] for step in lower(sched, "ahead", offload=plan)[rank] if step.offload]
    return {"measured": (measured.resident.as_tuple(), measured.peak.as_tuple()),
            "predicted": (predicted.resident.as_tuple(), predicted.peak.as_tuple()),
            "offloaded": pipe.offloaded.bytes if pipe.offloaded is not None else 0,
            "offloaded_predicted": sum(costs[s].offloadable for s, _ in moved)}


def masked_equivalence(model: str, schedule: str, k: int = 1, steps: int = 2) -> dict[str, Any]:
    """Targets masked with -100 (a seeded 40% of them and every target of micro-batch 1), each
    micro-batch weighed by the targets its loss counts over the batch's (the Trainer's weights):
    the pipelined loss and every gradient equal the unsplit model's mean over the unmasked targets
    of the whole batch; the all-masked micro-batch adds zero, never NaN.  m is the k-th of
    :func:`chunked_microbatch_counts` (at least 2) for this world size."""
    from pipeflow.data import microbatch_counts

    m = max(2, chunked_microbatch_counts(schedule, dist.get_world_size())[k])
    spec = make_spec(model)
    pipe, ranges, tied = build_pipeline(spec, build_schedule(schedule, dist.get_world_size(), m))
    reference = spec.build_all(dtype=DTYPE)
    tie_in_place(spec, dict(enumerate(reference)))
    pairs = [(mine, ref) for s, stage in pipe.stages.items() for layer, idx in zip(stage.module, ranges[s])
             for mine, ref in zip(layer.parameters(), reference[idx].parameters())]
    worst = {"loss": 0.0, "grad": 0.0, "losses_compared": 0, "microbatches": m}
    for step in range(steps):
        x, y = make_batch(model, BATCH, seed=step)
        y = y.masked_fill(torch.rand(y.shape, generator=torch.Generator().manual_seed(step)) < 0.4, -100)
        y.chunk(m)[1].fill_(-100)
        spec.loss_fn(run_layers(reference, x), y).backward()
        counts = microbatch_counts(y, m, spec.loss_count)
        loss = pipe.run(*split_batch(pipe, x, y, m), loss_weights=[c / sum(counts) for c in counts])
        tied.reduce_grads()
        if loss is not None:
            expected = spec.loss_fn(run_layers(reference, x), y).detach()
            worst["loss"] = max(worst["loss"], rel_diff(loss, expected))
            worst["losses_compared"] += 1
        worst["grad"] = max([worst["grad"]] + [rel_diff(a.grad, b.grad) for a, b in pairs])
        for a, b in pairs:
            a.grad = b.grad = None
    return worst
