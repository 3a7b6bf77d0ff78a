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
from pipeflow.planning.costs.layer_trace import LayerShape, trace_layers
from pipeflow.planning.costs.roofline import Efficiency, Placement, layer_profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "predictions"))
import published_runs  # noqa: E402  (benchmarks/predictions/published_runs.py)

VENDOR_BF16 = {"a100_sxm_80gb": 312, "a100_sxm_40gb": 312, "h100_sxm": 989, "h200_sxm": 989, "b200": 2250}  # dense TFLOP/s


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


def test_a_gpus_measured_matmul_rate_sets_its_matmuls_and_is_checked(tmp_path):
    fractions = {name: load_hardware(name).gpu.matmul_flops("bf16") / (peak * 1e12)
                 for name, peak in VENDOR_BF16.items()}
    assert fractions["a100_sxm_80gb"] > fractions["h100_sxm"] > fractions["b200"] > 0.7  # 86.9%, 80.3%, 77.6%
    h100 = load_hardware("h100_sxm")
    assert h100.gpu.matmul_flops("fp8") == pytest.approx(1402.6e12)
    assert h100.gpu.matmul_flops("tf32") == pytest.approx(0.8 * 494e12)  # not measured: the typical fraction
    assert override(h100, {"gpu.peak_tflops.bf16": 700}).gpu.matmul_flops("bf16") == 700e12  # never above the peak
    block, place = _block(512), Placement()
    slower = override(h100, {"gpu.matmul_tflops.bf16": 397.25})  # half the measured rate: the matmuls take twice
    fast, slow = layer_profile(block, 4, place, h100), layer_profile(block, 4, place, slower)
    assert slow.weight_grad_s == pytest.approx(2 * fast.weight_grad_s)
    path = tmp_path / "mine.yaml"
    path.write_text("gpus_per_host: 4\nintra: {bandwidth_gbps: 100}\ninter: {bandwidth_gbps: 10}\ngpu: {name: X, "
                    "peak_tflops: {bf16: 100}, matmul_tflops: {bf16: 120}, memory_gb: 24, memory_bandwidth_gbps: 900}\n")
    with pytest.raises(ConfigError, match=r"gpu.matmul_tflops.bf16=120 exceeds gpu.peak_tflops.bf16=100"):
        load_hardware(str(path))
    path.write_text(path.read_text().replace("matmul_tflops: {bf16: 120}", "matmul_tflops: {fp8: 90}"))
    with pytest.raises(ConfigError, match=r"gpu.peak_tflops.fp8 is not"):
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


def test_a_fused_attention_kernel_runs_short_sequences_below_its_long_sequence_rate():
    """A query block's fixed loads and stores spread over its T keys: the attention term's rate is
    ``attention x T / (T + knee x ridge)``, the matmul's knee (the legacy kernel's ridge its own peak's)."""
    cluster, eff = load_hardware("h100_sxm"), Efficiency()
    ridge = cluster.gpu.peak_flops("bf16") / (cluster.gpu.memory_bandwidth_gbps * 1e9)
    assert _block(256).attention_keys == 256

    def seconds_per_flop(keys: int, attention: str = "fused") -> float:
        shape = LayerShape("attention", attention_flops=1e12, attention_keys=keys)
        return layer_profile(shape, 1, Placement(attention=attention), cluster, eff).forward_s / 1e12

    long_rate = 1 / (cluster.gpu.peak_flops("bf16") * eff.attention)
    for keys in (512, 4096):
        assert seconds_per_flop(keys) == pytest.approx(long_rate * (1 + eff.matmul_knee * ridge / keys))
    assert seconds_per_flop(512) > 1.3 * seconds_per_flop(65536)
    legacy = cluster.gpu.peak_flops("bf16_legacy")
    assert seconds_per_flop(1024, "legacy") == pytest.approx(
        (1 + eff.matmul_knee * legacy / (cluster.gpu.memory_bandwidth_gbps * 1e9) / 1024) / (legacy * eff.attention))


