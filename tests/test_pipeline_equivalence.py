"""Pipelined training equals the unsplit model (float64), on 2 and 4 gloo processes.

All cases of one world size run inside one process group (tests/mp_harness.py), so torch is
imported and the group created once per world size.
"""
from __future__ import annotations

import functools
import itertools

import pytest

import moe_cases
import pipeline_cases as cases
from mp_harness import CaseResult, run_cases, selected_cases

TOLERANCE = 1e-9
MODELS = ("gpt", "masked_mlp")
SCHEDULES = ("gpipe", "1f1b")
MICROBATCHES = (1, 3, 4, 8)  # below, equal to and above the stage counts 2 and 4
CHUNKED_SCHEDULES = ("interleaved_1f1b", "looped_bfs", "zb_h1", "zbv", "dualpipev")
NEW_SCHEDULES = ("interleaved_zb", "zb_h2", "v_half", "v_min", "auto")  # issue 21: one model, three counts


CLIP = 0.05


def _equivalence_cases() -> list[tuple[str, object]]:
    plain = [
        (f"eq-{model}-{schedule}-m{m}", functools.partial(cases.equivalence, model, schedule, m))
        for model, schedule, m in itertools.product(MODELS, SCHEDULES, MICROBATCHES)
    ]
    tied = [  # GPT with the token embedding tied to the output head (first and last stage)
        (f"eq-gpt_tied-{schedule}-m{m}", functools.partial(cases.equivalence, "gpt_tied", schedule, m))
        for schedule, m in (("1f1b", 4), ("gpipe", 3))
    ]
    # Several chunks per rank (loop or V placement), split backward (B then W): models of 8
    # layers; the k-th of three micro-batch counts for this p, k=0 the smallest accepted.
    chunked = [
        (f"eq-{model}-{schedule}-count{k}", functools.partial(cases.equivalence_nth_count, model, schedule, k))
        for schedule, model, k in itertools.product(CHUNKED_SCHEDULES, ("gpt8", "masked_mlp8"), range(3))
    ]
    new = [
        (f"eq-gpt8-{schedule}-count{k}", functools.partial(cases.equivalence_nth_count, "gpt8", schedule, k))
        for schedule, k in itertools.product(NEW_SCHEDULES, range(3))
    ]
    flexible = [  # interleaved 1F1B at counts that are not multiples of p (m < p included)
        (f"eq-gpt8-interleaved_1f1b-m{m}", functools.partial(cases.equivalence, "gpt8", "interleaved_1f1b", m))
        for m in (1, 3)
    ]
    tied_v = [  # V placement puts the first and last stage, so both tied copies, on rank 0
        ("eq-gpt_tied8-zbv-m4", functools.partial(cases.equivalence, "gpt_tied8", "zbv", 4)),
        ("eq-gpt_tied8-interleaved_1f1b-m4", functools.partial(cases.equivalence, "gpt_tied8", "interleaved_1f1b", 4)),
    ]
    own = [  # the README's custom-model example; stages placed by hand, stage s on rank p-1-s
        ("eq-residual_mlp-1f1b-m4", functools.partial(cases.equivalence, "residual_mlp", "1f1b", 4)),
        ("eq-gpt-1f1b-m4-reversed", functools.partial(cases.equivalence, "gpt", "1f1b", 4, reversed_placement=True)),
        ("eq-gpt8-interleaved_1f1b-m4-reversed",
         functools.partial(cases.equivalence, "gpt8", "interleaved_1f1b", 4, reversed_placement=True)),
    ]
    resnet = [("eq-resnet18-1f1b-m4", functools.partial(cases.equivalence, "resnet18", "1f1b", 4, steps=2))]
    clipped = [("eq-clipped-gpt_tied-1f1b-m4", functools.partial(cases.equivalence, "gpt_tied", "1f1b", 4, clip=CLIP))]
    runtimes = [  # the NCCL-shaped posting (one call per step) and the exact simulated semantics
        ("eq-gpt8-zbv-m4-grouped", functools.partial(cases.equivalence, "gpt8", "zbv", 4, runtime="grouped")),
        ("eq-masked_mlp-gpipe-m3-grouped", functools.partial(cases.equivalence, "masked_mlp", "gpipe", 3, runtime="grouped")),
        ("eq-masked_mlp-1f1b-m8-strict", functools.partial(cases.equivalence, "masked_mlp", "1f1b", 8, runtime="strict")),
        ("eq-gpt8-dualpipev-m8-at-step", functools.partial(cases.equivalence, "gpt8", "dualpipev", 8, runtime="at-step")),
        # comm.recvs_ahead=auto: one step ahead, one at-step, then the choice (4 steps)
        ("eq-masked_mlp-1f1b-m4-auto", functools.partial(cases.equivalence, "masked_mlp", "1f1b", 4, steps=4, runtime="auto")),
    ]
    modules = [  # pipeflow.models.from_module: an nn.Sequential, the blocks form (tied), the traced form (a skip),
        # each against the user's own nn.Module (its forward unchanged) with the weights from_module made
        (f"eq-{model}-{schedule}-m{m}", functools.partial(cases.equivalence, model, schedule, m, against_module=True))
        for model in ("module_seq", "module_gpt_tied", "module_traced_skip")
        for schedule, m in (("1f1b", 4), ("gpipe", 3))
    ]
    offloaded = [  # pipeline.offload=all: every schedule, each (stage, micro-batch) group copied out and back
        (f"eq-gpt8-{schedule}-m8-offload_all", functools.partial(cases.equivalence, "gpt8", schedule, 8, offload="all"))
        for schedule in OFFLOAD_SCHEDULES
    ] + [  # with activation checkpointing (what is saved: the checkpoints' inputs), and auto's plans
        ("eq-gpt8-zbv-m4-offload_all-ckpt",
         functools.partial(cases.equivalence, "gpt8", "zbv", 4, offload="all", checkpoint_every=2)),
        ("eq-gpt8-interleaved_1f1b-m4-offload_auto-ckpt",
         functools.partial(cases.equivalence, "gpt8", "interleaved_1f1b", 4, offload="auto", checkpoint_every=1)),
        ("eq-masked_mlp-gpipe-m4-offload_auto", functools.partial(cases.equivalence, "masked_mlp", "gpipe", 4, offload="auto")),
        ("eq-gpt8-zbv-m4-grouped-offload_all",
         functools.partial(cases.equivalence, "gpt8", "zbv", 4, runtime="grouped", offload="all")),
    ]
    return plain + tied + chunked + new + flexible + tied_v + own + resnet + clipped + runtimes + modules + offloaded


