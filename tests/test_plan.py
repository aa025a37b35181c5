"""plan_transfer against independent computations: the paper's size formula, real mappers, real statistics and
a real transfer's cache tensors."""

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from conftest import random_ids, tiny_model
from hf_kvtransfer import KVMapper, MapperConfig, TransferredCache, prefill
from hf_kvtransfer.commands.cli import main
from hf_kvtransfer.commands.plan import format_plan, plan_transfer
from hf_kvtransfer.core.stats import BlockStatistics, KVLayout, KVStatistics


def _tiny_config(layers, kv_heads, head_dim, heads=4, hidden=64):
    return Qwen3Config(
        num_hidden_layers=layers, num_key_value_heads=kv_heads, head_dim=head_dim, num_attention_heads=heads,
        hidden_size=hidden, intermediate_size=128, vocab_size=96, max_position_embeddings=256,
    )  # fmt: skip


SOURCE, TARGET = _tiny_config(3, 2, 16), _tiny_config(5, 4, 8, heads=8)


def _paper_parameters(layers_t, kv_t, d_t, k, kv_s, d_s):
    return 2 * layers_t * kv_t * (k * kv_s * d_s) * d_t


def test_mapper_size_is_the_paper_formula_for_a_real_pair():
    plan = plan_transfer("Qwen/Qwen3-14B", "Qwen/Qwen3-32B", top_k=8, use_hub=False, available_memory=2**40)
    expected = _paper_parameters(64, 8, 128, 8, 8, 128)
    assert plan.mapper_weight_parameters == expected == 1_073_741_824
    assert plan.mapper_parameters == expected + 2 * 64 * 8 * 128  # one bias per output, K and V
    assert plan.mapper_bytes == plan.mapper_parameters * 2  # bf16
    assert plan.mapper_bytes_by_dtype["float32"] == plan.mapper_parameters * 4
    # FLOPs of a full-rank map: one multiply-add per weight per token.
    assert plan.mapping_flops == 2 * plan.seq_len * expected
    assert plan.flop_ratio == pytest.approx(plan.prefill_flops / plan.mapping_flops)
    # The Llama pair has different head_dim on the two sides.
    plan = plan_transfer("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-3B", top_k=4, use_hub=False)
    assert plan.mapper_weight_parameters == _paper_parameters(28, 8, 128, 4, 8, 64)


@pytest.mark.parametrize("top_k,rank", [(1, None), (2, None), (3, None), (2, 5), (3, 100)])
def test_mapper_parameters_equal_a_real_mapper(top_k, rank):
    plan = plan_transfer(SOURCE, TARGET, top_k=top_k, rank=rank, dtype="float32", available_memory=2**40)
    src, tgt = KVLayout.from_config(SOURCE), KVLayout.from_config(TARGET)
    g = torch.Generator().manual_seed(top_k)
    # Any selection (not the plan's): sizes depend only on k.
    selected = [sorted(torch.randperm(src.num_layers, generator=g)[:top_k].tolist()) for _ in range(tgt.num_layers)]
    ranks = None if rank is None else [[min(rank, tgt.layer_dim)] * 2 for _ in range(tgt.num_layers)]
    config = MapperConfig(SOURCE.to_dict(), TARGET.to_dict(), selected, top_k=top_k, rank=ranks,
                          mapper_type="ridge" if rank is None else "lowrank")
    mapper = KVMapper(config)
    assert plan.mapper_parameters == mapper.num_parameters()
    assert plan.mapper_bytes == sum(p.numel() * p.element_size() for p in mapper.parameters())
    if rank is None:
        assert plan.mapper_weight_parameters == _paper_parameters(5, 4, 8, top_k, 2, 16)
    else:
        assert plan.full_rank_parameters == plan_transfer(SOURCE, TARGET, top_k=top_k).mapper_parameters


