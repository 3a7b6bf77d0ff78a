"""The mixture-of-experts block (pipeflow/models/moe.py), its aux loss attached in backward
(pipeflow/models/aux_loss.py), router statistics (pipeflow/runtime/parallel/routing.py) and what a run
reports of them; single process.  The pipelined exactness cases are in moe_cases.py."""
from __future__ import annotations

import math

import pytest
import torch
from hydra.utils import instantiate

import pipeflow.models.moe as moe_module
from pipeflow.errors import ConfigError
from pipeflow.models import build_gpt
from pipeflow.models.aux_loss import aux_loss_scope, current_scope
from pipeflow.models.gpt import MLP, gpt_tp_plan
from pipeflow.models.moe import MoE, MoEConfig
from pipeflow.models.spec import run_layers
from pipeflow.observability.console import step_line
from pipeflow.observability.routing import RoutingLog
from pipeflow.planning.costs.layer_trace import trace_layers
from pipeflow.commands.plan.command import compose_config
from pipeflow.runtime.parallel.routing import RoutingSync

DTYPE = torch.float64


def _spec(**moe) -> object:
    moe = {"experts": 4, "top_k": 2, "aux_loss_coef": 0.1, "z_loss_coef": 0.01, **moe}
    return build_gpt(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, moe=moe)


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(32, (3, 8), generator=gen), torch.randint(32, (3, 8), generator=gen)


def test_experts_zero_is_todays_dense_gpt() -> None:
    dense, default = build_gpt(n_layer=2, moe={"experts": 0}), build_gpt(n_layer=2)
    for a, b in zip(dense.build_all(), default.build_all()):
        assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    assert isinstance(default.build_layers([1])[0].mlp, MLP)


def test_every_alternates_dense_and_moe_blocks() -> None:
    layers = build_gpt(n_layer=4, moe={"experts": 2, "top_k": 1, "every": 2}).build_all()
    assert [type(layer.mlp).__name__ for layer in layers[1:-1]] == ["MoE", "MLP", "MoE", "MLP"]


def test_the_aux_loss_attached_in_backward_is_the_weighted_aux_loss_added_to_the_loss(monkeypatch) -> None:
    """The gradient the attach adds (micro-batch weight x d aux) is that of adding weight x aux to
    the loss: the same model with the aux loss summed into the loss directly gives the same grads."""
    spec, (x, y) = _spec(), _batch()
    attached, direct = spec.build_all(dtype=DTYPE), spec.build_all(dtype=DTYPE)
    w = 0.3
    with aux_loss_scope(w, grad_scale=4.0):  # an fp16 loss scale multiplies the aux gradient too
        (4.0 * w * spec.loss_fn(run_layers(attached, x), y)).backward()
    collected = []
    monkeypatch.setattr(moe_module, "attach_aux_loss", lambda out, aux: collected.append(aux) or out)
    with aux_loss_scope(w):
        loss = w * spec.loss_fn(run_layers(direct, x), y)
    (4.0 * (loss + w * sum(collected))).backward()
    assert len(collected) == 2
    for a, b in zip(attached, direct):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-15), name
    router = attached[1].mlp.router.weight.grad
    monkeypatch.undo()
    plain = spec.build_all(dtype=DTYPE)  # outside a scope the attach weighs 0: the aux loss did add gradient
    (4.0 * w * spec.loss_fn(run_layers(plain, x), y)).backward()
    assert (plain[1].mlp.router.weight.grad - router).abs().max() > 1e-3 * router.abs().max()


def test_statistics_are_counted_in_training_forwards_only() -> None:
    spec, (x, _) = _spec(), _batch()
    layers = spec.build_all()
    run_layers(layers, x)  # no scope: evaluation, shape trials, recomputation
    assert current_scope() is None and layers[1].mlp.take_stats().sum() == 0
    with aux_loss_scope(0.5):
        run_layers(layers, x)
        run_layers(layers, x)
    stats = layers[1].mlp.take_stats()
    assert stats[:4].sum() == 2 * 3 * 8 * 2  # two micro-batches of 24 tokens, 2 experts each
    assert stats[4] == 0 and stats[5] > 0  # dropless; the weighted aux loss
    assert layers[1].mlp.take_stats().sum() == 0  # taken: cleared