OFFLOAD_SCHEDULES = ("gpipe", "1f1b") + CHUNKED_SCHEDULES + NEW_SCHEDULES


VARIABLE_SCHEDULES = ("gpipe", "1f1b") + CHUNKED_SCHEDULES + NEW_SCHEDULES


def _variable_cases() -> list[tuple[str, object]]:
    """Micro-batches of different shapes in one step: every built-in schedule (GPT, lengths and
    rows differ; 8 layers for the chunked ones) at its smallest accepted count, and uneven rows
    alone for the masked MLP."""
    def counted(schedule: str) -> functools.partial:
        model = "gpt" if schedule in ("gpipe", "1f1b") else "gpt8"
        return functools.partial(_variable_nth_count, model, schedule)
    return [(f"var-{schedule}", counted(schedule)) for schedule in VARIABLE_SCHEDULES] + [
        ("var-masked_mlp-1f1b-m3", functools.partial(cases.variable_equivalence, "masked_mlp", "1f1b", 3)),
        ("var-gpt-1f1b-m8", functools.partial(cases.variable_equivalence, "gpt", "1f1b", 8)),
        # packed documents: (tokens, document ids) through every layer, block-diagonal attention
        ("var-gpt_packed-1f1b-m3", functools.partial(cases.variable_equivalence, "gpt_packed", "1f1b", 3)),
        ("var-gpt-1f1b-m8-offload_all", functools.partial(cases.variable_equivalence, "gpt", "1f1b", 8, offload="all")),
        ("var-gpt8-zbv-m4-offload_all", functools.partial(cases.variable_equivalence, "gpt8", "zbv", 4, offload="all")),
    ]


def _variable_nth_count(model: str, schedule: str) -> dict:
    """:func:`cases.variable_equivalence` at the schedule's middle count for this world (3 shapes at least)."""
    import torch.distributed as dist

    return cases.variable_equivalence(model, schedule, cases.chunked_microbatch_counts(schedule, dist.get_world_size())[1])


MEMORY_CASES = (("gpt", "gpipe", 4), ("gpt", "1f1b", 8), ("gpt8", "interleaved_1f1b", 8), ("gpt8", "zbv", 8))
OFFLOAD_MEMORY_CASES = (("gpt", "gpipe", 4, "all"), ("gpt8", "zbv", 8, "all"), ("gpt", "gpipe", 8, "auto"))