def test_statistics_bytes_equal_allocated_statistics():
    src, tgt = KVLayout.from_config(SOURCE), KVLayout.from_config(TARGET)
    plan = plan_transfer(SOURCE, TARGET, top_k=1, available_memory=2**40)
    full = KVStatistics(src, tgt)
    assert plan.statistics_bytes_full == sum(t.numel() * t.element_size() for t in full.tensors.values())
    # Two-stage: the bound is what disjoint selections allocate (the worst case), and no selection exceeds it.
    disjoint = BlockStatistics(src, tgt, [[t % 3] for t in range(5)], torch.zeros(3, 5))
    overlapping = BlockStatistics(src, tgt, [[0]] * 5, torch.zeros(3, 5))
    actual = [sum(t.numel() * t.element_size() for t in s.tensors.values()) for s in (disjoint, overlapping)]
    assert plan.statistics_bytes_two_stage >= max(actual)
    k2 = plan_transfer(SOURCE, TARGET, top_k=2, available_memory=2**40)
    worst = BlockStatistics(src, tgt, [[0, 1], [0, 2], [1, 2], [0, 1], [0, 2]], torch.zeros(3, 5))
    # 3 Gram diagonals + 3 off-diagonal pairs = all 6 pairs of 3 layers; 10 cross blocks.
    assert k2.statistics_bytes_two_stage == sum(t.numel() * t.element_size() for t in worst.tensors.values())


def test_fit_mode_follows_the_memory_budget():
    plan = plan_transfer(SOURCE, TARGET, top_k=1, available_memory=2**40)
    assert plan.fit_default_mode == "full" and plan.statistics_sets == 2
    assert plan.fit_default_statistics_bytes == 2 * plan.statistics_bytes_full
    tight = plan_transfer(SOURCE, TARGET, top_k=1, available_memory=2 * plan.statistics_bytes_full)  # budget: half
    assert tight.fit_default_mode == "two-stage"
    assert plan_transfer(SOURCE, TARGET, heldout_fraction=0, top_k=1).statistics_sets == 1


def test_transfer_cache_bytes_equal_a_real_transfer():
    source, target = tiny_model("qwen3", num_hidden_layers=3), tiny_model("qwen3", num_hidden_layers=4, seed=1)
    selected = [[0, 2]] * 4
    mapper = KVMapper(MapperConfig(source.config.to_dict(), target.config.to_dict(), selected, top_k=2))
    ids = random_ids(2, 33)
    cache = TransferredCache(prefill(source, ids), mapper, num_recompute_tokens=1, num_exact_layers=0).convert_all()  # 32 tokens transferred, 1 recomputed
    plan = plan_transfer(source.config, target.config, top_k=2, seq_len=32, batch_size=2, dtype="float32")
    assert plan.target_cache_bytes == sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
    )