def test_capacity_drops_the_lowest_gates_beyond_each_experts_capacity() -> None:
    torch.manual_seed(0)
    layer = MoE(16, MoEConfig(experts=4, top_k=2, capacity_factor=0.5), bias=True, dropout=0.0).double()
    tokens = torch.randn(40, 16, dtype=DTYPE)
    chosen, gates, _ = layer._route(layer._router_logits(tokens))
    counts = moe_module._per_expert(chosen.flatten(), 4)
    keep = layer._within_capacity(chosen, gates, counts)
    capacity = math.ceil(0.5 * 80 / 4)
    for e in range(4):
        mine = chosen == e
        assert int((keep & mine).sum()) == min(capacity, int(mine.sum()))
        if (~keep & mine).any():  # every kept gate of the expert outranks every dropped one
            assert gates[keep & mine].min() >= gates[~keep & mine].max()
    with aux_loss_scope(1.0):
        layer(tokens.view(4, 10, 16))
    assert layer.take_stats()[4] == int((~keep).sum()) > 0


def test_bias_balancing_moves_each_bias_towards_the_mean_load() -> None:
    layer = MoE(16, MoEConfig(experts=4, top_k=1, balance="bias", bias_update_rate=0.1), bias=True, dropout=0.0)
    layer.balance(torch.tensor([10.0, 2.0, 4.0, 4.0]))
    assert layer.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.1, 0.1])
    assert "expert_bias" in layer.state_dict()  # saved with the weights: a resume continues it


def test_the_router_runs_in_float32_under_bf16_autocast() -> None:
    spec, (x, y) = _spec(), _batch()
    layers = spec.build_all()
    seen: list[torch.Tensor] = []
    original = MoE._router_logits
    with torch.autocast("cpu", dtype=torch.bfloat16), aux_loss_scope(1.0):
        MoE._router_logits = lambda self, t: seen.append(original(self, t)) or seen[-1]
        try:
            loss = spec.loss_fn(run_layers(layers, x), y)
        finally:
            MoE._router_logits = original
    loss.backward()
    assert [t.dtype for t in seen] == [torch.float32, torch.float32]
    assert layers[1].mlp.router.weight.grad is not None


@pytest.mark.parametrize("moe, key", [
    ({"experts": 2, "top_k": 3}, "model.moe.top_k=3"),
    ({"experts": 2, "balance": "loss_free"}, "model.moe.balance='loss_free'"),
    ({"experts": 2, "capacity_factor": 0.0}, "model.moe.capacity_factor=0.0"),
    ({"experts": 2, "every": 0}, "model.moe.every=0"),
    ({"experts": -1}, "model.moe.experts=-1"),
])
def test_bad_moe_settings_are_named(moe: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace("[", r"\[")):
        build_gpt(moe=moe)


def test_tensor_parallelism_with_experts_is_a_named_error() -> None:
    spec = _spec()
    layer = spec.build_layers([1])[0]
    with pytest.raises(ConfigError, match="parallel.tp=2 with model.moe.experts=4"):
        gpt_tp_plan(spec.tp_plan.args[0], 1, layer, 2)


def test_model_moe_keys_compose_and_reach_the_builder() -> None:
    cfg = compose_config(["model.moe.experts=4", "model.moe.top_k=1", "model.moe.capacity_factor=1.25"])
    layer = instantiate(cfg.model).build_layers([1])[0]
    assert (layer.mlp.cfg.experts, layer.mlp.cfg.top_k, layer.mlp.cfg.capacity_factor) == (4, 1, 1.25)
    assert compose_config([]).model.moe.experts == 0


def test_router_statistics_sum_to_the_step_figures_and_the_log() -> None:
    spec, (x, _) = _spec(capacity_factor=1.0), _batch()
    layers = spec.build_all()
    sync = RoutingSync(dict(enumerate(layers)), len(layers), 4)
    with aux_loss_scope(0.5):
        run_layers(layers, x)
    packet = sync.packet(torch.device("cpu"))
    figures = sync.figures((packet * 2).tolist(), replicas=2)  # two replicas that routed alike
    assert sorted(figures.tokens) == [1, 2] and sum(figures.tokens[1]) == 2 * 48
    assert figures.aux == pytest.approx(float(packet.view(4, 6)[:, 5].sum()))
    log = RoutingLog()
    log.record(0, figures)
    log.record(1, figures)
    summary = log.summary()["layers"][1]
    assert summary["tokens_per_expert"] == figures.tokens[1] and summary["imbalance"] == figures.imbalance(1) >= 1
    assert log.lines()[0].startswith("MoE layer 1: tokens per expert per step ")
    line = step_line(3, 10, 2.5, 0.7, 1e-3, 0.05, 32, 2048, 0.3, 0.25, aux=figures.aux)
    assert line.startswith(f"step    3/10 | loss 2.5000 | aux {figures.aux:.4f} | grad norm")


