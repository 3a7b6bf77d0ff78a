"""Planning a cluster you do not have: the hardware presets, the roofline's layer costs, the
extrapolated simulation against the full one, the Table 1 comparison and the planner's command."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pipeflow.errors import ConfigError
from pipeflow.models.gpt import build_gpt
from pipeflow.planning.cluster_search import Layout, Workload, predict
from pipeflow.planning.hardware import load_hardware, override, preset_ids
from pipeflow.planning.roofline import Efficiency, Placement, layer_profile, trace_layers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import published_runs  # noqa: E402  (benchmarks/published_runs.py)

VENDOR_BF16 = {"a100_sxm_80gb": 312, "h100_sxm": 989, "h200_sxm": 989, "b200": 2250}  # dense TFLOP/s


def test_presets_load_with_their_dense_peaks():
    assert set(preset_ids()) == set(VENDOR_BF16)
    for name, peak in VENDOR_BF16.items():
        cluster = load_hardware(name)
        assert cluster.gpu.peak_flops("bf16") == peak * 1e12
        assert cluster.intra.bandwidth_gbps > cluster.inter.bandwidth_gbps > 0 and cluster.gpus_per_host == 8


def test_a_file_and_measured_figures_override_a_preset(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("gpus_per_host: 4\nintra: {bandwidth_gbps: 100}\ninter: {bandwidth_gbps: 10, latency_us: 5}\n"
                    "gpu: {name: X, peak_tflops: {bf16: 100}, memory_gb: 24, memory_bandwidth_gbps: 900}\n")
    mine = load_hardware(str(path))
    assert (mine.gpus_per_host, mine.inter.latency_us, mine.gpu.memory_gb) == (4, 5.0, 24.0)
    measured = override(load_hardware("h100_sxm"), {"inter.bandwidth_gbps": 42, "gpu.peak_tflops.bf16": 700})
    assert measured.inter.bandwidth_gbps == 42 and measured.gpu.peak_flops("bf16") == 700e12
    assert measured.group_link([0, 8]).bandwidth_gbps == 42 and measured.group_link([0, 7]) == measured.intra
    assert measured.group_link(range(16)).bandwidth_gbps == 8 * 42  # 8 NICs per host carry a ring
    with pytest.raises(ConfigError, match="no field"):
        override(measured, {"inter.speed": 1})
    with pytest.raises(ConfigError, match="neither a preset"):
        load_hardware("no_such_gpu")
    path.write_text(path.read_text().replace("bandwidth_gbps: 100", "bandwidth_gbps: -1"))
    with pytest.raises(ConfigError, match="intra.bandwidth_gbps"):
        load_hardware(str(path))


def _block(width: int, heads: int = 4, seq: int = 256):
    spec = build_gpt(vocab_size=512, block_size=seq, n_layer=1, n_head=heads, n_embd=width)
    return trace_layers(spec, seq)[1]


def test_a_layers_costs_scale_as_its_shapes_do():
    narrow, wide = _block(256), _block(512)
    seq = 256
    assert sum(2 * x.rows * x.k * x.n for x in narrow.linears) == 24 * seq * 256 ** 2  # GPT block: 24 s h^2
    assert wide.model_flops() - 3 * wide.attention_flops == pytest.approx(4 * (narrow.model_flops()
                                                                                - 3 * narrow.attention_flops))
    assert narrow.attention_flops == 4 * seq * seq * 256
    cluster = load_hardware("h100_sxm")
    flat = Efficiency(matmul_knee=0.0)  # no size dependence: times exactly linear in b
    one, two = (layer_profile(wide, b, Placement(), cluster, flat) for b in (1, 2))
    assert two.forward_s == pytest.approx(2 * one.forward_s) and two.weight_grad_s == pytest.approx(2 * one.weight_grad_s)
    assert two.activation_bytes == 2 * one.activation_bytes
    split = layer_profile(wide, 1, Placement(tp=2, sequence_parallel=True), cluster, flat)
    assert split.weight_grad_s == pytest.approx(one.weight_grad_s / 2) and split.params < one.params
    assert split.activation_bytes == pytest.approx(one.activation_bytes / 2, rel=0.01)
    again = layer_profile(wide, 1, Placement(recompute=True), cluster, flat)
    assert again.input_grad_s == pytest.approx(one.input_grad_s + one.forward_s)
    assert again.activation_bytes < one.activation_bytes / 10


@pytest.mark.parametrize("schedule,v,m", [("1f1b", 1, 23), ("interleaved_1f1b", 2, 28), ("zb_h1", 1, 21),
                                          ("zbv", 2, 30), ("gpipe", 1, 22)])
def test_the_extrapolated_steady_state_equals_the_full_simulation(schedule, v, m):
    spec = build_gpt(vocab_size=512, block_size=128, n_layer=8, n_head=4, n_embd=256)
    work = Workload(trace_layers(spec, 128), 128, 2 * m)
    layout = Layout(2, 4, 2, schedule, v, 1, order=("pp", "dp", "tp"))
    cluster = load_hardware("a100_sxm_80gb")
    fast, full = (predict(work, layout, cluster, extrapolate=e) for e in (True, False))
    assert fast.extrapolated and not full.extrapolated
    assert fast.step_s == pytest.approx(full.step_s, rel=1e-9)
    assert fast.memory_bytes == pytest.approx(full.memory_bytes, rel=1e-9)
    assert fast.bubble == pytest.approx(full.bubble, rel=1e-9)


def test_table1_of_narayanan_et_al_is_reproduced():
    rows = published_runs.table1()
    errors = [x / row.published - 1 for row, x, _ in rows]
    assert sum(abs(e) for e in errors) / len(errors) <= 0.05
    assert max(abs(e) for e in errors) <= 0.10
    rise, published = rows[-1][1] - rows[3][1], rows[-1][0].published - rows[3][0].published
    assert rise > 0 and abs(rise - published) <= published / 2  # 18.4B -> 1T, the paper: 135 -> 163
    assert all(pred.memory_bytes < 80e9 for _, _, pred in rows)  # the rows fit 80 GB
    # the held-out run (Korthikanti et al.) is checked by `python benchmarks/published_runs.py` (exit 1 if missed)


def test_the_planner_lays_a_model_on_a_described_cluster():
    from pipeflow.run.plan import compose_config, run_plan

    words = ["plan.hardware=h100_sxm", "plan.gpus=16", "model.n_layer=8", "model.n_embd=1024", "model.n_head=8",
             "data.vocab_size=1024", "data.seq_len=512", "data.batch_size=64", "parallel.pp=2", "plan.train_tokens=1e9",
             "plan.gpu_hour_price=2", "plan.top=3"]
    result, report = run_plan(compose_config(words), overrides=words)
    assert result.candidates and all(c.layout.pp == 2 for c in result.candidates)
    assert "TFLOP/s per GPU" in report and "MFU" in report and "GPU-hours" in report and "cost" in report
    first = next(line for line in report.splitlines() if line.startswith("  #1:"))
    assert "parallel.pp=2" in first and "'parallel.order=[" in first
    assert "run the pick: torchrun --nnodes 2 --nproc-per-node 8 train.py model.n_layer=8" in report
    with pytest.raises(ConfigError, match="plan.gpus"):
        run_plan(compose_config(["plan.hardware=h100_sxm"]))
    assert torch.get_default_device().type == "cpu"  # nothing left on the meta device


def test_the_searchs_pick_is_the_fastest_of_every_layout_simulated():
    from dataclasses import replace

    from pipeflow.planning.cluster_space import ClusterSpace, search_cluster

    spec = build_gpt(vocab_size=4096, block_size=512, n_layer=4, n_head=8, n_embd=1024)
    work = Workload(trace_layers(spec, 512), 512, 32)
    cluster = load_hardware("a100_sxm_80gb")
    space = ClusterSpace(8, schedules=("1f1b", "interleaved_1f1b", "zbv"), microbatch_sizes=(1, 2), max_chunks=2,
                         shards=("none",), shortlist=3)
    picks, counts = search_cluster(work, cluster, space, 40e9)
    every, all_counts = search_cluster(work, cluster, replace(space, shortlist=10**6, max_simulated=10**6), 40e9)
    assert counts.simulated < all_counts.simulated
    assert picks[0].step_s == every[0].step_s and len(picks) == space.shortlist