def test_a_fused_kernels_backward_recomputes_its_scores():
    """A flash backward recomputes QK^T and runs dV, dP, dQ, dK: five matmuls to the forward's two
    (it was costed as two forwards, like the unfused backward of its two matmuls)."""
    cluster = load_hardware("h100_sxm")
    shape = LayerShape("attention", attention_flops=1e12, attention_keys=4096, attention_scores=1e6,
                       attention_head_dim=128)
    for attention, times in (("fused", 2.5), ("legacy", 2.5), ("unfused", 2.0)):
        cost = layer_profile(shape, 1, Placement(attention=attention), cluster)
        assert cost.input_grad_s == pytest.approx(times * cost.forward_s), attention


def test_the_loss_moves_its_log_probabilities_and_megatrons_its_fp32_passes():
    """F.cross_entropy writes log-probabilities as large as its logits and reads them back in the
    backward: 2 and 4 times the logits' bytes (the trace counted one read, split over tp though
    pipeflow's head gathers whole logits on every tp rank).  Megatron's vocab-parallel loss keeps
    the logits split and moves them through fp32 passes (``published_rows.LOSSES``)."""
    import dataclasses

    import published_rows

    vocab, seq = 4096, 128
    head = trace_layers(build_gpt(vocab_size=vocab, block_size=seq, n_layer=1, n_head=4, n_embd=256), seq)[-1]
    logits = seq * vocab
    assert head.loss_elements == logits and head.loss_bytes == (2 * 2 * logits, 4 * 2 * logits)  # bf16 logits
    cluster = load_hardware("h100_sxm")
    bandwidth = cluster.gpu.memory_bandwidth_gbps * 1e9
    without = dataclasses.replace(head, loss_bytes=(0.0, 0.0))
    for tp in (1, 2):
        with_loss, bare = (layer_profile(s, 2, Placement(tp=tp), cluster) for s in (head, without))
        assert with_loss.forward_s - bare.forward_s == pytest.approx(2 * 4 * logits / bandwidth)  # not over tp
        assert with_loss.input_grad_s - bare.input_grad_s == pytest.approx(2 * 8 * logits / bandwidth)
    megatron = published_rows.with_loss((head,), published_rows.STACKS[("megatron_lm_readme", "h100")])[0]
    assert megatron.loss_bytes == (38 * logits, 14 * logits) and megatron.loss_split
    assert {x.style for x in megatron.linears} == {"colwise"}  # the logits stay split: no gather
    split = layer_profile(megatron, 2, Placement(tp=2), cluster)
    bare = layer_profile(dataclasses.replace(megatron, loss_bytes=(0.0, 0.0)), 2, Placement(tp=2), cluster)
    assert split.forward_s - bare.forward_s == pytest.approx(2 * 38 * logits / 2 / bandwidth)


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_a_blocks_activation_memory_is_korthikantis_for_a_fused_kernel(tp, sp):
    """Korthikanti et al. (2022), section 4: a layer keeps sbh(34 + 5as/h) bytes (16-bit) unsplit,
    sbh(10 + 24/t + 5as/(ht)) under tp t, sbh(34 + 5as/h)/t with sequence parallelism. The planner's
    block runs a fused attention kernel at dropout 0: no a s^2 scores (-5as^2 b), no 1-byte dropout
    masks (-2sbh, of Korthikanti's unsplit 10), the kernel's output kept beside the projection's
    input (+2sbh, split): sbh(8 + 26/t), or 34 sbh / t with sequence parallelism. (A rowwise
    linear's input is split over tp: the planner counted the projection's input unsplit.)"""
    s, h, a, b = 256, 512, 8, 2
    shape = _block(h, heads=a, seq=s)
    kept = layer_profile(shape, b, Placement(tp=tp, sequence_parallel=sp), load_hardware("h100_sxm")).activation_bytes
    korthikanti = s * b * h * ((34 + 5 * a * s / h) / tp if sp else 10 + 24 / tp + 5 * a * s / (h * tp))
    fused = korthikanti - 5 * a * s * s * b / tp - 2 * s * b * h / (tp if sp else 1) + 2 * s * b * h / tp
    assert kept == pytest.approx(fused, rel=0.005)  # and LayerNorm's float32 mean and rstd: 16 sb


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
    # the held-out run (Korthikanti et al.) is checked by `python benchmarks/predictions/published_runs.py` (exit 1 if missed)