def test_the_roofline_traces_an_moe_block_at_its_top_k_load() -> None:
    dense, moe = (trace_layers(build_gpt(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, moe=m), 8)[1]
                  for m in ({}, {"experts": 4, "top_k": 2}))
    mlp = 2 * 16 * 64 + 64 + 16  # a dense MLP's (and an expert's) parameters at n_embd 16
    assert moe.params == dense.params + 3 * mlp + 16 * 4  # every expert's, and the router's
    assert moe.model_flops() > 1.5 * dense.model_flops()  # two experts' MLP FLOPs per token, not four
    assert moe.model_flops() < 3 * dense.model_flops()


def test_the_moe_recipe_alternates_experts_and_dense_blocks() -> None:
    cfg = compose_config(["experiment=moe_tiny_pp2_ep2"])
    layers = instantiate(cfg.model).build_all()
    assert [type(layer.mlp).__name__ for layer in layers[1:-1]] == ["MoE", "MLP", "MoE", "MLP"]
    assert (cfg.parallel.pp, layers[1].mlp.cfg.experts, layers[1].mlp.cfg.top_k) == (2, 8, 2)


@pytest.mark.parametrize("ep, dp, tp, shard, experts, key", [
    (2, 2, 1, "none", 0, "has no experts"),
    (3, 4, 1, "none", 6, "ep must divide parallel.dp=4"),
    (4, 4, 1, "none", 6, "does not divide model.moe.experts=6"),
    (2, 2, 2, "none", 4, "parallel.tp=2 with parallel.ep=2"),
    (2, 2, 1, "full", 4, "parallel.shard=full with parallel.ep=2"),
])
def test_expert_parallel_settings_it_cannot_run_are_named(ep, dp, tp, shard, experts, key) -> None:
    from pipeflow.runtime.parallel.expert_parallel import check_expert_parallel

    check_expert_parallel(1, dp, tp, shard, experts)  # ep 1: anything goes
    check_expert_parallel(2, 2, 1, "none", 4)
    check_expert_parallel(2, 4, 1, "none", 4)  # each expert on two of the four dp ranks
    with pytest.raises(ConfigError, match=key):
        check_expert_parallel(ep, dp, tp, shard, experts)


def test_experts_are_named_by_global_index_and_split_by_it() -> None:
    layer = MoE(16, MoEConfig(experts=4, top_k=1), bias=True, dropout=0.0)
    names = [n for n, _ in layer.named_parameters() if ".experts." in f".{n}"]
    layer.split_experts(1, 2, exchange=lambda tokens, sizes, experts: torch.zeros_like(tokens))
    assert sorted(layer.experts) == ["2", "3"]  # rank 1 of 2 keeps experts 2 and 3, under their own names
    assert [n for n, _ in layer.named_parameters() if ".experts." in f".{n}"] == [n for n in names if ".2." in n or ".3." in n]
    with pytest.raises(ConfigError, match="parallel.ep=3 does not divide model.moe.experts=4"):
        MoE(16, MoEConfig(experts=4), bias=True, dropout=0.0).split_experts(0, 3, exchange=None)


