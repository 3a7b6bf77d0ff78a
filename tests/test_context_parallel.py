"""Context parallelism (issue 59): ring attention over the cp group on pipeflow's batched P2P
transport, exact against attention over the whole sequence (float64).

The split and its positions are pure functions (tested here in one process); the ring runs in
one 4-process gloo world (tests/mp_harness.py): cp 4 over the whole world, and cp 2 in two
groups of 2 at once.
"""
from __future__ import annotations

import functools
import re

import pytest
import torch

from mp_harness import run_cases, selected_cases
from pipeflow.runtime.parallel.ring_attention import (Masking, chunk_order, gather_sequence, local_positions,
                                             split_sequence)

TOLERANCE = 1e-12  # float64: per-tensor |a - b| / |b|


def test_each_rank_holds_a_head_and_a_tail_chunk_with_their_global_positions():
    assert chunk_order(2) == [(0, 3), (1, 2)]
    assert local_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    x = torch.arange(24).view(1, 24)
    parts = [split_sequence(x, r, 3) for r in range(3)]
    assert all(torch.equal(p[0], torch.as_tensor(local_positions(24, r, 3))) for r, p in enumerate(parts))
    assert torch.equal(gather_sequence(parts), x)


def test_every_rank_attends_to_the_same_number_of_causal_pairs():
    """The head-tail order balances causal work: each of N ranks sees T(T+1)/2N pairs."""
    length, ranks = 32, 4
    whole = Masking().mask(torch.arange(length), torch.arange(length))
    pairs = [int(whole[0, 0][local_positions(length, r, ranks)].sum()) for r in range(ranks)]
    assert pairs == [length * (length + 1) // 2 // ranks] * ranks


def test_cp_is_a_mesh_dimension_just_outside_tp_unless_the_order_names_it():
    from pipeflow.runtime.parallel.mesh_order import MeshGrid, parse_order

    grid = MeshGrid(2, 2, 1, cp=2)  # [dp,pp,cp,tp]: a stage's cp ranks consecutive
    assert grid.cp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.pipelines() == [[0, 2], [1, 3], [4, 6], [5, 7]]  # one per (dp, cp): the same program
    assert grid.replica_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]  # what holds each parameter: dp x cp
    assert grid.label(5) == "rank 5 (dp 1, pp 0, cp 1, tp 0)"
    named = MeshGrid(2, 2, 1, parse_order("[cp,pp,dp,tp]"), cp=2)
    assert named.cp_groups()[0] == [0, 4] and named.describe().startswith("mesh order [cp,pp,dp,tp]")
    assert MeshGrid(2, 2, 1).rank_table() == [[[0], [1]], [[2], [3]]]  # without cp as before


def test_cp_layout_and_its_named_errors(tmp_path):
    import scale_cases

    from pipeflow.errors import ConfigError
    from pipeflow.config.schema import check_config

    def config(dp: int = 1, **overrides):
        return scale_cases.make_config(dp, train__run_dir=str(tmp_path), **overrides)  # seq_len 8

    assert check_config(config(parallel__cp=2), 4) == (1, 2)  # pp = world / (dp x cp)
    with pytest.raises(ConfigError, match=r"parallel.dp=1 x parallel.pp=2 x parallel.cp=2 = 4 processes, but the "
                                          r"world size is 8"):
        check_config(config(parallel__cp=2, parallel__pp=2), 8)
    with pytest.raises(ConfigError, match=r"2 x cp = 6 chunks .* data.seq_len=8 is not a multiple of 6"):
        check_config(config(parallel__cp=3), 6)
    with pytest.raises(ConfigError, match=r"parallel.cp=2 does not run with parallel.sequence_parallel"):
        check_config(config(parallel__cp=2, parallel__tp=2, parallel__sequence_parallel=True), 4)
    moe = config(2, parallel__cp=2, parallel__ep=2)
    moe.model.moe.experts = 4
    with pytest.raises(ConfigError, match=r"parallel.cp=2 does not run with parallel.ep=2 \(the experts' gradients"):
        check_config(moe, 4)
    with pytest.raises(ConfigError, match=r"parallel.cp=2 does not run with data.variable_lengths"):
        check_config(config(parallel__cp=2, data__variable_lengths=True), 4)
    from pipeflow.commands.plan.command import compose_config, run_plan

    with pytest.raises(ConfigError, match=r"2 x cp = 6 chunks .* data.seq_len=64 is not a multiple of 6"):
        run_plan(compose_config(["parallel.pp=2", "data.seq_len=64", "plan.cp_sizes=[1,3]"]))
    with pytest.raises(ConfigError, match=r"plan.hardware's roofline does not cost context parallelism yet"):
        run_plan(compose_config(["parallel.cp=2", "plan.hardware=h100_sxm", "plan.gpus=8"]))