def test_a_collective_hidden_behind_compute_still_costs_the_compute_beside_it():
    """Issue 62: NCCL's kernels take SMs and HBM bandwidth from the compute they overlap, so a
    hidden collective costs ``Efficiency.overlap`` of its time; one longer than its compute
    exposes the rest (it was free while hidden: the H100 FSDP rows, whose gathers take a third of
    their compute, were predicted 30% fast)."""
    from pipeflow.planning.cluster_search import dp_exposed_s
    from pipeflow.planning.costs.roofline import beside

    eff = Efficiency()
    assert beside(1.0, 10.0, eff) == pytest.approx(eff.overlap)  # hidden: the compute's loss
    assert beside(10.0, 1.0, eff) == pytest.approx(9.0)  # longer than its compute: the rest exposed
    assert beside(1.0, 10.0, Efficiency(overlap=0.0)) == 0.0
    replicas = Layout(1, 1, 8, "1f1b", 1, 1, overlap_dp=True)
    assert dp_exposed_s(1.0, replicas, 4, 2.0, 4.0, eff) == pytest.approx(eff.overlap + 1 / 16)
    fsdp = Layout(1, 1, 8, "1f1b", 1, 1, shard="full", overlap_dp=True)
    assert dp_exposed_s(3.0, fsdp, 1, 2.0, 4.0, eff) == pytest.approx(eff.overlap * 3.0 + 3.0 / 16)
    composer = Layout(1, 1, 8, "1f1b", 1, 1, shard="full", overlap_dp=True, dp_every_microbatch=True)
    assert dp_exposed_s(3.0, composer, 4, 2.0, 4.0, eff) == pytest.approx(4 * (eff.overlap * 3.0 + 3.0 / 16))
    shape = _block(1024, heads=8)  # wide enough that its tp collectives hide behind its matmuls
    at = {ov: layer_profile(shape, 64, Placement(tp=2, tp_overlap=True), load_hardware("h100_sxm"),
                            Efficiency(overlap=ov)) for ov in (0.0, 0.5)}
    assert at[0.5].forward_s > at[0.0].forward_s  # the tp collectives behind the matmuls cost too


def test_each_fsdp_unit_pays_the_rings_latency_across_every_rank():
    """Issue 62: a ring collective over n ranks takes n - 1 steps, each at NCCL's latency (its
    tuning table), so FSDP's three collectives per unit over 512 ranks cost milliseconds apiece
    that one latency per step hid (the 512-GPU H100 FSDP rows were predicted 20-26% fast)."""
    from pipeflow.planning.cluster_search import reduction_s
    from pipeflow.planning.hardware import RING_BASE_US, RING_STEP_US

    cluster = load_hardware("h100_sxm")
    host = list(range(8))
    assert cluster.ring_latency_s(host) == pytest.approx((RING_BASE_US + 7 * RING_STEP_US["intra"]) * 1e-6)
    wide = list(range(512))  # 64 hosts: 63 of the 511 steps cross the network
    assert cluster.ring_latency_s(wide) == pytest.approx(
        (RING_BASE_US + 448 * RING_STEP_US["intra"] + 63 * RING_STEP_US["inter"]) * 1e-6)
    assert cluster.ring_latency_s([0]) == 0.0
    fsdp = Layout(1, 1, 512, "1f1b", 1, 1, shard="full")
    one, many = (reduction_s(1e6, fsdp, cluster, Efficiency(), units) for units in (1, 24))
    assert many - one == pytest.approx(3 * 23 * cluster.ring_latency_s(wide))  # gather, gather, reduce-scatter
    assert reduction_s(1e6, Layout(1, 1, 512, "1f1b", 1, 1, shard="none"), cluster, Efficiency(), 24) < one


def test_a_ranks_experts_update_on_the_share_of_the_ranks_that_hold_them():
    """Sharded over dp with ep: a rank's routed experts (already an ep-th of them) are held by the
    dp / ep ranks of its expert group, so their update is a (dp / ep)-th of them, not a dp-th
    (the published FSDP + EP rows divided them by ep twice)."""
    from pipeflow.planning.cluster_search import optimizer_s

    cluster = load_hardware("h100_sxm")
    bandwidth = cluster.gpu.memory_bandwidth_gbps * 1e9
    sharded = Layout(1, 1, 64, "1f1b", 1, 1, shard="full", ep=8)
    assert optimizer_s(3e9, sharded, cluster, Efficiency(), expert_params=2e9) == pytest.approx(
        32 * (1e9 / 64 + 2e9 / 8) / bandwidth)
    replicated = Layout(1, 1, 64, "1f1b", 1, 1, shard="none", ep=8)
    assert optimizer_s(3e9, replicated, cluster, Efficiency(), expert_params=2e9) == pytest.approx(32 * 3e9 / bandwidth)
    assert optimizer_s(3e9, sharded, cluster, Efficiency()) == pytest.approx(32 * 3e9 / 64 / bandwidth)  # dense