def _memory_cases() -> list[tuple[str, object]]:
    return [(f"memory-{schedule}", functools.partial(cases.memory_matches, model, schedule, m))
            for model, schedule, m in MEMORY_CASES] + [
        (f"memory-{schedule}-m{m}-offload_{mode}", functools.partial(cases.memory_matches, model, schedule, m, mode))
        for model, schedule, m, mode in OFFLOAD_MEMORY_CASES]


MOE_CASES = {  # name: (schedule, m, overrides); pp 2 x dp (world / 2), a mixture-of-experts GPT (issue 45)
    "moe-1f1b-m4": ("1f1b", 4, {}),
    # ZB-H1 and DualPipeV: experts split over the dp ranks where there are some (p 4), as 1F1B and ZB-V below
    "moe-zb_h1-m4-ckpt-ep_p4": ("zb_h1", 4, {"checkpoint_every": 1, "ep": "where_dp"}),
    "moe-zbv-m4-variable-every2": ("zbv", 4, {"variable": True, "every": 2}),
    "moe-dualpipev-m4-ckpt2-ep_p4": ("dualpipev", 4, {"checkpoint_every": 2, "ep": "where_dp"}),
    # issue 46: the same with pipeline.overlap_pairs=false (each pair F, then B): the same numbers
    "moe-dualpipev-m4-ckpt2-ep_p4-sequential": ("dualpipev", 4, {"checkpoint_every": 2, "ep": "where_dp",
                                                                  "overlap": False}),
    "moe-1f1b-m3-bias-capacity": ("1f1b", 3, {"balance": "bias", "capacity": 1.0}),
    # expert parallelism, ep = dp = 2 (4 processes only): each rank keeps half the experts, all_to_all
    "moe-ep-1f1b-m4": ("1f1b", 4, {"ep": True}),
    "moe-ep-zbv-m4-ckpt-variable-bias-capacity": ("zbv", 4, {"ep": True, "checkpoint_every": 1, "variable": True,
                                                             "balance": "bias", "capacity": 1.0}),
}


def _moe_cases() -> list[tuple[str, object]]:
    return [(name, functools.partial(moe_cases.moe_equivalence, schedule, m, **overrides))
            for name, (schedule, m, overrides) in MOE_CASES.items()]


MASKED_SCHEDULES = {"gpipe": "gpt", "1f1b": "gpt", "zb_h1": "gpt8", "zbv": "gpt8", "interleaved_1f1b": "gpt8",
                    "dualpipev": "gpt8"}  # schedule: model (8 layers where a rank holds two stages)


def _masked_cases() -> list[tuple[str, object]]:
    return [(f"masked-{schedule}", functools.partial(cases.masked_equivalence, model, schedule))
            for schedule, model in MASKED_SCHEDULES.items()]


def _all_cases() -> list[tuple[str, object]]:
    return _equivalence_cases() + _variable_cases() + _memory_cases() + _moe_cases() + _masked_cases() + [
        ("eval-gpt", functools.partial(cases.eval_matches, "gpt", 4)),
        ("dynamic-shapes", cases.dynamic_shapes),
        ("send-recv", cases.send_recv_ring),
        ("transfer-time", cases.transfer_time),
        ("events", cases.events_recorded),
        ("events-zbv", functools.partial(cases.events_recorded, "gpt", 8, "zbv", n_layer=6)),
        ("only-own-layers", cases.only_own_layers),
        ("module-own-bytes", cases.module_own_bytes),
        ("shape-change-error", cases.shape_change_is_an_error),  # breaks the group: last
    ]


@pytest.fixture(scope="module", params=[2, 4], ids=["p2", "p4"])
def world(request: pytest.FixtureRequest) -> tuple[int, dict[str, list[CaseResult]]]:
    return request.param, run_cases(request.param, selected_cases(request, _all_cases()))


def _values(results: list[CaseResult]) -> list:
    errors = [f"rank {r}: {res.error}" for r, res in enumerate(results) if res.error is not None]
    assert not errors, "\n".join(errors)
    return [res.value for res in results]