def test_the_planner_answers_with_the_cp_a_long_sequence_needs():
    """Issue 59: ``python -m pipeflow.plan data.seq_len=...`` profiles a cp rank's share and plans
    cp > 1 where memory demands it: with nothing fitting at cp 1 it doubles cp, and the pick it
    prints composes into a run of dp x pp x cp processes."""
    from pipeflow.config.schema import check_config
    from pipeflow.commands.plan.command import compose_config, run_plan

    words = ["model=gpt", "model.n_layer=2", "model.n_embd=16", "model.n_head=2", "data.vocab_size=32",
             "data.seq_len=1024", "data.batch_size=2", "parallel.pp=2", "plan.schedules=[1f1b]",
             "plan.microbatches=[2]", "plan.comm_latency_ms=0", "plan.action_overhead_ms=0", "plan.repeats=1"]
    both, report = run_plan(compose_config([*words, "plan.cp_sizes=[1,2]"]), overrides=words)
    peaks = {cp: min(c.peak_bytes for c in both.candidates if c.cp == cp) for cp in (1, 2)}
    assert peaks[2] < 0.75 * peaks[1], (peaks, report)  # a rank's activations: half the tokens
    assert "as one of cp 2 ranks" in report and "cp 1, 2 planned (plan.cp_sizes)" in report, report
    limit = f"plan.memory_limit_gb={(peaks[1] + peaks[2]) / 2e9}"
    result, report = run_plan(compose_config([*words, limit]), overrides=[*words, limit])
    assert {c.cp for c in result.candidates} == {2}, report
    assert "cp 1, 2 planned (nothing fit the memory limit below the last)" in report, report
    pick = re.search(r"run the pick: torchrun --nproc-per-node 4 train.py (.+)$", report, re.M)
    assert pick and "parallel.cp=2" in pick.group(1), report
    cfg = compose_config([w.strip("'") for w in pick.group(1).split()])
    assert cfg.parallel.cp == 2 and check_config(cfg, world_size=4) == (1, 2)