def test_dp_moves_and_ranks_hold_the_parameters_in_their_own_dtype():
    """pipeflow keeps parameters, gradients and AdamW's state in train.param_dtype: float32 master
    weights under bf16 autocast double dp's bytes and a rank's state over bf16 weights (the planner
    costed 2-byte weights with a Megatron-style fp32 copy: a ZeRO-1 pick held twice its prediction)."""
    from pipeflow.planning.cluster_search import dp_exposed_s, gather_share, reduction_s

    cluster = load_hardware("h100_sxm")
    zero1 = Layout(1, 1, 64, "1f1b", 1, 1, shard="optimizer")
    assert reduction_s(1e9, zero1, cluster, Efficiency(), 1, 0.0, 4, 4) == pytest.approx(
        2 * reduction_s(1e9, zero1, cluster, Efficiency()) - cluster.group_link(range(64)).latency_us * 1e-6)
    mixed = Workload([], 1, 1, param_bytes=2, grad_bytes=4)  # FSDP's MixedPrecision(reduce_dtype=float32)
    fsdp = Layout(1, 1, 8, "1f1b", 1, 1, shard="full", overlap_dp=True)
    assert gather_share(fsdp, mixed) == pytest.approx(2 / 8) and gather_share(zero1, mixed) == pytest.approx(2 / 6)
    assert dp_exposed_s(8.0, fsdp, 1, 100.0, 0.0, Efficiency(), 0.25) == pytest.approx(
        Efficiency().overlap * 2.0 + 6.0 + 0.5)  # the forward hides its gather; the backward has none to hide behind
    shapes = trace_layers(build_gpt(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=128), 64)
    layout = Layout(1, 2, 4, "1f1b", 1, 1, shard="optimizer")
    held = {kept: predict(Workload(shapes, 64, 32, param_bytes=kept, grad_bytes=kept, optimizer_factor=2.0), layout,
                          cluster).memory_bytes for kept in (2, 4)}
    weights = max(sum(s.params for s in shapes[:3]), sum(s.params for s in shapes[3:]))
    assert held[4] - held[2] == pytest.approx(weights * (2 + 2 + 4 / 4), rel=0.05)  # params, grads, m and v / dp



def test_dp_moves_what_a_rank_holds_under_its_schedules_placement():
    """A rank's dp traffic is that of the stages its schedule places on it: rank 0 of a V holds
    the first and the last stage (the embedding and the head), a looped rank one of them.  The
    prediction took the largest stage times v (both placements alike, a head counted v times) and
    the search's estimate placed every schedule's stages as the looped one does."""
    from pipeflow.planning.cluster_search import placement_of, rank_layers, reduction_s

    shapes = trace_layers(build_gpt(vocab_size=8192, block_size=64, n_layer=6, n_head=4, n_embd=64), 64)
    ranges = [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]  # the embedding first, the head last
    cluster = load_hardware("h100_sxm")
    moved = {}
    for schedule, held in (("interleaved_1f1b", [[0, 1, 4, 5], [2, 3, 6, 7]]), ("zbv", [[0, 1, 6, 7], [2, 3, 4, 5]])):
        layout = Layout(1, 2, 2, schedule, 2, 1)
        assert rank_layers(ranges, placement_of(layout)) == held
        moved[schedule] = predict(Workload(shapes, 64, 8), layout, cluster, ranges=ranges, extrapolate=False).dp_s
        busiest = max(held, key=lambda layers: sum(shapes[i].params for i in layers))
        assert moved[schedule] == pytest.approx(
            reduction_s(sum(shapes[i].params for i in busiest), layout, cluster, Efficiency(), len(busiest)))
    assert moved["zbv"] > 1.15 * moved["interleaved_1f1b"]