@pytest.mark.parametrize("name", [name for name, _ in _equivalence_cases()])
def test_pipelined_training_equals_unsplit_model(world, name: str) -> None:
    p, results = world
    values = _values(results[name])
    posting_auto = name.endswith("-auto")  # comm.recvs_ahead=auto's case (not schedule=auto's)
    steps = 2 if "resnet" in name else 4 if posting_auto else 3
    assert sum(v["losses_compared"] for v in values) == steps  # last stage, every step
    assert all(v["params_compared"] > 0 for v in values)  # every rank holds parameters
    if posting_auto:  # every rank of the pipeline made the same choice, after step 3
        assert len({v["ahead_choice"] for v in values}) == 1 and values[0]["ahead_choice"] in (True, False)
    if "clipped" in name:  # the clip must really bite, or the test proves nothing
        assert all(v["norm_before_clip"] > 2 * CLIP for v in values)
    if "count" in name:
        k = int(name[-1])
        expected = cases.chunked_microbatch_counts(name.split("-")[2], p)[k]
        assert all(v["microbatches"] == expected for v in values)
    if "offload_all" in name:  # every group of every rank (its stages x m) went to the host and came back
        m = int(name.split("-m")[1].split("-")[0])
        assert all(v["groups_offloaded"] in (m, 2 * m) for v in values), values
        # a checkpointed stage of one layer saves only its input, which stays (a receive buffer)
        assert all(v["offloaded"] > 0 for v in values) or name.endswith("-ckpt"), values
    for rank, v in enumerate(values):
        for key in ("loss", "grad", "param"):
            assert v[key] <= TOLERANCE, f"p={p} rank {rank}: {key} differs by {v[key]:.3e}"


@pytest.mark.parametrize("name", [name for name, _ in _variable_cases()])
def test_microbatches_of_different_shapes_equal_unsplit_model(world, name: str) -> None:
    p, results = world
    values = _values(results[name])
    assert sum(v["losses_compared"] for v in values) == 3
    for rank, v in enumerate(values):
        for key in ("loss", "grad", "param"):
            assert v[key] <= TOLERANCE, f"p={p} rank {rank}: {key} differs by {v[key]:.3e}"
        assert v["buffers_after_first_step"] == 0, f"p={p} rank {rank}: the pool allocated after step 0"


@pytest.mark.parametrize("schedule", list(MASKED_SCHEDULES))
def test_masked_targets_weighed_by_counted_targets_equal_unsplit_model(world, schedule: str) -> None:
    """Issue 42: micro-batches weighed by the targets their loss counts (the Trainer's weights) give
    the unsplit model's loss and gradients on a masked batch, an all-masked micro-batch included."""
    p, results = world
    values = _values(results[f"masked-{schedule}"])
    assert sum(v["losses_compared"] for v in values) == 2
    for rank, v in enumerate(values):
        for key in ("loss", "grad"):
            assert v[key] <= TOLERANCE, f"p={p} rank {rank}: {key} differs by {v[key]:.3e}"