def test_cli_json(capsys):
    assert main(["plan", "--source", "Qwen/Qwen3-0.6B", "--target", "Qwen/Qwen3-1.7B", "--offline", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("mapper_parameters", "mapper_bytes", "statistics_bytes_full", "statistics_bytes_two_stage", "flop_ratio"):
        assert key in out
    assert out["mapper_weight_parameters"] == _paper_parameters(28, 8, 128, 8, 8, 128)
    assert main(["plan", "--source", "Qwen/Qwen3-0.6B", "--target", "Qwen/Qwen3-1.7B", "--offline", "--top-k", "0"]) == 1
    assert "top_k must be in [1, 28]" in capsys.readouterr().err


@pytest.mark.parametrize("rank", [None, 6])
@pytest.mark.parametrize("positions", [1, 2, 3])
def test_residual_inputs_cost_equals_layer_maps_built_with_the_extra_inputs(rank, positions):
    """What P positions of the target's residual stream add to a mapper: the parameters of the library's own layer
    maps built with `P x hidden` more input features, and the FLOPs torch counts when they are applied."""
    from torch.utils.flop_counter import FlopCounterMode

    from hf_kvtransfer.commands.plan import map_input_costs
    from hf_kvtransfer.core.layer_maps import LowRankLayerMap, RidgeLayerMap

    def residual_inputs_cost(target, count, mapped, tokens, rank=None):
        return map_input_costs(target, mapped, tokens, {"residual_positions": count}, rank).get("residual")

    src, tgt = KVLayout.from_config(SOURCE), KVLayout.from_config(TARGET)
    base_in, extra_in, out = 2 * src.layer_dim, positions * TARGET.hidden_size, tgt.layer_dim
    build = (lambda f: RidgeLayerMap(f, out)) if rank is None else (lambda f: LowRankLayerMap(f, out, rank, rank))
    plain, wider = build(base_in), build(base_in + extra_in)
    mapped, tokens = 3, 11  # e.g. 5 target layers, 2 of them exact

    def count(layer_map, features):
        x = torch.randn(tokens, features)
        with FlopCounterMode(display=False) as counter:
            layer_map.key(x), layer_map.value(x)
        return counter.get_total_flops()

    cost = residual_inputs_cost(TARGET, positions, mapped, tokens, rank=rank)
    assert cost.features == extra_in
    assert cost.parameters == mapped * (sum(p.numel() for p in wider.parameters()) - sum(p.numel() for p in plain.parameters()))
    assert cost.flops == mapped * (count(wider, base_in + extra_in) - count(plain, base_in))
    assert residual_inputs_cost(TARGET, 0, mapped, tokens) is None


@pytest.mark.parametrize("exact,recompute", [(0, 1), (1, 4), (2, 5), (4, 3)])
def test_first_token_flops_equal_a_real_transfer_under_torch_flop_counter(exact, recompute):
    """The FLOPs to the first token that plan reports (exact layers, maps, recomputed tokens) against torch's count of
    the target's first forward on a real `TransferredCache` (it computes the exact layers and maps the rest)."""
    from torch.utils.flop_counter import FlopCounterMode

    from hf_kvtransfer.commands.plan import first_token_flops, planning_mapper

    source, target = tiny_model("qwen3", num_hidden_layers=3, seed=1), tiny_model("qwen3", num_hidden_layers=4, seed=2)
    cfg, seq = target.config, 24
    mapper = KVMapper(MapperConfig(source.config.to_dict(), cfg.to_dict(), [[0, 2]] * 4, top_k=2))
    ids = random_ids(1, seq, seed=3)
    cache = TransferredCache(prefill(source, ids), mapper, num_recompute_tokens=recompute, num_exact_layers=exact, model=target)
    with FlopCounterMode(display=False) as counter:
        target(ids[:, -recompute:], cache=cache, use_cache=True, logits_to_keep=1)
    got = first_token_flops(cfg, planning_mapper(source.config, cfg, 2), seq, num_exact_layers=exact,
                            num_recompute_tokens=recompute)  # fmt: skip
    # Eager attention computes full squares / rectangles where the formula counts the causal part; the LM head of
    # the last position is outside the transformer body the formula counts.
    q = 2 * 2 * cfg.num_attention_heads * cfg.head_dim
    held = seq - recompute
    exact_full = max(exact - 1, 0)  # the exact pass stops at the last exact layer's cache update
    eager = q * exact_full * (held * held - held * (held + 1) // 2)
    eager += q * cfg.num_hidden_layers * (recompute * seq - (recompute * held + recompute * (recompute + 1) // 2))
    lm_head = 2 * cfg.hidden_size * cfg.vocab_size
    assert counter.get_total_flops() == got["total"] + eager + lm_head
    assert got["total"] == got["exact_layers"] + got["mapping"] + got["recompute"] and got["map_inputs"] == 0


def test_plan_reports_the_first_token_and_residual_inputs_at_scale():
    from hf_kvtransfer.commands.bench import prefill_flops
    from hf_kvtransfer.commands.model_configs import load_model_config as target_config

    for source, target, layers, hidden in (("Qwen/Qwen3-14B", "Qwen/Qwen3-32B", 64, 5120),
                                           ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B", 80, 8192)):  # fmt: skip
        # A budget whole residual sums fit in: maps at full rank (`test_the_plan_costs_the_residual_maps_the_fit_builds`)
        plan = plan_transfer(source, target, top_k=8, seq_len=4096, use_hub=False, num_exact_layers=4,
                             residual_positions=2, available_memory=2**40, max_statistics_memory=8192)  # fmt: skip
        assert plan.num_exact_layers == 4 and plan.num_recompute_tokens == 32
        row = plan.map_inputs["residual"]
        # Full rank, K and V: 2 positions x hidden more inputs per map, on the 60 / 76 mapped layers.
        assert row["positions"] == 2 and row["parameters"] == 2 * (layers - 4) * 2 * hidden * 8 * 128
        f, r = plan.first_token_flops, row["first_token_flops"]
        assert r["map_inputs"] == 2 * (4096 - 32) * row["parameters"] == row["flops"]
        # The residual entering the last exact layer comes with the K/V-only pass (it stops at that layer's cache
        # update): the exact layers cost the same, less than running all 4 layers whole.
        assert r["exact_layers"] == f["exact_layers"] < prefill_flops(target_config(target, use_hub=False), 4096 - 32, num_layers=4)["total"]
        assert r["total"] - f["total"] == r["map_inputs"]
        # Maps reading the residual alone map no source K/V: the exact layers, the residual maps, the recomputed tokens.
        a = row["first_token_flops_alone"]
        assert a["mapping"] == 0 and a["total"] == f["exact_layers"] + r["map_inputs"] + f["recompute"]
        assert row["first_token_flop_ratio_alone"] == pytest.approx(f["own_prefill"] / a["total"])
        assert f["own_prefill"] == plan.prefill_flops
        assert plan.first_token_flop_ratio == pytest.approx(f["own_prefill"] / f["total"])
        text = format_plan(plan)
        assert "to the first token of a 4096-token prompt (4 of" in text and "residual stream (2 positions x" in text
        assert "comes with the exact pass" in text and "read alone (no source K/V)" in text
    with pytest.raises(ValueError, match="num_exact_layers must be in"):
        plan_transfer("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", use_hub=False, num_exact_layers=99)


def test_plan_says_which_map_inputs_are_practical_at_real_shapes():
    # Qwen3 14B -> 32B, 1 exact layer; the target's own weights from its config (meta device). The residual inputs at
    # the default fit's 3 positions: 3 x 63 x 2 x 5120 x 1024 weights (bf16: 3.69 GiB), one multiply-add each per
    # transferred token (2 x 4064 x 1,981,808,640 = 16.108 TFLOP). (The token tables
    # of the research plug-in, 146 GiB at this shape: tests/test_token_tables.py.)
    plan = plan_transfer("Qwen/Qwen3-14B", "Qwen/Qwen3-32B", top_k=8, seq_len=4096, use_hub=False, num_exact_layers=1,
                         available_memory=2**40, max_statistics_memory=8192)  # fmt: skip  (whole sums: full rank)
    text = format_plan(plan)
    residual = plan.map_inputs["residual"]
    assert residual["parameters"] == 3 * 63 * 2 * 5120 * 1024 and residual["flops"] == 2 * (4096 - 32) * residual["parameters"]
    line = next(ln for ln in text.splitlines() if "maps also reading the target's residual stream (3 positions x 5120 per mapped layer)" in ln)
    assert ": 3.69 GiB, +16.108 TFLOP" in line and ": practical" in line, line
    assert "to the first token with it (+1,981,808,640 mapper parameters" in text
    assert 2 * plan.model_parameters["target"] > 60 * 2**30


@pytest.mark.parametrize("source,target,directions", [("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", 102),
                                                     ("Qwen/Qwen3-1.7B", "Qwen/Qwen3-8B", 58),
                                                     ("Qwen/Qwen3-14B", "Qwen/Qwen3-32B", 18)])
def test_the_plan_costs_the_residual_maps_the_fit_builds(source, target, directions):
    """Where the fit's residual sums hold the residual features through 3 x `directions` directions (the default
    4 GiB; counts from `_directions_by_hand` in the tests above), its widest residual maps read the residual through
    one projection of that rank, and the plan costs them there unless `--residual-rank` says otherwise: a projection
    of 3 x hidden features to that rank, then that rank's inputs per map."""
    from hf_kvtransfer.commands.model_configs import load_model_config

    hidden = load_model_config(target, use_hub=False).hidden_size
    plan = plan_transfer(source, target, use_hub=False, available_memory=2**40, num_exact_layers=1)
    row = plan.map_inputs["residual"]
    assert plan.fit_input_statistics["residual"]["directions"] == directions
    assert row["shared_rank"] == 3 * directions
    mapped, layer_dim = plan.target_layout["num_layers"] - 1, plan.target_layout["num_kv_heads"] * plan.target_layout["head_dim"]
    assert row["parameters"] == 3 * directions * 3 * hidden + mapped * 2 * layer_dim * 3 * directions
    named = plan_transfer(source, target, use_hub=False, available_memory=2**40, num_exact_layers=1, residual_rank=64)
    assert named.map_inputs["residual"]["shared_rank"] == 64


def test_plan_options_object_or_keywords():
    from hf_kvtransfer.commands.plan import PlanOptions

    options = dict(top_k=2, rank=16, seq_len=512, dtype="float32", available_memory=2**40, num_exact_layers=2)
    by_object = plan_transfer(SOURCE, TARGET, PlanOptions(**options)).to_dict()
    assert by_object == plan_transfer(SOURCE, TARGET, **options).to_dict()
    assert (by_object["top_k"], by_object["rank"], by_object["num_exact_layers"]) == (2, 16, 2)
    with pytest.raises(TypeError, match=r"plan_transfer\(\) got unknown option\(s\) topk"):
        plan_transfer(SOURCE, TARGET, topk=2)


def test_plan_sets_the_first_token_beside_other_exact_layer_counts():
    """The first-token FLOP ratio at 1, an eighth, a quarter and half of the target's layers (and the count asked):
    each layer more computed exactly adds one whole target layer over the transferred tokens and drops that layer's
    maps, which the totals behind the ratios must show."""
    from hf_kvtransfer.commands.bench import prefill_flops
    from hf_kvtransfer.commands.model_configs import load_model_config

    plan = plan_transfer("Qwen/Qwen3-14B", "Qwen/Qwen3-32B", top_k=8, seq_len=4096, use_hub=False, num_exact_layers=4,
                         available_memory=2**40)  # fmt: skip
    by = plan.first_token_flop_ratio_by_exact_layers
    assert list(by) == [1, 4, 8, 16, 32] and by[4] == pytest.approx(plan.first_token_flop_ratio)
    own = plan.first_token_flops["own_prefill"]
    total = {n: own / ratio for n, ratio in by.items()}
    layer = prefill_flops(load_model_config("Qwen/Qwen3-32B", use_hub=False), 4096 - 32, num_layers=1)["total"]
    maps = plan.first_token_flops["mapping"] / (64 - 4)  # one mapped layer's maps (every layer reads 8 source layers)
    for n, m in ((1, 4), (4, 8), (8, 16), (16, 32)):
        assert total[m] - total[n] == pytest.approx((m - n) * (layer - maps), rel=1e-6)
    assert all(a > b for a, b in zip(by.values(), list(by.values())[1:]))
    assert "by exact layers       1: " in format_plan(plan)


@pytest.mark.parametrize("rank", [3, 8, 1000])
def test_residual_shared_rank_costs_what_a_saved_mapper_holds_and_computes(rank):
    """`plan --residual-rank R`: the residual maps through one projection to rank R shared by every layer, as a fit
    saves them. Against a mapper built with that residual input (its `down` and per-layer weights, and the FLOPs
    its transfer counts), and a rank above the features capped at them."""
    import dataclasses

    from conftest import residual_pair
    from hf_kvtransfer.commands.plan import map_input_costs
    from hf_kvtransfer.core.map_inputs import map_inputs_of, with_input
    from hf_kvtransfer.core.residual import ResidualConfig

    source, target, _, base, _ = residual_pair()
    lags, layer = (0, 1, 2), 1
    config = dataclasses.replace(base.config, num_exact_layers=layer + 1)
    mapper = KVMapper(with_input(config, "residual", ResidualConfig(layer, list(lags), rank=min(rank, 3 * 64))))
    held = mapper.residual.down.numel() + sum(p.numel() for name, p in mapper.residual.named_parameters() if name != "down")
    mapped, tokens = 3 - (layer + 1), 17
    cost = map_input_costs(target.config, mapped, tokens, {"residual_positions": len(lags)}, ranks={"residual_rank": rank})["residual"]
    assert cost.parameters == held and cost.features == 3 * 64
    (residual,) = [inp for inp in map_inputs_of(mapper) if inp.name == "residual"]
    assert cost.flops == residual.transfer_flops(tokens, set(range(layer + 1, 3)))


def test_plan_cli_residual_rank_and_window_reach_the_residual_rows(capsys):
    """Qwen3-0.6B -> 1.7B at rank 256: 3 x 2048 features into one projection, then 256 x (8 x 128) weights per map
    of the 27 mapped layers' keys and values; the rows' first token counts the exact layers within the window, as
    the plan's own first token does."""
    from hf_kvtransfer.core.flops import exact_layers_flops
    from hf_kvtransfer.commands.model_configs import load_model_config

    args = ["plan", "--source", "Qwen/Qwen3-0.6B", "--target", "Qwen/Qwen3-1.7B", "--offline", "--seq-len", "1024",
            "--exact-layers", "1", "--exact-window", "128", "--residual-rank", "256"]  # fmt: skip
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    row = out["map_inputs"]["residual"]
    assert row["shared_rank"] == 256 and row["parameters"] == 3 * 2048 * 256 + 2 * 27 * 256 * 1024
    windowed = exact_layers_flops(load_model_config("Qwen/Qwen3-1.7B", use_hub=False), 1024 - 32, 1, window=128)
    assert row["first_token_flops_alone"]["exact_layers"] == windowed == out["first_token_flops"]["exact_layers"]
    assert main(args) == 0
    assert "through one projection to rank 256 shared by every map" in capsys.readouterr().out


# -- the fit's statistics budget, as the fit applies it (`fitting/budget.py`) -----------------------------------------


def _residual_bytes_per_layer(source_features: int, residual_features: int, target_features: int) -> int:
    """The residual input's sums of one residual layer, counted by hand: for keys and for values, float64, the Gram
    matrix of the features, their cross products with every target layer, the feature sums and the target's sums and
    sums of squares."""
    f = source_features + residual_features
    return 2 * 8 * (f * f + f * target_features + f + 2 * target_features)


def _directions_by_hand(budget: int, layers: int, hidden: int, target_features: int) -> int:
    """The most directions per position (3 positions) whose sums for `layers` residual layers, with each layer's
    [directions, hidden] basis, fit in `budget`: bisection on the count, each size counted by hand."""
    nbytes = lambda r: layers * (_residual_bytes_per_layer(0, 3 * r, target_features) + 8 * 3 * r * 3 * hidden)  # noqa: E731
    lo, hi = 0, hidden - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if nbytes(mid) <= budget else (lo, mid - 1)
    return lo


@pytest.mark.parametrize("gib,layers,with_source,compressed", [(None, 27, False, True), (1, 0, False, False),
                                                               (96, 27, False, True), (1000, 27, True, False)])
def test_plan_says_which_residual_layers_a_fit_collects_within_its_budget(gib, layers, with_source, compressed):
    """Qwen3-0.6B -> 1.7B: 28 x 8 x 128 source features per kind, 3 positions x 2048 residual features, 27 candidate
    residual layers (every one that leaves a layer to map). The default budget is 4 GiB; a given one is a total, of
    which the K/V sums take theirs first (full: two sets of 2 x (f^2 + f^2 + f + 2f) float64, f = 28 x 8 x 128; at
    1 GiB two-stage, and more than the budget). With the source's K/V the residual sums of a layer are 33 GiB,
    without them 3.2 GiB: where those cannot cover the 27 layers, each position's residual enters the sums through
    as many directions as let all 27 fit."""
    plan = plan_transfer("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", use_hub=False, available_memory=2**40,
                         max_statistics_memory=gib)  # fmt: skip
    row = plan.fit_input_statistics["residual"]
    target_features = 28 * 8 * 128
    with_kv, alone = _residual_bytes_per_layer(28 * 8 * 128, 3 * 2048, target_features), _residual_bytes_per_layer(0, 3 * 2048, target_features)
    assert (row["bytes_per_layer"], row["bytes_per_layer_residual_alone"]) == (with_kv, alone)
    f = 28 * 8 * 128
    kv_full = 2 * 2 * 8 * (2 * f * f + 3 * f)
    given = None if gib is None else gib * 2**30
    budget = 4 * 2**30 if given is None else given - kv_full if given >= kv_full else 0  # 1 GiB: two-stage, over it
    assert row["budget_bytes"] == budget
    assert row["layers"] == list(range(layers)) and row["source_features"] == with_source
    assert row["candidates"] == 27
    if compressed:
        directions = _directions_by_hand(budget, 27, 2048, target_features)
        assert row["directions"] == directions >= 16 and 27 * alone > budget
        assert row["bytes"] == 27 * (_residual_bytes_per_layer(0, 3 * directions, target_features) + 8 * 3 * directions * 3 * 2048)
        assert f"through {3 * directions} of their 6144 dimensions" in row["line"]
    else:
        assert row["directions"] is None
        assert min(27, budget // (with_kv if with_source else alone)) == layers  # the most that fit in the budget
        assert row["bytes"] == layers * (with_kv if with_source else alone)
    text = format_plan(plan)
    assert row["line"] in text
    if not layers:
        assert row["line"].startswith("residual-input maps: not tried") and "in all" not in text
    else:  # the K/V sums the fit picks (full: two sets of 24.5 GiB here) and the residual sums together
        assert plan.fit_default_statistics_bytes == 2 * plan.statistics_bytes_full
        total = (2 * plan.statistics_bytes_full + row["bytes"]) / 2**30
        assert f"in all:    {total:,.2f} GiB" in text


def test_plan_and_fit_take_the_same_budget():
    """The plan's K/V mode and residual layers at a budget given in GiB are the ones the fit takes: the statistics
    bytes against that budget (not the free memory), and the residual layers `ResidualFit` collects for the same
    budget on real models of those configs."""
    from hf_kvtransfer.fitting.config import FitConfig
    from hf_kvtransfer.fitting.residual_stats import ResidualFit
    from hf_kvtransfer.fitting.accumulate import plan_kv_sums

    free = plan_transfer(SOURCE, TARGET, top_k=1, available_memory=2**40)
    full = 2 * free.statistics_bytes_full
    assert free.fit_default_mode == "full"
    tight = plan_transfer(SOURCE, TARGET, top_k=1, available_memory=2**40, max_statistics_memory=(full - 1) / 2**30)
    assert tight.fit_default_mode == "two-stage" and tight.statistics_budget_bytes == full - 1
    assert "--max-statistics-memory" in tight.statistics_budget_origin
    per_layer = tight.fit_input_statistics["residual"]["bytes_per_layer"]
    gib = (full + 2.5 * per_layer) / 2**30  # the full K/V sums and residual layers (two or more at 2 positions)
    plan = plan_transfer(SOURCE, TARGET, top_k=1, available_memory=2**40, max_statistics_memory=gib, residual_positions=2)
    logs = []
    source, target = Qwen3ForCausalLM(SOURCE), Qwen3ForCausalLM(TARGET)
    config = FitConfig(max_statistics_memory=gib, residual_lags=(0, 1), statistics_device="cpu")
    kv = plan_kv_sums(source, target, FitConfig().num_sequences, config)
    stats = ResidualFit().statistics(source, target, config, kv.residual_budget(), logs.append)
    row = plan.fit_input_statistics["residual"]
    assert row["budget_bytes"] == int(gib * 2**30) - full and len(row["layers"]) >= 2
    assert list(stats.target_hidden_layers) == row["layers"] and stats.source_features == row["source_features"]
    assert logs == [row["line"]]


def test_plan_cli_max_statistics_memory(capsys):
    assert main(["plan", "--source", "Qwen/Qwen3-0.6B", "--target", "Qwen/Qwen3-1.7B", "--offline", "--json",
                 "--max-statistics-memory", "96"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["statistics_budget_bytes"] == 96 * 2**30 and out["fit_default_mode"] == "full"
    # One total: the residual sums (the residual features alone) get what the full K/V sums leave of the 96 GiB.
    residual = out["fit_input_statistics"]["residual"]
    left = 96 * 2**30 - out["fit_default_statistics_bytes"]
    assert residual["layers"] == list(range(27)) and not residual["source_features"]
    assert residual["directions"] == _directions_by_hand(left, 27, 2048, 28 * 8 * 128)
    assert left // residual["bytes_per_layer_residual_alone"] < 27  # whole, the features would cover fewer
    # docs/guides/plan.md quotes this run
    guide = " ".join((Path(__file__).parents[1] / "docs/guides/plan.md").read_text(encoding="utf-8").split())
    total = (out["fit_default_statistics_bytes"] + residual["bytes"]) / 2**30
    assert f"residual entering every one of its 27 candidate layers through 3 x {residual['directions']} directions" in guide
    assert f"(there, {total:.2f} GiB)" in guide
    assert f"full K/V sums take {out['fit_default_statistics_bytes'] / 2**30:.2f} GiB" in guide


def test_a_top_k_past_the_source_depth_plans_every_source_layer_as_the_fit_does():
    """The default k (8) on a 3-layer source: the fit reads every source layer (a k of 3), so the plan counts that
    mapper (the paper's formula at k = 3) and says so."""
    plan = plan_transfer(SOURCE, TARGET, top_k=8, available_memory=2**40)
    assert plan.top_k == 3 and plan.mapper_weight_parameters == _paper_parameters(5, 4, 8, 3, 2, 16)
    assert any("every source layer" in note for note in plan.notes)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 3\]"):
        plan_transfer(SOURCE, TARGET, top_k=0, available_memory=2**40)


# -- docs/guides/plan.md quotes `plan`'s own numbers (it is exempt from test_quoted_figures: nothing there is measured)

GUIDE = Path(__file__).parents[1] / "docs" / "guides" / "plan.md"
ORGS = {"Qwen": "Qwen", "Llama": "meta-llama"}


def _plan_json(capsys, source: str, target: str, *options: str) -> dict:
    def hub_id(name: str) -> str:
        return f"{ORGS[next(o for o in ORGS if name.startswith(o))]}/{name}"

    capsys.readouterr()
    assert main(["plan", "--source", hub_id(source), "--target", hub_id(target), "--offline", "--json", *options]) == 0
    return json.loads(capsys.readouterr().out)


def _agrees(quoted: str, value: float) -> bool:
    """`quoted` is `value` as printed: equal up to half a unit of its last digit."""
    decimals = len(quoted.split(".")[1]) if "." in quoted else 0
    return abs(float(quoted) - value) <= 0.5 * 10**-decimals + 1e-9


def _rows(section: str, cells: int) -> list[list[str]]:
    text = GUIDE.read_text(encoding="utf-8").split(f"## {section}")[1].split("\n## ")[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if " -> " in line and line.startswith("|")
            and not line.startswith("| source")]
    assert rows and all(len(r) == cells for r in rows), rows
    return rows


def test_the_guides_table_of_pairs_is_what_plan_computes(capsys):
    """'Some pairs': every number of every row against `plan --offline --json` at the defaults (k = 8, 4096 tokens,
    bf16): parameters, the mapper's size, the statistics, the FLOPs and their ratio, the transfer's memory."""
    gib = 2**30
    for name, params, size, stats, flops, ratio, memory in _rows("Some pairs", 7):
        out = _plan_json(capsys, *name.split(" -> "))
        want = [(params.split()[0], out["mapper_parameters"] / 1e9), (size.split()[0], out["mapper_bytes"] / gib),
                (stats.split()[0], out["statistics_bytes_full"] / gib), (stats.split()[2], out["statistics_bytes_two_stage"] / gib),
                (flops.split()[0], out["mapping_flops"] / 1e12), (flops.split()[2], out["prefill_flops"] / 1e12),
                (ratio.rstrip("x"), out["flop_ratio"]), (memory.split()[0], out["target_cache_bytes"] / gib),
                (memory.split()[2], out["transfer_working_bytes"] / gib)]  # fmt: skip
        wrong = [(q, v) for q, v in want if not _agrees(q, v)]
        assert not wrong, (name, wrong)


def test_the_guides_first_token_figures_are_what_plan_computes(capsys):
    """'To the first token': the table at 4 exact layers (source K/V maps, with the residual, the residual alone),
    the reduced ranks of the prose, and the ratios by exact layers."""
    import re

    for name, own, kv, residual, alone in _rows("To the first token, and maps that read the target's residual stream", 5):
        out = _plan_json(capsys, *name.split(" -> "), "--exact-layers", "4", "--seq-len", "4096")
        res = out["map_inputs"]["residual"]
        want = [out["first_token_flops"]["own_prefill"] / 1e12, out["first_token_flops"]["total"] / 1e12,
                out["first_token_flop_ratio"], res["first_token_flops"]["total"] / 1e12, res["first_token_flop_ratio"],
                res["parameters"] / 1e9, 100 * res["parameters"] / out["mapper_parameters"],
                res["first_token_flops_alone"]["total"] / 1e12, res["first_token_flop_ratio_alone"]]  # fmt: skip
        texts = re.findall(r"\d+(?:\.\d+)?", " ".join((own, kv, residual, alone)))
        assert len(texts) == len(want) and all(_agrees(q, v) for q, v in zip(texts, want)), (name, texts, want)
    guide = " ".join(GUIDE.read_text(encoding="utf-8").split())
    for rank in (1024, 256):
        res = _plan_json(capsys, "Qwen3-14B", "Qwen3-32B", "--exact-layers", "4", "--seq-len", "4096",
                         "--residual-rank", str(rank))["map_inputs"]["residual"]  # fmt: skip
        flops, ratio = re.search(rf"(\d+\.\d) TFLOP at rank {rank} \((\d+\.\d)x", guide).groups()
        assert _agrees(flops, res["first_token_flops_alone"]["total"] / 1e12), (rank, flops)
        assert _agrees(ratio, res["first_token_flop_ratio_alone"]), (rank, ratio)
    by_exact = _plan_json(capsys, "Qwen3-14B", "Qwen3-32B")["first_token_flop_ratio_by_exact_layers"]
    quoted = re.search(r"(\d+\.\d)x fewer FLOPs with 1 exact layer, (\d+\.\d)x with 8, (\d+\.\d)x with 16, (\d+\.\d)x with 32", guide)
    assert all(_agrees(q, by_exact[n]) for q, n in zip(quoted.groups(), ("1", "8", "16", "32"))), (quoted.groups(), by_exact)