def test_the_published_runs_are_read_and_each_source_predicted_in_tokens_per_gpu():
    """Issue 62: the validation set kept as data (benchmarks/predictions/published/): every row
    read; at least 15 dense H100 BF16 rows of two sources the planner can predict; one row of each
    predicted, within a factor 2 (the held-out errors: published_runs.py --holdout)."""
    import published_rows

    rows = published_rows.load()
    modelled = [r for r in rows if published_rows.unmodelled(r) is None]
    h100 = [r for r in modelled if r.generation == "h100" and r.dense and r.dtype == "bf16"]
    assert len(h100) >= 15 and len({r.source for r in h100}) >= 2, len(h100)
    moe = [r for r in rows if r.moe and r.dtype == "bf16"]
    assert all(published_rows.unmodelled(r) for r in rows if r.moe and r not in moe)  # FP8: named, not hidden
    gptoss = next(r for r in moe if r.label == "am-h100-gptoss-20b-8gpu")  # experts over ep 8 within FSDP 8
    assert published_rows.unmodelled(gptoss) is None and 0.5 < published_rows.ratio(gptoss) < 2.0
    qwen = next(r for r in moe if r.label == "am-h100-qwen3-30b-a3b-8gpu")
    layer = published_rows.moe_shapes(qwen, "bf16")[1]  # a stack's windowed kernel: a band of the scores
    band = published_rows.windowed(layer, 128, 4096)
    assert band.attention_flops == pytest.approx(layer.attention_flops / 32) and band.linears == layer.linears
    assert band.attention_keys == 128 and layer.attention_keys == 4096
    for source in sorted({r.source for r in modelled if r.dense}):  # (an MoE row: the gpt-oss one above)
        row = min((r for r in modelled if r.source == source and r.dense), key=lambda r: (r.pp or 1, r.gpus))
        assert 0.5 < published_rows.ratio(row) < 2.0, (source, row.label)
    by_label = {r.label: r for r in rows}  # FSDP's gathers and reductions as Composer's version of each table ran them
    fp32_reduce, fp32_gathers = by_label["mpt-1b-s2048-512gpu-h100-ls"], by_label["mpt-7b-s2048-8gpu-a100-80g"]
    assert published_rows.workload(fp32_reduce, published_rows.STACKS[("llm_foundry_mpt", "h100")]).dp_bytes() == (2, 4)
    assert published_rows.workload(fp32_gathers, published_rows.STACKS[("llm_foundry_mpt", "a100")]).dp_bytes() == (4, 2)
    assert published_rows.workload(fp32_reduce, published_rows.PIPEFLOW).dp_bytes() == (2, 2)  # pipeflow's own stack: its own
    mlm = next(r for r in modelled if r.label == "mlm-h100-gpt7.1b-96gpu")  # 465.9 TFLOP/s over Megatron's FLOPs per token
    assert published_rows.published_tokens(mlm) == pytest.approx(465.9e12 / published_rows.model_flops_per_token(mlm))