def test_the_memory_prediction_counts_one_ep_ranks_experts() -> None:
    from pipeflow.planning.costs.expert import expert_parameter_counts, split_expert_profiles
    from pipeflow.planning.profile import LayerProfile, count_layer_params

    spec = _spec(every=2)
    counts, whole = expert_parameter_counts(spec), count_layer_params(spec)
    assert counts[0] == counts[2] == counts[3] == 0 and counts[1] == 4 * (2 * 16 * 64 + 64 + 16)
    profiles = [LayerProfile(f"l{i}", n, 4 * n, 1e-3, 2e-3, 1024) for i, n in enumerate(whole)]  # as profiled, float32
    split = split_expert_profiles(profiles, counts, 2)
    assert [p.params for p in split] == [n - c // 2 for n, c in zip(whole, counts)]
    assert split[1].param_bytes == 4 * split[1].params and split[0] is profiles[0]


@pytest.mark.parametrize("model_type, reason", [
    ("jamba", "its linear_attention layers keep a state of their own"),
    ("qwen3_next", "its linear_attention layers keep a state of their own"),
    ("cohere", r"CohereForCausalLM.forward computes outside its layers .*`logits = logits \* self.logit_scale`"),
    ("granite", r"GraniteModel.forward computes outside its layers .*embedding_multiplier"),
    ("gemma3", r"a multimodal config \(sub-configs \['text_config', 'vision_config'\]\)")])
def test_a_hugging_face_family_model_hf_cannot_cut_is_refused_with_its_reason(model_type: str, reason: str) -> None:
    """A family is taken by the form of its forwards (pipeflow.models.hf_forms); one that keeps state
    outside its attention, scales outside its layers or is multimodal is refused naming why."""
    transformers = pytest.importorskip("transformers")
    from pipeflow.models.hf_forms import family

    config = transformers.AutoConfig.for_model(model_type)
    with pytest.raises(ConfigError, match=f"^model=hf does not support .*\\(model_type '{model_type}'\\): {reason}"):
        family(config)


def test_the_all_to_all_cost_model_adds_each_moe_layers_exchanges_to_its_actions() -> None:
    """Per MoE layer and micro-batch: a rank's N x top_k rows of width C (top_k x output bytes),
    (ep - 1) / ep of them sent each way, twice in F (and the counts' latency), twice in B, once
    more in a split backward's W; on a measured link the same model over the new figures."""
    from pipeflow.planning.costs.expert import (ExpertLayers, ExpertLink, exchanged_bytes_per_step, expert_layers,
                                               expert_profiles, relink_exchanges, with_exchanges)
    from pipeflow.planning.profile import LayerProfile

    tokens, k, width, ep = 24, 2, 16, 4
    out = tokens * width * 8  # a block's (B, T, C) output in float64
    dense, moe = (LayerProfile(n, 100, 800, 1e-3, 2e-3, 4096, input_grad_s=1e-3, weight_grad_s=1e-3, output_bytes=out)
                  for n in ("dense", "moe"))
    link = ExpertLink(bandwidth_Bps=1e9, latency_s=1e-5)
    d, m = with_exchanges([dense, moe], [0, k], ep, link)
    one = 0.75 * tokens * k * width * 8 / 1e9  # seconds of one exchange's bytes
    assert d is dense
    assert m.forward_s == pytest.approx(1e-3 + 2 * one + 3e-5)
    assert m.backward_s == pytest.approx(2e-3 + 2 * one + 2e-5)
    assert m.input_grad_s == pytest.approx(1e-3 + 2 * one + 2e-5) and m.weight_grad_s == pytest.approx(1e-3 + one + 1e-5)
    fast = ExpertLink(bandwidth_Bps=1e11, latency_s=1e-6)
    relinked, direct = relink_exchanges([m], [k], ep, link, fast)[0], with_exchanges([moe], [k], ep, fast)[0]
    for key in ("forward_s", "backward_s", "input_grad_s", "weight_grad_s"):
        assert getattr(relinked, key) == pytest.approx(getattr(direct, key), rel=1e-12)
    assert with_exchanges([moe], [k], 1, link)[0] is moe  # ep 1: nothing leaves the rank
    assert exchanged_bytes_per_step([dense, moe], [0, k], [range(0, 1), range(1, 2)], ep, 3) == pytest.approx(
        [0.0, 3 * 4 * tokens * k * width * 8 * 0.75])  # tokens x top_k x hidden x bytes x (ep-1)/ep, 4 a micro-batch
    layers = expert_layers(_spec(every=2))  # the GPT: embedding, MoE block, dense block, head
    assert layers.top_k == (0, 2, 0, 0) and layers.params[1] > 0 and layers.params[2] == 0
    split = expert_profiles([dense, moe], ExpertLayers((0, 40), (0, k)), ep, link)
    assert split[1].params == 100 - 30 and split[1].forward_s == m.forward_s


def test_the_ep_link_is_measured_by_an_all_to_all_and_costs_the_prediction(one_rank_group) -> None:
    import torch.distributed as dist

    from pipeflow.planning.ep_links import ExpertExchange, measure_ep_links
    from pipeflow.planning.costs.expert import ExpertLink, exchange_seconds
    from pipeflow.planning.profile import LayerProfile
    from pipeflow.schedules import build_schedule

    exchange = ExpertExchange(2, (0, 2), ExpertLink(), payload_bytes=1 << 16)
    links = measure_ep_links(torch.device("cpu"), dist.group.WORLD, exchange, repeats=2)
    assert links.link.latency_s >= 0 and links.link.bandwidth_Bps > 0 and links.measured_s < 0.3
    assert links.phrase().startswith("ep all_to_all ")
    moe = LayerProfile("moe", 1, 4, 1e-3, 2e-3, 0, output_bytes=1 << 15)
    assert links.profiles([moe, moe])[0] is moe and links.profiles([moe, moe])[1].forward_s >= 1e-3
    plan, stages = build_schedule("zb_h1", 2, 4), [range(0, 1), range(1, 2)]
    f, b, w = exchange_seconds(moe, 2, 2, links.link)  # zb_h1 splits backwards: W's exchange too
    assert links.per_rank_s([moe, moe], stages, plan) == pytest.approx([0.0, 4 * (f + b + w)])
    sent = 4 * 4 * 2 * 2 ** 15 / 2  # 4 exchanges a micro-batch x m x top_k x output bytes x (ep - 1) / ep
    assert links.describe([moe, moe], stages, plan).endswith(f"1 {4e3 * (f + b + w):.2f} ms ({sent / 1e6:.2f} MB sent)")


def test_the_exchanges_time_is_a_per_stage_figure_apart_from_compute_and_comm() -> None:
    from pipeflow.observability.figures import step_figures
    from pipeflow.observability.routing import all_to_all_line
    from pipeflow.runtime.events import A2A, TimedEvent

    events = [TimedEvent("F", "0F0", 0.0, 4.0), TimedEvent(A2A, "dispatch", 1.0, 1.5),
              TimedEvent(A2A, "combine", 2.0, 3.0), TimedEvent("comm", "x", 4.0, 5.0)]
    figures = step_figures(events, 0.0, 6.0)
    assert (figures.compute_s, figures.comm_wait_s, figures.idle_s, figures.all_to_all_s) == (4.0, 1.0, 1.0, 1.5)
    assert all_to_all_line([1.5e-3, 0.0], [4e-3, 0.0]).endswith("per pipeline rank: 0 1.50 (38% of its compute); 1 0.00")


def test_the_planner_costs_the_experts_exchanges_on_the_link_it_measured() -> None:
    from pipeflow.planning.profile import LayerProfile, count_layer_params
    from pipeflow.commands.plan.ep import expert_costs, planner_link

    cfg = compose_config(["model.n_layer=2", "model.moe.experts=4", "parallel.ep=2", "parallel.dp=2"])
    params = count_layer_params(instantiate(cfg.model))

    def costs(b: int) -> list[LayerProfile]:
        return [LayerProfile(f"l{i}", n, 4 * n, 1e-3, 2e-3, 0, output_bytes=1000 * b) for i, n in enumerate(params)]

    link = planner_link(costs, [1, 4], lambda b: 1e-4 + 1000 * b * 1e-9, torch.device("cpu"))
    assert link.latency_s == pytest.approx(1e-4) and link.bandwidth_Bps == pytest.approx(1e9)
    assert planner_link(costs, [1, 4], 2e-3, torch.device("cpu")).latency_s == 2e-3  # plan.comm_latency_ms
    one = planner_link(costs, [4], lambda b: 3e-4, torch.device("cpu"))  # one micro-batch size: no slope (was 1/0)
    assert one.latency_s == pytest.approx(3e-4) and one.bandwidth_Bps == float("inf")
    per_rank, note = expert_costs(cfg, costs, [1, 4], lambda b: 1e-4 + 1000 * b * 1e-9, torch.device("cpu"))
    assert note.startswith("; ep 2: a rank holds 1/2 of the experts")
    moe, dense = per_rank(4)[1], per_rank(4)[0]
    assert moe.forward_s > 1e-3 + 3e-4 and dense.forward_s == 1e-3 and params[1] / 2 < moe.params < params[1]


def test_experts_parallelism_cannot_split_are_named_before_anything_runs() -> None:
    """A parameter named as a routed expert's (``.experts.``) in no module parallel.ep splits would be
    taken for a split one (its gradient never reduced over dp): the builder refuses it by name."""
    from torch import nn

    from pipeflow.models.hf_experts import unsplittable_experts

    layer = nn.Module()
    layer.mlp = nn.Module()
    layer.mlp.experts = nn.Linear(2, 2)
    assert unsplittable_experts(layer, lambda m: False) == ["mlp.experts.weight", "mlp.experts.bias"]
    assert unsplittable_experts(layer, lambda m: m is layer.mlp) == []