@pytest.mark.parametrize("name", list(MOE_CASES))
def test_pipelined_moe_equals_unsplit_model_aux_loss_included(world, name: str) -> None:
    """pp 2 (x dp 2 on 4 processes): the total loss (cross entropy + aux), every gradient and
    parameter equal the unsplit model's, which computes the aux loss per layer and micro-batch;
    the routers chose alike (tokens per expert, dropped, biases equal).  With ep (4 processes),
    each rank holds half of every MoE layer's experts, exchanged by all_to_all."""
    p, results = world
    values = _values(results[name])
    if "-ep-" in name and p == 2:  # one pipeline: no dp ranks to split the experts over
        assert all(v == {"skipped": True} for v in values)
        return
    assert sum(v["losses_compared"] for v in values) == 2 * (p // 2)  # each replica's last stage, every step
    for rank, v in enumerate(values):
        assert v["counts_equal"], f"p={p} rank {rank}: the routers chose otherwise than the reference's"
        assert v["aux_value"] > 0.01  # the aux loss is there (and weighs in the compared loss)
        for key in ("loss", "grad", "param", "aux", "bias"):
            assert v[key] <= TOLERANCE, f"p={p} rank {rank}: {key} differs by {v[key]:.3e}"
        if "capacity" in name:  # the capacity really drops, the biases really move
            assert v["dropped"] > 0 and v["bias_moved"] > 0, v
    if name == "moe-ep-1f1b-m4":  # each rank holds half the expert parameters it holds without ep
        without = _values(results["moe-1f1b-m4"])
        assert all(2 * v["expert_params"] == w["expert_params"] > 0 for v, w in zip(values, without))
    if name == "moe-dualpipev-m4-ckpt2-ep_p4" and p == 4:  # issue 46: the pairs ran interleaved ...
        for rank, v in enumerate(values):  # ... each B computed (an exchange of it) before its F ended
            assert v["pairs"] > 0 and v["interleaved"] == v["pairs"], f"rank {rank}: {v}"
        sequential = _values(results[f"{name}-sequential"])  # ... and changed no number
        for v, w in zip(values, sequential):
            assert w["pairs"] == 0
            for key in ("loss", "grad", "param", "aux"):
                assert abs(v[key] - w[key]) <= 1e-12, (key, v[key], w[key])


@pytest.mark.parametrize("name", [name for name, _ in _memory_cases()])
def test_measured_tensor_memory_is_the_predicted(world, name: str) -> None:
    """The accountant's count of a step (after every action, and at its end) beside tensor_memory's
    prediction from the profiled layers: parameters, grads and comm buffers exactly, AdamW's
    state but its 4-byte step counters, the in-step peak within 2% (0.6% at most when written:
    a split backward's kept gradients are estimated from the layers' output sizes)."""
    p, results = world
    for rank, v in enumerate(_values(results[name])):
        (resident, peak), (resident_p, peak_p) = v["measured"], v["predicted"]
        assert resident[:2] == resident_p[:2] and resident[3:] == resident_p[3:], (rank, resident, resident_p)
        assert 0 <= resident[2] - resident_p[2] <= 4 * 64, (rank, resident, resident_p)  # one step counter a tensor
        assert peak[:2] == peak_p[:2] and peak[4] == peak_p[4], (rank, peak, peak_p)
        assert abs(sum(peak_p) / sum(peak) - 1) <= 0.02, f"p={p} rank {rank}: measured {peak}, predicted {peak_p}"
        if "offload_all" in name:  # the bytes copied to the host: the profile's saved tensors less what stays
            assert v["offloaded"] == v["offloaded_predicted"] > 0, (rank, v["offloaded"], v["offloaded_predicted"])
        elif "offload" in name:
            assert v["offloaded"] == v["offloaded_predicted"], (rank, v["offloaded"], v["offloaded_predicted"])


def test_forward_only_eval_equals_unsplit_loss(world) -> None:
    _, results = world
    assert max(_values(results["eval-gpt"])) <= TOLERANCE


def test_dynamic_shapes_renegotiate(world) -> None:
    _, results = world
    assert max(_values(results["dynamic-shapes"])) <= TOLERANCE


def test_events_record_every_action(world) -> None:
    p, results = world
    for counts in _values(results["events"]):
        assert counts["F"] == counts["B"] == 4 and "W" not in counts  # one stage per rank, m = 4
        assert counts["comm"] >= 4  # at least the activation or gradient of each micro-batch
    for counts in _values(results["events-zbv"]):
        assert counts["F"] == counts["B"] == counts["W"] == 16  # two stages per rank, m = 8


def test_each_rank_builds_only_its_own_layers(world) -> None:
    for rank, text in enumerate(_values(world[1]["only-own-layers"])):
        assert text.startswith("built only own layers; foreign build raised: layer"), f"rank {rank}: {text}"


def test_auto_measures_one_transfer_cost_for_every_rank(world) -> None:
    values = _values(world[1]["transfer-time"])
    assert len(set(values)) == 1 and 0 < values[0] < 10, values


def test_from_module_materialises_only_this_ranks_layers(world) -> None:
    """Built from a constructor, the model exists whole only on the meta device: the bytes a rank
    allocates while building the spec and its layers stay within 1.1x of its own layers'."""
    for rank, v in enumerate(_values(world[1]["module-own-bytes"])):
        assert 0 < v["own"] < 0.7 * v["whole"], f"rank {rank}: {v}"  # a rank holds a part: the bound bites
        assert v["allocated"] <= 1.1 * v["own"], f"rank {rank}: allocated {v['allocated']} B, own layers {v['own']} B"


def test_send_recv_is_a_ring_exchange(world) -> None:
    p, results = world
    for rank, got in enumerate(_values(results["send-recv"])):
        assert got == [float((rank - 1) % p)] * 3


def test_shape_change_without_dynamic_shapes_is_a_clear_error(world) -> None:
    p, results = world
    texts = _values(results["shape-change-error"])
    assert texts[0].startswith("ShapeMismatchError"), texts[0]
    assert "stage 0 (rank 0)" in texts[0] and "stage 1 (rank 1)" in texts[0]
    assert "comm.shapes=per_step" in texts[0]
    assert "[6, 16]" in texts[0] and "[12, 16]" in texts[0]  # micro-batch now vs negotiated
    # rank 1 waited for micro-batch 0 of stage 0 and timed out with a message that says so
    assert texts[1].startswith("PipelineTimeoutError"), texts[1]
    assert "recv activation of micro-batch 0 from stage 0 (rank 0)" in texts[1]