def test_an_hf_moe_layer_is_traced_with_its_routed_experts_and_split_by_ep(tmp_path):
    """Issue 62: a Hugging Face MoE layer (fused experts, which on the meta device route no token)
    is traced as balanced routing computes it: each expert's matmuls on top_k / experts of the
    tokens; ``Layout.ep`` holds 1/ep of the experts per rank and adds the layers' all_to_alls."""
    import json

    pytest.importorskip("transformers")
    from pipeflow.models.hf import build_hf

    h, f, experts, top_k, seq = 64, 32, 4, 2, 16
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": h, "intermediate_size": f,
        "moe_intermediate_size": f, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_experts": experts, "num_experts_per_tok": top_k, "vocab_size": 128,
        "max_position_embeddings": 64, "tie_word_embeddings": False}))
    shapes = trace_layers(build_hf(str(tmp_path)), seq)
    layer = shapes[1]
    routed = [x for x in layer.linears if x.rows == seq * top_k / experts]
    assert [x.experts for x in routed] == [experts, experts]  # gate_up and down, each standing for every expert
    assert sum(2 * x.rows * x.k * x.n * x.experts for x in routed) == seq * top_k * 2 * 3 * h * f  # top_k per token
    # with ep 2 a rank runs half the experts on twice the rows each: the same FLOPs, wider matmuls
    cluster = load_hardware("h100_sxm")
    alone, split = (layer_profile(layer, 1, Placement(ep=ep), cluster).forward_s for ep in (1, 2))
    assert split < alone
    assert (layer.expert_params, layer.top_k) == (experts * 3 * h * f, top_k)
    import published_rows

    with published_rows._fused_rms_norms():  # the published stacks' one-kernel RMSNorm: input and output only
        fused = trace_layers(build_hf(str(tmp_path)), seq)[1]
    # its four norms (input, post-attention, q and k) read and write bf16 once, not eight fp32 passes each
    assert fused.residual_bytes + fused.split_bytes < 0.6 * (layer.residual_bytes + layer.split_bytes)
    assert [(x.rows, x.k, x.n, x.experts) for x in fused.linears] == [(x.rows, x.k, x.n, x.experts) for x in layer.linears]
    assert fused.attention_flops == layer.attention_flops
    work = Workload(shapes, seq, 8)
    cluster = load_hardware("h100_sxm")
    one, two = (predict(work, Layout(1, 1, 2, "1f1b", 1, 1, ep=ep), cluster) for ep in (1, 2))
    assert two.memory_bytes < one.memory_bytes and two.pipeline_s > one.pipeline_s  # half the experts, their exchanges
    assert "parallel.ep=2" in two.layout.overrides(two.num_microbatches)
    with pytest.raises(ConfigError, match="does not divide"):
        predict(work, Layout(1, 1, 2, "1f1b", 1, 1, ep=4), cluster)
    # at ep = dp each expert lives on one rank: its gradients are reduced with no one
    from pipeflow.planning.cluster_search import reduction_s

    alone_ep = Layout(1, 1, 2, "1f1b", 1, 1, ep=2)
    assert reduction_s(1e9, alone_ep, cluster, Efficiency(), 1, 1e9) == reduction_s(0.0, alone_ep, cluster, Efficiency())
    assert reduction_s(1e9, alone_ep, cluster, Efficiency()) > reduction_s(1e9, alone_ep, cluster, Efficiency(), 1, 5e8)
    from dataclasses import replace

    from pipeflow.planning.cluster_space import ClusterSpace, _layouts

    space = ClusterSpace(gpus=4, tp=(1, 2))
    split = [lay for lay in _layouts(work, cluster, space) if lay.ep > 1]
    assert split and all(lay.tp == 1 and lay.shard == "none" for lay in split)  # what train.py runs with ep
    assert not list(_layouts(work, cluster, replace(space, ep=(2,), shards=("full",))))  # a pinned ep: none


def test_the_planner_lays_a_model_on_a_described_cluster():
    from pipeflow.commands.plan.command import compose_config, run_plan

    words = ["plan.hardware=h100_sxm", "plan.gpus=16", "model.n_layer=8", "model.n_embd=1024", "model.n_head=8",
             "data.vocab_size=1024", "data.seq_len=512", "data.batch_size=64", "parallel.pp=2", "plan.train_tokens=1e9",
             "plan.gpu_hour_price=2", "plan.top=3"]
    result, report = run_plan(compose_config(words), overrides=words)
    assert result.candidates and all(c.layout.pp == 2 for c in result.candidates)
    assert "TFLOP/s per GPU" in report and "MFU" in report and "GPU-hours" in report and "cost" in report
    first = next(line for line in report.splitlines() if line.startswith("  #1:"))
    assert "parallel.pp=2" in first and "'parallel.order=[" in first
    assert "run the pick: torchrun --nnodes 2 --nproc-per-node 8 train.py model.n_layer=8" in report
    pick = next(line for line in report.splitlines() if line.startswith("run the pick"))
    assert "train.precision=bf16" in pick  # the roofline costed bf16: an fp32 config's pick runs bf16
    assert "train.param_dtype=float32 (4 bytes each)" in report
    with pytest.raises(ConfigError, match="plan.gpus"):
        run_plan(compose_config(["plan.hardware=h100_sxm"]))
    from pipeflow.commands.plan.cluster import cluster_space

    with pytest.raises(ConfigError, match="not split by tensor parallelism"):  # as train.py says, before any search
        cluster_space(compose_config([*words, "parallel.ep=2", "parallel.tp=2"]))
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