def test_the_profile_of_a_cp_run_attends_round_a_loopback_ring(monkeypatch):
    """Issue 59: the start-of-run profile (and so the memory and step predictions) runs each layer as
    a cp rank does: its share of the rows, attention over cp blocks round a loopback ring (the
    exchanges cost nothing here), so attention's compute and saved tensors are a rank's."""
    from pipeflow.models.gpt import build_gpt
    from pipeflow.planning.profile import profile_layers
    from pipeflow.runtime.parallel import ring_attention

    rings = []
    real = ring_attention.ring_attention

    def counted(q, k, v, ring, length, *args, **kwargs):
        rings.append((ring.size, length, q.shape[2]))
        return real(q, k, v, ring, length, *args, **kwargs)

    monkeypatch.setattr(ring_attention, "ring_attention", counted)
    spec = build_gpt(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
    sample = ring_attention.split_sequence(torch.randint(32, (2, 16)), 0, 2)  # rank 0's chunks: 8 tokens
    with_cp = profile_layers(spec, sample, repeats=1, context_parallel=2)
    assert rings and set(rings) == {(2, 16, 8)}  # every block layer's attention: 2 ranks, the whole 16 tokens
    rings.clear()
    alone = profile_layers(spec, sample, repeats=1)
    assert not rings and len(alone) == len(with_cp) == 4
    # each block's passes logged for the planner: forward 1 key/value block (B 2 x 2 heads x 8 tokens
    # x 8 dims, k and v, float32), backward that block again and 2 passes of its gradients
    block = 2 * 2 * 2 * 8 * 8 * 4
    ring = [(p.ring_forward_bytes, p.ring_forward_passes, p.ring_backward_bytes, p.ring_backward_passes)
            for p in with_cp]
    assert ring == [(0, 0, 0, 0), (block, 1, 3 * block, 3), (block, 1, 3 * block, 3), (0, 0, 0, 0)]
    assert all(p.ring_forward_hidden_s > 0 and p.ring_backward_hidden_s > 0 for p in with_cp[1:3])
    assert all(p.ring_forward_passes == 0 for p in alone)


def test_the_planner_prices_what_the_compute_leaves_of_the_ring_exposed():
    """Issue 59: a pass round the cp ring costs latency + bytes / bandwidth; the compute between
    posting and waiting hides it, and only the excess is added, forward to F, backward to B."""
    from pipeflow.planning.costs.context import largest_pass_bytes, ring_profile, ring_seconds
    from pipeflow.planning.profile import LayerProfile
    from pipeflow.planning.costs.tensor import TensorLink

    layer = LayerProfile("block", 10, 40, forward_s=1.0, backward_s=2.0, activation_bytes=8, input_grad_s=1.5,
                         weight_grad_s=0.5, ring_forward_bytes=3000, ring_forward_passes=3, ring_forward_hidden_s=0.5,
                         ring_backward_bytes=9000, ring_backward_passes=9, ring_backward_hidden_s=20.0)
    link = TensorLink(bandwidth_Bps=1000.0, latency_s=0.1)  # a forward pass: 0.1 + 1 s; 3 of them 3.3 s
    priced = ring_profile(layer, link)
    assert priced.forward_s == pytest.approx(1.0 + 3.3 - 0.5)
    assert (priced.backward_s, priced.input_grad_s, priced.weight_grad_s) == (2.0, 1.5, 0.5)  # 9.9 s under 20
    assert ring_seconds([layer], link) == pytest.approx((3.3 + 9.9, 2.8))
    assert largest_pass_bytes([layer]) == 1000.0
    slow = ring_profile(layer, TensorLink(bandwidth_Bps=100.0, latency_s=0.1))  # backward: 90.9 s, 20 hidden
    assert slow.input_grad_s == pytest.approx(1.5 + 70.9) and slow.backward_s == pytest.approx(2.0 + 70.9)
    bare = LayerProfile("mlp", 10, 40, forward_s=1.0, backward_s=2.0, activation_bytes=8)
    assert ring_profile(bare, link) is bare


def _reference(q, k, v, masking: Masking, scale: float):
    """Attention over the whole sequence, the key/value heads repeated (plain autograd)."""
    heads = q.shape[1]
    keys = k.repeat_interleave(heads // k.shape[1], dim=1)
    values = v.repeat_interleave(heads // v.shape[1], dim=1)
    scores = (q @ keys.transpose(-2, -1)) * scale
    positions = torch.arange(q.shape[2])
    scores = scores.masked_fill(~masking.mask(positions, positions), float("-inf"))
    return torch.softmax(scores, dim=-1) @ values


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _ring_vs_whole(cp: int, window: int | None = None, documents: bool = False, heads: int = 4,
                   kv_heads: int = 2, dtype: torch.dtype = torch.float64) -> dict:
    """This rank's output and q, k, v gradients of ring attention over a cp group of `cp` ranks
    against the whole sequence's attention: worst relative differences."""
    import math

    import torch.distributed as dist

    from pipeflow.runtime.parallel.ring_attention import RingComm, ring_attention
    from pipeflow.runtime.transport import P2PComm

    world, me = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(g, g + cp))) for g in range(0, world, cp)]  # every rank makes each
    group = groups[me // cp]
    rank = dist.get_rank(group)
    length, dim, batch = 8 * cp, 8, 2
    gen = torch.Generator().manual_seed(7 + cp)
    q = torch.randn(batch, heads, length, dim, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, kv_heads, length, dim, generator=gen, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, kv_heads, length, dim, generator=gen, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(batch, heads, length, dim, generator=gen, dtype=dtype)
    doc = None
    if documents:  # documents of 5 and 3 tokens... crossing every chunk boundary
        doc = torch.cumsum(torch.tensor([[1 if t % 5 == 0 else 0 for t in range(length)],
                                         [1 if t % 3 == 0 else 0 for t in range(length)]]), dim=1)
    masking = Masking(window=window, doc=doc)
    scale = 1 / math.sqrt(dim)
    ref = _reference(q, k, v, masking, scale)
    ref.backward(grad_out)
    part = [split_sequence(t.detach(), rank, cp, dim=2).requires_grad_() for t in (q, k, v)]
    ring = RingComm(P2PComm(group, torch.device("cpu"), timeout_s=30))
    out = ring_attention(*part, ring, length, masking, scale)
    out.backward(split_sequence(grad_out, rank, cp, dim=2))
    mine = [out.detach()] + [p.grad for p in part]
    theirs = [ref.detach(), q.grad, k.grad, v.grad]
    return {name: _rel(a, split_sequence(b, rank, cp, dim=2))
            for name, a, b in zip(("out", "dq", "dk", "dv"), mine, theirs)}


CASES = {  # name -> (cp, keyword arguments of _ring_vs_whole)
    "cp4-causal": (4, {}),
    "cp2-causal": (2, {}),
    "cp4-window": (4, {"window": 5}),
    "cp2-documents": (2, {"documents": True}),
    "cp4-documents-window-mha": (4, {"documents": True, "window": 7, "kv_heads": 4}),
    # float32: the fused CPU kernel computes the whole and causal-square blocks (its lse beside)
    "cp4-causal-float32": (4, {"dtype": torch.float32}),
}


# the real Trainer (model=gpt, float64) against the unsplit model on the whole batch (tests/scale_cases.py):
# name -> (dp, schedule, overrides)
TRAINER_CASES = {
    "gpt-cp4": (1, "1f1b", {"parallel__cp": 4}),
    "gpt-pp2-cp2-1f1b": (1, "1f1b", {"parallel__cp": 2}),
    "gpt-pp2-cp2-zbv": (1, "zbv", {"parallel__cp": 2}),
    "gpt-dp2-cp2": (2, "1f1b", {"parallel__cp": 2, "parallel__pp": 1}),
    "gpt-tp2-cp2": (1, "1f1b", {"parallel__cp": 2, "parallel__tp": 2, "parallel__pp": 1}),
    "gpt-dp2-cp2-zero1": (2, "1f1b", {"parallel__cp": 2, "parallel__pp": 1, "parallel__shard": "optimizer"}),
    "gpt-dp2-cp2-full-shard": (2, "1f1b", {"parallel__cp": 2, "parallel__pp": 1, "parallel__shard": "full"}),
}


def _trainer_vs_unsplit(dp: int, schedule: str, overrides: dict) -> dict:
    import scale_cases

    worst = scale_cases.dp_equivalence(dp, schedule, 2, **overrides)
    return {key: worst[key] for key in ("loss", "grad", "param", "params_compared")}


def _packed_chat_vs_unsplit() -> dict:
    import masked_cases

    worst = masked_cases.masked_equivalence(1, "1f1b", 2, chat=True, parallel__cp=2)
    return {key: worst[key] for key in ("loss", "grad", "param", "val", "params_compared")}


def _resumed_under_another_cp() -> dict:
    """pp 2 x cp 2 trains 2 steps and saves; dp 2 x pp 2 (cp 1) resumes: every parameter as saved."""
    import torch.distributed as dist

    import scale_cases
    from pipeflow.run.builder import build_run

    cfg = scale_cases.make_config(1, "1f1b", 2, parallel__cp=2, pipeline__profile=True)
    trainer = build_run(cfg, torch.device("cpu"))
    ring = re.search(r"cp ring pass ([\d.]+) ms \+ (?:[\d.]+ MB/s|no per-byte cost)", trainer.describe())
    for step in range(2):
        trainer.train_step(step)
    path = trainer.save_checkpoint(2)
    mine = {f"{idx}.{name}": p.detach().clone() for s, stage in trainer.parts.stages.items()
            for layer, idx in zip(stage.module, trainer.ranges[s]) for name, p in layer.named_parameters()}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    trained = {key: value for part in every for key, value in part.items()}
    again_cfg = scale_cases.make_config(2, "1f1b", 2, train__run_dir=f"{cfg.train.run_dir}-cp1", train__resume=path)
    again = build_run(again_cfg, torch.device("cpu"))
    step = again.resume()
    diffs = [_rel(p.detach(), trained[f"{idx}.{name}"]) for s, stage in again.parts.stages.items()
             for layer, idx in zip(stage.module, again.ranges[s]) for name, p in layer.named_parameters()]
    return {"step": step, "compared": len(diffs), "worst": max(diffs), "saved_cp": trainer.topology.mesh.cp,
            "resumed_cp": again.topology.mesh.cp, "ring": ring and float(ring.group(1)),
            "passes": sum(p.ring_forward_passes for p in trainer.plan.layout.profiles)}


@pytest.fixture(scope="module")
def world4(request):
    cases = [(name, functools.partial(_ring_vs_whole, cp, **kwargs)) for name, (cp, kwargs) in CASES.items()]
    cases += [(name, functools.partial(_trainer_vs_unsplit, *case)) for name, case in TRAINER_CASES.items()]
    cases.append(("resume-cp1", _resumed_under_another_cp))
    cases.append(("gpt-pp2-cp2-chat-packed", _packed_chat_vs_unsplit))
    return run_cases(4, selected_cases(request, cases))


@pytest.mark.parametrize("name", list(CASES))
def test_ring_attention_equals_attention_over_the_whole_sequence(world4, name):
    """Issue 59: each rank's output and its q, k, v gradients (the backward's dK and dV carried home
    round the ring) equal the whole sequence's, causal, with a sliding window, with packed
    documents crossing the chunk boundaries, grouped-query attention carrying the few K/V heads."""
    tolerance = 1e-5 if "float32" in name else TOLERANCE
    for rank, result in enumerate(world4[name]):
        assert result.error is None, f"rank {rank}: {result.error}"
        assert max(result.value.values()) <= tolerance, (rank, result.value)


@pytest.mark.parametrize("name", list(TRAINER_CASES))
def test_the_trainer_with_context_parallelism_equals_the_unsplit_model(world4, name):
    """Issue 59: model=gpt with parallel.cp through the real Trainer (each rank its head and tail
    chunks, positions global, the loss weighted by its chunks' targets, gradients averaged over
    dp x cp) against the unsplit model on the whole batch: loss, every gradient and parameter over
    3 AdamW steps (float64); cp 4 alone, pp 2 x cp 2 with 1F1B and ZB-V, dp 2 x cp 2, tp 2 x cp 2."""
    for rank, result in enumerate(world4[name]):
        assert result.error is None, f"rank {rank}: {result.error}"
        v = result.value
        assert v["params_compared"] > 0 and max(v["loss"], v["grad"], v["param"]) <= 1e-9, (rank, v)


def test_a_checkpoint_of_a_cp_run_resumes_under_another_cp(world4):
    """Issue 59: the cp ranks hold the same parameters, saved once; a run without cp resumes them.
    The saving run profiled its layers: its prediction prices the cp ring on its own group's link."""
    for rank, result in enumerate(world4["resume-cp1"]):
        assert result.error is None, f"rank {rank}: {result.error}"
        v = result.value
        assert (v["step"], v["saved_cp"], v["resumed_cp"]) == (2, 2, 1) and v["compared"] > 0, v
        assert v["worst"] == 0.0, v
        # the start-of-run prediction prices the attention's passes on a pass timed on the cp group
        assert v["ring"] is not None and v["ring"] >= 0 and v["passes"] > 0, v  # a fit may give no per-byte term


def test_packed_documents_across_chunk_boundaries_train_as_the_unsplit_model(world4):
    """Issue 59: data=chat's packed conversations (prompts masked) on pp 2 x cp 2: each rank's chunks
    with the whole rows' document ids; loss, gradients, parameters and the held-out loss (float64)."""
    for rank, result in enumerate(world4["gpt-pp2-cp2-chat-packed"]):
        assert result.error is None, f"rank {rank}: {result.error}"
        v = result.value
        assert v["params_compared"] > 0 and max(v["loss"], v["grad"], v["param"], v["val"]) <= 1e-9, (rank, v)


def test_a_cp_run_whose_layers_take_no_hook_is_a_config_error(one_rank_group):
    """Issue 59: the builder raised this ConfigError without importing it (a NameError instead)."""
    import types

    from pipeflow.errors import ConfigError
    from pipeflow.run.assembly import attach_context_parallel
    from pipeflow.runtime.transport import Deadlines

    mesh = types.SimpleNamespace(cp_group=None, cp=2)
    stages = {0: types.SimpleNamespace(module=torch.nn.Sequential(torch.nn.Linear(2, 2)))}
    with pytest.raises(ConfigError, match=r"^parallel.cp=2: no layer of stage\(s\) \[0\] takes context parallelism"):
        attach_context_parallel(stages, mesh, torch.device("cpu"), Deadlines(30.0, 30.0))