def measured_run(tmp_path, width: int, links: list, forward: float = 3.0, backward: float = 2.0) -> str:
    """A run directory whose costs.json is shaped as a run writes it: a 2-layer GPT of `width` at
    sequence 512 profiled at micro-batch 2 `forward` and `backward` times the H100 roofline's,
    and the `links` it timed at start."""
    from dataclasses import asdict

    from pipeflow.planning.calibration import Calibration

    nan, cluster = float("nan"), load_hardware("h100_sxm")
    profiles = []
    for shape in trace_layers(build_gpt(vocab_size=1024, block_size=512, n_layer=2, n_head=8, n_embd=width), 512):
        roof = layer_profile(shape, 2, Placement(), cluster)
        profiles.append({**asdict(roof), "forward_s": forward * roof.forward_s,
                         "backward_s": backward * roof.backward_s, "input_grad_s": 0.0, "weight_grad_s": 0.0})
    meta = {"microbatch_size": 2, "seq_len": 512, "tp": 1, "dtype": "bfloat16", "profiles": profiles, "links": links,
            "hosts": ["a"] * 8 + ["b"] * 8, "machine": {"host": "a", "device": "cuda", "device_name": "H100"}}
    cal = Calibration([0.0], [nan], [nan], [0.0], [0.0], [0.0], [0.0], 0.0, 0.0, 0.0, "group", [0.0], 1, nan, [],
                      meta=meta)
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "costs.json").write_text(cal.to_json())
    return str(tmp_path)


SLOW_NETWORK = [{"what": "pipeline ranks 0-1", "ranks": [0, 1], "hosts": ["a", "a"], "latency_s": 8e-6,
                 "per_byte_s": 1 / 300e9},
                {"what": "pipeline ranks 1-2", "ranks": [7, 8], "hosts": ["a", "b"], "latency_s": 40e-6,
                 "per_byte_s": 1 / 1e9}]
PLAN = ["plan.hardware=h100_sxm", "plan.gpus=32", "model.n_layer=8", "model.n_embd=1024", "model.n_head=8",
        "data.vocab_size=1024", "data.seq_len=512", "data.batch_size=128", "plan.top=3"]


def test_a_runs_measured_links_and_profile_replace_the_presets(tmp_path):
    from pipeflow.planning.cluster_search import dp_link
    from pipeflow.planning.measured_cluster import measured_layers, with_measured_links
    from pipeflow.planning.measured_costs import read_costs
    from pipeflow.commands.plan.command import compose_config, run_plan

    path = measured_run(tmp_path, 1024, SLOW_NETWORK)
    preset = load_hardware("h100_sxm")
    cluster, _ = with_measured_links(preset, SLOW_NETWORK, path)
    assert cluster.inter.bandwidth_gbps * Efficiency().network == pytest.approx(1.0)  # 1 GB/s reached, as timed
    assert cluster.intra.latency_us == pytest.approx(8.0) and cluster.gpu == preset.gpu
    shapes = trace_layers(build_gpt(vocab_size=1024, block_size=512, n_layer=8, n_head=8, n_embd=1024), 512)
    mine, lines = measured_layers(shapes, read_costs(path).meta, cluster, "bf16", 512, path)
    assert all(s.measured == pytest.approx((3.0, 2.0)) for s in mine) and "10 of 10 layers" in lines[0]
    quiet = override(cluster, {"intra.bandwidth_gbps": 1e12, "intra.latency_us": 1e-9})  # tp's collectives ~ 0
    for b, place in ((2, Placement()), (8, Placement(tp=4, sequence_parallel=True))):  # scaled as the roofline scales
        was, now = layer_profile(shapes[3], b, place, quiet), layer_profile(mine[3], b, place, quiet)
        assert (now.forward_s, now.backward_s) == pytest.approx((3 * was.forward_s, 2 * was.backward_s), rel=1e-6)
    fresh, plain = run_plan(compose_config(PLAN), overrides=PLAN)
    measured, report = run_plan(compose_config([*PLAN, f"plan.calibration={path}"]), overrides=PLAN)
    assert "from h100_sxm" in plain and "measured at start" not in plain
    assert f"between hosts: measured at start by the run in {path}" in report and "(the preset's: 50 GB/s" in report
    assert f"layer costs: 10 of 10 layers from the per-layer profile in {path}" in report
    assert measured.candidates[0].step_s > 2 * fresh.candidates[0].step_s  # layers 2-3x slower, the network 40x
    # the preset's pick reduces gradients across hosts; over the slow network measured, within a host
    assert dp_link(preset, fresh.candidates[0].layout) != preset.intra
    assert dp_link(cluster, measured.candidates[0].layout) == cluster.intra


def test_a_profile_of_another_model_is_ignored_with_a_line_and_nothing_measured_refused(tmp_path):
    from pipeflow.planning.measured_cluster import measured_layers
    from pipeflow.planning.measured_costs import read_costs
    from pipeflow.commands.plan.command import compose_config, run_plan

    other = measured_run(tmp_path / "other", 512, SLOW_NETWORK)  # another width: no layer of it matches
    result, report = run_plan(compose_config([*PLAN, "plan.gpus=16", f"plan.calibration={other}"]), overrides=PLAN)
    assert result.candidates and f"the profile in {other} is ignored: none of its layers" in report
    assert "between hosts: measured at start" in report and "scaled to a measured profile" not in report
    shapes = trace_layers(build_gpt(vocab_size=1024, block_size=256, n_layer=2, n_head=8, n_embd=1024), 256)
    same, lines = measured_layers(shapes, read_costs(other).meta, load_hardware("h100_sxm"), "bf16", 256, other)
    assert same == shapes and "taken at data.seq_len=512, this plan is at 256" in lines[0]
    nothing = measured_run(tmp_path / "nothing", 512, [])
    with pytest.raises(ConfigError, match="gives the cluster planner nothing it measured"):
        run_plan(compose_config([*PLAN, "plan.gpus=16", f"plan.calibration={nothing}"]))
    with pytest.raises(ConfigError, match="no costs of a run there"):
        run_plan(compose_config([*PLAN, f"plan.calibration={tmp_path / 'missing'}"]))


def test_a_run_records_the_links_it_timed_at_start():
    from pipeflow.planning.links import Link as Pair, PipelineLinks
    from pipeflow.planning.measured_cluster import measured_links, start_links
    from types import SimpleNamespace

    from pipeflow.planning.step_model import StepCosts
    from pipeflow.planning.costs.tensor import TensorLink

    ring = start_links(StepCosts(latency_s=1e-4, per_byte_s=1e-9), [[0, 1, 2, 3]], ["a"] * 4)
    assert ring == [{"what": "the pipeline ring", "ranks": [0, 1, 2, 3], "hosts": ["a"] * 4, "latency_s": 1e-4,
                     "per_byte_s": 1e-9}]
    pairs = PipelineLinks((Pair((0, 1), 1e-5, 1e-10, (0, 1)), Pair((1, 2), 1e-4, 1e-9, (1, 2))), (0, 1, 2))
    links = measured_links(start_links(StepCosts(links=pairs), [[0, 1, 2]], ["a", "a", "b"]))
    assert links["intra"][0].latency_us == pytest.approx(10) and "global ranks 0-1" in links["intra"][1]
    assert links["inter"][0].bandwidth_gbps * Efficiency().network == pytest.approx(1.0)
    assert start_links(None, [[0, 1]], ["a"] * 2) == [] == start_links(StepCosts(latency_s=1e-4), [[0]], ["a"])
    tp = SimpleNamespace(groups=(((0, 1), TensorLink(200e9, 5e-6)), ((2, 3), TensorLink(100e9, 7e-6))))
    costs = SimpleNamespace(links=None, latency_s=0.0, per_byte_s=0.0, tp_links=tp)  # StepCosts' fields read
    got = start_links(costs, [[0, 2]], ["a"] * 4)  # two tp groups, nothing else timed
    assert [x["what"] for x in got] == ["a tp group's all-reduce"] * 2 and got[1]["per_byte_s"] == 1 / 100e9
    assert measured_links(got)["intra"][0].latency_us == pytest.approx(6.0)


def test_a_model_no_layout_of_the_gpus_can_hold_is_refused_before_any_split():
    """100,000 layers of width 65,536 on 8 GPUs: named at once (it used to search for minutes:
    its layer names were checked pairwise, then split over every stage count)."""
    from pipeflow.commands.plan.command import compose_config, run_plan

    words = ["plan.hardware=h100_sxm", "plan.gpus=8", "model.n_layer=100000", "model.n_embd=65536", "model.n_head=512"]
    with pytest.raises(ConfigError, match=r"parameters: their weights, gradients and optimizer state are [\d,.]+ TB, "
                                          r"[\d,]+ GB per GPU even spread over all plan.gpus=8, over the 72 GB each "
                                          r"can hold; plan for at least plan.gpus=[\d,]+ or a smaller model"):
        run_plan(compose_config(words), overrides=words)
