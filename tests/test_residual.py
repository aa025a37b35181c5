"""Maps that read the target's residual stream (`core/residual.py`, `fitting/residual_stats.py`): the closed-form solve
against a direct least-squares solve on features built without the library's hooks, the cache's keys and values
against the same map written out, checkpoints, and the refusals when the residual cannot be computed."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import random_ids, steady_timings, tiny_model
from rope_reference import apply_rope
from hf_kvtransfer import KVMapper, TransferredCache, fit_mapper, prefill
from hf_kvtransfer.core.capture import capture_kv
from hf_kvtransfer.core.key_norm import KeyNormConfig, inverse_rms
from hf_kvtransfer.core.map_inputs import maps_read, with_input
from hf_kvtransfer.core.residual import RESIDUAL_EPS, add_product, residual_features, residual_input_features
from hf_kvtransfer.core.rope import rotary_cos_sin
from hf_kvtransfer.fitting import exact_layers, residual_stats
from hf_kvtransfer.fitting.calibration_pass import calibration_pass
from hf_kvtransfer.fitting.residual_stats import ResidualStatistics, solve_residual_mapper

LAGS = (0, 1)


@pytest.fixture(scope="module")
def pair():
    source = tiny_model("qwen3", num_hidden_layers=2, seed=0)
    target = tiny_model("qwen3", num_hidden_layers=3, seed=1)
    ids = random_ids(6, 40, seed=5)
    base = fit_mapper(source, target, ids, top_k=2, num_exact_layers=1, heldout_fraction=0, progress=False)
    stats = ResidualStatistics.for_models(source, target, layers=[0, 1], lags=LAGS, stride=1)
    calibration_pass(source, target, ids, consumers=[stats], progress=False)
    return source, target, ids, base, stats


def _features_by_hand(source, target, ids, layer: int, kind: str):
    """`[selected source K|V, residual entering `layer` at LAGS]` and the targets of target layer 2, from
    transformers' own hidden states and modules (no hooks)."""
    keys, values = capture_kv(source, ids)
    x_src = torch.cat([s.permute(0, 2, 1, 3).flatten(2) for s in (keys if kind == "key" else values)], -1)
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states  # [i] enters layer i (i < num_layers)
        h = hidden[layer].double()
        r = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + RESIDUAL_EPS)
        lagged = [torch.cat([torch.zeros_like(r[:, :lag]), r[:, : r.shape[1] - lag]], 1) for lag in LAGS]
        block = target.model.layers[2]
        normed = block.input_layernorm(hidden[2])
        y = block.self_attn.k_proj(normed) if kind == "key" else block.self_attn.v_proj(normed)
    x = torch.cat([x_src.double(), *lagged], -1).flatten(0, 1).numpy()
    return x, y.double().flatten(0, 1).numpy(), x_src.shape[-1]


@pytest.mark.parametrize("kind", ["key", "value"])
def test_solve_matches_a_direct_ridge_on_hand_built_features(pair, kind):
    source, target, ids, base, stats = pair
    mapper = solve_residual_mapper(base, stats, residual_layer=1, residual_lambda=0.01)
    x, y, fs = _features_by_hand(source, target, ids, layer=1, kind=kind)
    mu, sd = x.mean(0), x.std(0)
    xs = (x - mu) / sd
    w = np.linalg.solve(xs.T @ xs / len(xs) + 0.01 * np.eye(xs.shape[1]), xs.T @ (y - y.mean(0)) / len(xs)) / sd[:, None]
    b = y.mean(0) - mu @ w
    got_src = getattr(mapper.layers[2], kind).weight.detach().double().numpy()
    got_res = mapper.residual.weight(kind, 2).detach().double().numpy()
    np.testing.assert_allclose(got_src, w[:fs].T, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(got_res, w[fs:].T, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(getattr(mapper.layers[2], kind).bias.detach().double().numpy(), b, rtol=1e-3, atol=1e-4)
    # Layers up to the residual layer keep the source-only maps; the config says what the cache must compute.
    assert torch.equal(mapper.layers[1].key.weight, base.layers[1].key.weight)
    c = mapper.config
    assert (c.map_inputs["residual"].layer, c.map_inputs["residual"].lags, "key_norm" in c.map_inputs, c.num_exact_layers) == (1, list(LAGS), True, 2)
    assert residual_input_features(c) == [0, 0, len(LAGS) * 64]


class OnePlusWeightNorm(torch.nn.Module):
    """A key norm of another form than Qwen3's: `(1 + weight) * x / rms(x)` (Gemma's), so the cache must call it."""

    def __init__(self, weight: torch.Tensor, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(weight.clone()), eps

    def forward(self, x):
        return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


@pytest.mark.parametrize("variant", ["with_source", "residual_alone", "other_norm_form"])
def test_cache_applies_the_map_and_the_targets_key_norm(pair, variant):
    """Every way the cache computes a residual reader (source features and the residual in one GEMM, the residual
    alone on a broadcast bias, the key norm fused or through the target's own module) against the map written out."""
    source, target, _, base, stats = pair
    sources = {2: []} if variant == "residual_alone" else None
    mapper = solve_residual_mapper(base, stats, residual_layer=1, sources=sources)
    attn = target.model.layers[2].self_attn
    own_norm = attn.k_norm
    if variant == "other_norm_form":
        attn.k_norm = OnePlusWeightNorm(torch.linspace(-0.5, 0.5, 16))
    try:
        _check_residual_reader(source, target, mapper, attn)
    finally:
        attn.k_norm = own_norm


def _check_residual_reader(source, target, mapper, attn):
    ids = random_ids(1, 24, seed=9)
    held = ids.shape[1] - 1
    cache = TransferredCache(prefill(source, ids), mapper, num_recompute_tokens=1, model=target)
    with torch.no_grad():
        target(ids[:, held:], cache=cache)
    # Written out: source K/V (stripped) and the target's own residual entering layer 1, map, k_norm, RoPE.
    keys, values = capture_kv(source, ids[:, :held])
    with torch.no_grad():
        h = target(ids[:, :held], output_hidden_states=True).hidden_states[1]
    r = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + RESIDUAL_EPS)
    res = torch.cat([r, torch.cat([torch.zeros_like(r[:, :1]), r[:, :-1]], 1)], -1)
    positions = torch.arange(held).unsqueeze(0)
    cos, sin = rotary_cos_sin(target.model.rotary_emb, positions, torch.device("cpu"))
    selected = mapper.config.selected_layers[2]
    for kind, states in (("key", keys), ("value", values)):
        x = torch.cat([states[s].permute(0, 2, 1, 3).flatten(2) for s in selected], -1) if selected else ids[:, :held, None][..., :0]
        linear = getattr(mapper.layers[2], kind)
        y = x.float() @ linear.weight.T + linear.bias + res @ mapper.residual.weight(kind, 2).T
        y = y.view(1, held, 2, 16)
        if kind == "key":
            with torch.no_grad():
                y = attn.k_norm(y)
            expected = apply_rope(y.transpose(1, 2), cos, sin)
        else:
            expected = y.transpose(1, 2)
        got = getattr(cache.layers[2], "keys" if kind == "key" else "values")[:, :, :held]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # The exact layers are the target's own prefill.
    own = prefill(target, ids[:, :held])
    torch.testing.assert_close(cache.layers[1].keys[:, :, :held], own.layers[1].keys, rtol=1e-4, atol=1e-5)


def test_the_key_norms_form_is_checked_once_per_module(pair, monkeypatch):
    """The check that a key norm is an RMS norm runs once per target module, not on every transfer."""
    from hf_kvtransfer.core import key_norm

    source, target, _, base, stats = pair
    mapper = solve_residual_mapper(base, stats, residual_layer=1)
    calls = []
    monkeypatch.setattr(key_norm, "_RMS_EPS", type(key_norm._RMS_EPS)())
    monkeypatch.setattr(key_norm, "rms_form", lambda norm, dim: calls.append(norm) or (norm.weight, norm.variance_epsilon))
    ids = random_ids(1, 16, seed=2)
    for _ in range(3):
        with torch.no_grad():
            target(ids[:, -1:], cache=TransferredCache(prefill(source, ids), mapper, num_recompute_tokens=1, model=target))
    assert calls == [target.model.layers[2].self_attn.k_norm]


def test_rms_form_is_recognised_only_for_weight_times_rms_norm():
    """The fused key norm is used only where it is the module's own computation: Qwen3's RMS norm at any weight and
    eps; not Gemma's `(1 + weight)` form, a layer norm, or a module without a weight."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from hf_kvtransfer.core.key_norm import rms_form

    gen = torch.Generator().manual_seed(3)
    for eps in (1e-6, 1e-5, 0.1):
        norm = Qwen3RMSNorm(16, eps=eps)
        norm.weight.data = torch.randn(16, generator=gen)
        weight, got_eps = rms_form(norm, 16)
        assert torch.equal(weight, norm.weight) and got_eps == eps
    assert rms_form(OnePlusWeightNorm(torch.randn(16, generator=gen)), 16) is None
    assert rms_form(torch.nn.LayerNorm(16), 16) is None
    assert rms_form(torch.nn.Identity(), 16) is None
    assert rms_form(Qwen3RMSNorm(8), 16) is None  # another width than the keys'


def test_checkpoint_round_trip_and_source_only_mappers_unchanged(pair, tmp_path):
    source, target, _, base, stats = pair
    mapper = solve_residual_mapper(base, stats, residual_layer=0, residual_rank=8)
    mapper.save_pretrained(tmp_path / "res")
    loaded = KVMapper.from_pretrained(tmp_path / "res")
    assert loaded.config == replace(mapper.config, num_parameters=loaded.config.num_parameters, dtype="float32")
    for name, tensor in mapper.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert loaded.residual.down.shape == (8, len(LAGS) * 64)
    base.save_pretrained(tmp_path / "base")
    plain = KVMapper.from_pretrained(tmp_path / "base")
    assert plain.residual is None and not plain.needs_exact_layers
    assert not any(k.startswith("residual") for k in plain.state_dict())
    ids = random_ids(1, 20, seed=2)
    outs = []
    for m in (loaded, mapper):
        with torch.no_grad():
            out = target(ids[:, -1:], cache=TransferredCache(prefill(source, ids), m, num_recompute_tokens=1, model=target)).logits
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1])


def test_reduced_rank_residual_block_approaches_full_rank(pair):
    source, target, _, base, stats = pair
    full = solve_residual_mapper(base, stats, residual_layer=1)
    rank = solve_residual_mapper(base, stats, residual_layer=1, residual_rank=len(LAGS) * 64)
    # Full rank through the projection spans the same inputs: the same fitted map (up to the ridge's scaling).
    assert rank.config.fit_r2_key[2] == pytest.approx(full.config.fit_r2_key[2], abs=0.02)
    low = solve_residual_mapper(base, stats, residual_layer=1, residual_rank=4)
    assert low.config.fit_r2_key[2] <= full.config.fit_r2_key[2] + 1e-9


def _ridge(x: np.ndarray, y: np.ndarray, lam: float) -> np.ndarray:
    """Predictions of a ridge on standardised inputs (numpy; the penalty relative to unit-variance features)."""
    mu, sd = x.mean(0), np.maximum(x.std(0), 1e-12)
    xs = (x - mu) / sd
    w = np.linalg.solve(xs.T @ xs / len(xs) + lam * np.eye(xs.shape[1]), xs.T @ (y - y.mean(0)) / len(xs))
    return xs @ w + y.mean(0), w / sd[:, None]


def _r2(y: np.ndarray, pred: np.ndarray) -> float:
    return float(1 - ((y - pred) ** 2).sum() / ((y - y.mean(0)) ** 2).sum())


@pytest.mark.parametrize("rank", [2, 6])
def test_reduced_rank_projection_is_reduced_rank_regression(pair, rank):
    """The shared projection keeps what the full-rank maps predict (reduced-rank regression, written out in numpy on
    features built by hand), which beats the residual features' own principal directions at the same rank."""
    source, target, ids, base, stats = pair
    lam = 0.01
    mapper = solve_residual_mapper(base, stats, residual_layer=1, residual_rank=rank, residual_lambda=lam)
    data = {kind: _features_by_hand(source, target, ids, layer=1, kind=kind) for kind in ("key", "value")}
    fs = data["key"][2]
    blocks = []
    for x, y, _ in data.values():
        w = _ridge(x, y, lam)[1]
        blocks.append(w[fs:] / np.sqrt(y.var(0).sum()))
    res = data["key"][0][:, fs:]
    cov = np.cov(res.T, bias=True)
    w = np.concatenate(blocks, axis=1)
    vecs = np.linalg.eigh(w.T @ cov @ w)[1][:, ::-1][:, :rank]
    directions = {"reduced-rank": w @ vecs, "principal": None}
    sd = res.std(0)
    pcs = np.linalg.eigh(np.cov((res / sd).T, bias=True))[1][:, ::-1][:, :rank]
    directions["principal"] = pcs / sd[:, None]
    r2 = {}
    for name, d in directions.items():
        r2[name] = {kind: _r2(y, _ridge(np.concatenate([x[:, :fs], x[:, fs:] @ d], axis=1), y, lam)[0])
                    for kind, (x, y, _) in data.items()}  # fmt: skip
    assert mapper.config.fit_r2_key[2] == pytest.approx(r2["reduced-rank"]["key"], abs=2e-3)
    assert mapper.config.fit_r2_value[2] == pytest.approx(r2["reduced-rank"]["value"], abs=2e-3)
    assert sum(r2["reduced-rank"].values()) > sum(r2["principal"].values())
    assert mapper.residual.down.shape == (rank, len(LAGS) * 64)


def test_refusals_say_why(pair):
    source, target, _, base, stats = pair
    mapper = solve_residual_mapper(base, stats, residual_layer=1)
    ids = random_ids(1, 20, seed=3)
    src_cache = prefill(source, ids)
    with pytest.raises(ValueError, match="num_exact_layers must be >= 2"):
        TransferredCache(src_cache, mapper, num_exact_layers=1)
    with pytest.raises(ValueError, match="not given the target model: pass model=target"):
        TransferredCache(src_cache, mapper, num_recompute_tokens=1).convert_all()
    # Given the target, convert_all computes the exact layers and the residual the maps read: the same K/V as the
    # lazy conversion inside the target's own forward.
    eager = TransferredCache(src_cache, mapper, num_recompute_tokens=1, model=target).convert_all()
    lazy = TransferredCache(src_cache, mapper, num_recompute_tokens=1, model=target)
    with torch.no_grad():
        target(ids[:, -1:], cache=lazy)
    for a, b in zip(eager.layers, lazy.layers):
        torch.testing.assert_close(a.keys, b.keys[:, :, :-1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values, b.values[:, :, :-1], rtol=1e-5, atol=1e-5)
    legacy = tuple((layer.keys, layer.values) for layer in src_cache.layers)  # no prompt ids
    with pytest.raises(ValueError, match="residual stream.*input_ids="):
        with torch.no_grad():
            target(ids[:, -1:], cache=TransferredCache(legacy, mapper, num_recompute_tokens=1, model=target))
    with pytest.raises(ValueError, match="TransferredCache"):
        mapper(2, torch.zeros(1, 4, 64), torch.zeros(1, 4, 64))
    # generate knows the prompt (its input ids): a legacy cache works there.
    out = target.generate(ids, cache=TransferredCache(legacy, mapper, model=target), max_new_tokens=2, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 2)
    res = mapper.config.map_inputs["residual"]
    with pytest.raises(ValueError, match=r"map_inputs.residual.layer must be in"):
        with_input(mapper.config, "residual", replace(res, layer=2))
    with pytest.raises(ValueError, match=r"map_inputs.residual.lags"):
        with_input(mapper.config, "residual", replace(res, lags=[0, 0]))
    with pytest.raises(ValueError, match="num_exact_layers >= 2"):
        replace(mapper.config, num_exact_layers=1)
    with pytest.raises(ValueError, match=r"map_inputs.key_norm needs a 'ridge' mapper reading the target's residual"):
        with_input(base.config, "key_norm", KeyNormConfig())


def test_residual_features_lags_and_padding():
    h = torch.randn(2, 5, 3)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    f = residual_features(h, [0, 2], mask)
    r = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + RESIDUAL_EPS) * mask.unsqueeze(-1)
    torch.testing.assert_close(f[..., :3], r)
    torch.testing.assert_close(f[:, 2:, 3:], r[:, :3])
    assert torch.all(f[:, :2, 3:] == 0) and torch.all(f[0, 2:4, 3:] == 0)  # before the row's first real token


def test_search_keeps_the_cheapest_candidate_reaching_the_retention(pair, monkeypatch):
    source, target, _, base, stats = pair
    residual = {j: solve_residual_mapper(base, stats, residual_layer=j) for j in (0, 1)}
    fake_tried = [{"num_exact_layers": 1, "retention": 0.1, "retention_ci": [0, 0.2]},
                  {"num_exact_layers": 2, "retention": 0.97, "retention_ci": [0.9, 1.0]}]  # fmt: skip

    def fake_probe(*args, **kwargs):
        return 2, {"tried": [dict(r) for r in fake_tried], "prefix_len": 64, "copy_gain": {"mean": 5.0, "ci": [4, 6]},
                   "reason": "the fewest"}  # fmt: skip

    retention = {1: 0.96, 2: 0.99}  # residual candidates by exact layers
    monkeypatch.setattr(exact_layers, "choose_num_exact_layers", fake_probe)
    def fake_retention(s, t, m, items, num_exact_layers, **kw):
        # Per-item NLLs with the asked retention: own 1, no context 3 nats, transfer between (the same per item).
        ret = retention[num_exact_layers] if m.needs_exact_layers else 0.99
        n = len(items)
        return {"retention": ret, "retention_ci": [ret - 0.05, ret + 0.05],
                "nll_per_item": {"own": [1.0] * n, "no_context": [3.0] * n, "transfer": [3.0 - 2.0 * ret] * n}}

    monkeypatch.setattr(exact_layers, "repeated_span_retention", fake_retention)
    times = {(False, 1): 10.0, (False, 2): 30.0, (True, 1): 20.0, (True, 2): 25.0}
    monkeypatch.setattr(exact_layers, "_time_candidates", steady_timings(lambda m, n: times[(m.needs_exact_layers, n)]))
    stream = random_ids(1, 600, seed=1)[0].tolist()
    chosen, report = exact_layers.choose_configuration(source, target, base, stream, candidates=residual,
                                                      min_retention=0.95)  # fmt: skip
    # Source-only with 1 exact layer is cheapest but loses the content; of the rest, residual J=0 (1 exact) is cheapest.
    assert chosen.config.map_inputs["residual"].layer == 0 and chosen.config.num_exact_layers == 1
    assert [r["chosen"] for r in report["candidates"]] == [False, False, True, False]
    assert report["chosen"] == 1 and "residual" in report["chosen_inputs"]
    # The choice is by the configurations' cost (multiply-adds from the shapes), not by their timings: a machine
    # on which the residual candidate times slower than everything (a load while it ran) chooses the same, and the
    # frontier's figures still follow process CPU time on CPU.
    def disturbed(s, t, configs, ids, rounds=5, measure_own=True):
        per, own = steady_timings(lambda m, n: 500.0 if m.needs_exact_layers else 1.0)(s, t, configs, ids, rounds, measure_own)
        for (m, n), p in zip(configs, per):
            p["wall"] = [900.0 if m.needs_exact_layers else ms for ms in p["wall"]]
        return per, own

    monkeypatch.setattr(exact_layers, "_time_candidates", disturbed)
    again, report_again = exact_layers.choose_configuration(source, target, base, stream, candidates=residual,
                                                            min_retention=0.95)  # fmt: skip
    row = next(r for r in report_again["candidates"] if r["chosen"])
    assert again.config.map_inputs["residual"].layer == 0 and report_again["timing"]["clock"] == "process CPU time"
    assert row["transfer_ms"] == 500.0 and row["transfer_wall_ms"] == 900.0 and not report_again["timing"]["decides"]
    untimed = ("transfer_ms", "transfer_wall_ms", "target_prefill_ms", "target_prefill_wall_ms", "speedup", "timing_rounds")
    assert [{k: v for k, v in r.items() if k not in untimed} for r in report["candidates"]] == \
        [{k: v for k, v in r.items() if k not in untimed} for r in report_again["candidates"]]
    kept = [r for r in report["candidates"] if r["passes"] and not r.get("skipped") and r["num_exact_layers"] < 3]
    assert row["cost"]["total"] == min(r["cost"]["total"] for r in kept)
    retention.update({1: 0.5, 2: 0.5})
    chosen, report = exact_layers.choose_configuration(source, target, base, stream, candidates=residual,
                                                      min_retention=0.95)  # fmt: skip
    assert not chosen.needs_exact_layers and chosen.config.num_exact_layers == 2


def test_the_search_bounds_candidates_by_the_source_only_answer(pair, monkeypatch):
    """Residual layers up to the last but one are candidates; those with more exact layers than the source-only
    answer are not probed; when that answer is the whole target, a candidate that keeps the content must also beat
    the target's own prefill (100 ms here) to be kept."""
    source, target, _, base, stats = pair
    assert residual_stats.residual_candidates(8) == list(range(7)) and residual_stats.residual_candidates(3) == [0, 1]
    assert residual_stats.residual_candidates(1) == [0]
    residual = {j: solve_residual_mapper(base, stats, residual_layer=j) for j in (0, 1)}
    answer = {"num_exact": 1}

    def fake_probe(*args, **kwargs):
        k = answer["num_exact"]
        return k, {"tried": [{"num_exact_layers": k, "retention": 0.97, "retention_ci": [0.95, 0.99]}], "prefix_len": 64,
                   "copy_gain": {"mean": 5.0, "ci": [4, 6]}, "reason": "the fewest"}  # fmt: skip

    retention = {0: 0.5, 1: 0.99}  # by residual layer; the source-only answer keeps 0.99
    probed = []

    def fake_retention(s, t, m, items, num_exact_layers, **kw):
        layer = m.config.map_inputs["residual"].layer if m.needs_exact_layers else None
        probed.append(layer)
        ret = retention[layer] if m.needs_exact_layers else 0.99
        n = len(items)
        return {"retention": ret, "retention_ci": [ret - 0.01, ret + 0.01],
                "nll_per_item": {"own": [1.0] * n, "no_context": [3.0] * n, "transfer": [3.0 - 2.0 * ret] * n}}

    monkeypatch.setattr(exact_layers, "choose_num_exact_layers", fake_probe)
    monkeypatch.setattr(exact_layers, "repeated_span_retention", fake_retention)
    ms = {"ms": 50.0}
    monkeypatch.setattr(exact_layers, "_time_candidates", steady_timings(lambda m, n: ms["ms"] if m.needs_exact_layers else 40.0))
    stream = random_ids(1, 600, seed=1)[0].tolist()
    chosen, report = exact_layers.choose_configuration(source, target, base, stream, candidates=residual)
    # 1 exact layer suffices source-only: residual layer 1 (2 exact) is not probed.
    assert 1 not in probed and "more exact layers than the source-only answer's 1" in report["candidates"][-1]["skipped"]
    assert not chosen.needs_exact_layers and chosen.config.num_exact_layers == 1
    # The source-only answer computes all 3 layers: a residual candidate that keeps the content is kept when it costs
    # less than the own prefill (whatever the clock says), and not when it costs more.
    answer["num_exact"] = 3
    ms["ms"] = 120.0  # slower than the own prefill's 100 ms: timing decides nothing
    chosen, report = exact_layers.choose_configuration(source, target, base, stream, candidates=residual)
    assert chosen.config.map_inputs["residual"].layer == 1 and chosen.config.num_exact_layers == 2
    cost = exact_layers.configuration_cost

    def dearer(target, mapper, num_exact, seq_len):  # maps that cost more than the layers they replace
        c = cost(target, mapper, num_exact, seq_len)
        return {**c, "total": c["total"] + (10**9 if mapper.needs_exact_layers else 0)}

    monkeypatch.setattr(exact_layers, "configuration_cost", dearer)
    chosen, report = exact_layers.choose_configuration(source, target, base, stream, candidates=residual)
    assert not chosen.needs_exact_layers and chosen.config.num_exact_layers == 3
    row = next(r for r in report["candidates"] if r.get("residual_layer") == 1)
    assert row["passes"] and row["not_cheaper_than_own_prefill"] and not row["chosen"]
    assert "cost no less than the target's own prefill" in report["reason"]


def test_a_reduced_rank_candidate_is_kept_when_cheaper_and_skipped_when_its_full_rank_twin_fails(pair, monkeypatch):
    source, target, _, base, stats = pair
    alone = {t: [] for t in (1, 2)}
    full = solve_residual_mapper(base, stats, residual_layer=0, sources=alone)
    low = solve_residual_mapper(base, stats, residual_layer=0, sources=alone, residual_rank=4)
    every = solve_residual_mapper(base, stats, residual_layer=0)  # the first of the layer: it passes, slowest

    def fake_probe(*args, **kwargs):
        return 3, {"tried": [{"num_exact_layers": 1, "retention": 0.1, "retention_ci": [0, 0.2]}], "prefix_len": 64,
                   "copy_gain": {"mean": 5.0, "ci": [4, 6]}, "reason": "the fewest"}  # fmt: skip

    retention = {}
    monkeypatch.setattr(exact_layers, "choose_num_exact_layers", fake_probe)

    def fake_retention(s, t, m, items, num_exact_layers, **kw):
        ret = retention.get(id(m), 0.99)
        n = len(items)
        return {"retention": ret, "retention_ci": [ret - 0.01, ret + 0.01],
                "nll_per_item": {"own": [1.0] * n, "no_context": [3.0] * n, "transfer": [3.0 - 2.0 * ret] * n}}

    monkeypatch.setattr(exact_layers, "repeated_span_retention", fake_retention)
    times = {id(base): 10.0, id(every): 40.0, id(full): 30.0, id(low): 20.0}
    monkeypatch.setattr(exact_layers, "_time_candidates", steady_timings(lambda m, n: times[id(m)]))
    stream = random_ids(1, 600, seed=1)[0].tolist()
    chosen, report = exact_layers.choose_configuration(source, target, base, stream, candidates=[every, full, low])
    assert chosen.config.map_inputs["residual"].rank == 4 and chosen.residual.down.shape == (4, len(LAGS) * 64)
    assert "rank 4" in report["chosen_inputs"]
    retention[id(full)] = 0.5  # the full-rank maps lose the content: the reduced rank is not probed at all
    probed = []
    monkeypatch.setattr(exact_layers, "repeated_span_retention", lambda s, t, m, *a, **kw: probed.append(m) or fake_retention(s, t, m, *a, **kw))
    chosen, report = exact_layers.choose_configuration(source, target, base, stream, candidates=[every, full, low])
    assert chosen.config.map_inputs["residual"].rank is None and chosen.config.selected_layers[1:] == [[0, 1], [0, 1]]
    assert low not in probed and "full rank failed" in report["candidates"][-1]["skipped"]


def test_only_the_readers_read_the_residual(pair):
    source, target, _, base, stats = pair
    mapper = solve_residual_mapper(base, stats, residual_layer=0, readers=[2])
    assert residual_input_features(mapper.config) == [0, 0, len(LAGS) * 64]
    assert sorted(mapper.residual.key.keys()) == ["2"]
    # Layer 1 keeps the source-only map: the cache's keys there are the source-only mapper's.
    ids = random_ids(1, 20, seed=4)
    caches = []
    for m in (mapper, base):
        cache = TransferredCache(prefill(source, ids), m, num_recompute_tokens=1, num_exact_layers=1, model=target)
        with torch.no_grad():
            target(ids[:, -1:], cache=cache)
        caches.append(cache)
    torch.testing.assert_close(caches[0].layers[1].keys, caches[1].layers[1].keys)
    assert not torch.allclose(caches[0].layers[2].keys, caches[1].layers[2].keys)
    with pytest.raises(ValueError, match=r"map_inputs.residual.readers"):
        with_input(mapper.config, "residual", replace(mapper.config.map_inputs["residual"], readers=[0]))


def test_fit_config_residual_fields():
    from hf_kvtransfer import FitConfig

    config = FitConfig(residual_lags="0,2", residual_rank=16)
    assert config.residual_lags == (0, 2) and config.residual_rank == 16 and config.exact_layers_retention == 0.95
    assert config.residual_inputs == "auto"  # the probe scores cued recall too (research/recall_probe)
    for bad, match in (({"residual_lags": "0,0"}, "residual_lags"), ({"residual_inputs": "yes"}, "residual_inputs"),
                       ({"residual_rank": 0}, "residual_rank"), ({"residual_stride": 0}, "residual_stride")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            FitConfig(**bad)


def test_card_has_the_frontier_table(pair):
    from hf_kvtransfer.core.card import render_model_card

    _, _, _, base, stats = pair
    mapper = solve_residual_mapper(base, stats, residual_layer=1)
    rows = [{"inputs": "source K/V", "num_exact_layers": 1, "retention": 0.02, "retention_ci": [0.0, 0.04],
             "transfer_ms": 10.0, "target_prefill_ms": 50.0, "speedup": 5.0, "chosen": False},
            {"inputs": "source K/V + target residual entering layer 1 (t, t-1)", "num_exact_layers": 2,
             "residual_layer": 1, "num_recompute_tokens": 1, "retention": 0.97, "retention_ci": [0.95, 0.99],
             "cued_retention": 0.91, "cued_retention_ci": [0.85, 0.97], "transfer_ms": 20.0, "target_prefill_ms": 50.0,
             "speedup": 2.5, "chosen": True},
            {"inputs": "not probed at all", "num_exact_layers": 3, "residual_layer": 2, "skipped": "a shallower one passed"}]  # fmt: skip
    report = {"exact_layers": {"candidates": rows, "tried": [], "timing": {"num_tokens": 512, "threads": 1}}}
    card = str(render_model_card(mapper.config.to_dict(), report=report))
    assert "What this mapper keeps at what speed" in card and "512 prompt tokens, 1 thread" in card
    assert ("| source K/V + target residual entering layer 1 (t, t-1) | 2 | 1 | 97.0% [95.0, 99.0] | 91.0% [85.0, 97.0] "
            "| – | – | no | 20.0 / 50.0 | 2.50x | yes |") in card
    assert "| source K/V | 1 | default | 2.0% [0.0, 4.0] | – | – | – | no | 10.0 / 50.0 | 5.00x |  |" in card
    assert "not probed at all" not in card  # skipped candidates stay in fit_report.json
    assert "no content gate" in card
    # With the content gate: its paired differences (points) and what it kept.
    rows[1].update(passes=True, gate={"accepted": True, "tasks": {
        "recall": {"difference": -0.01, "difference_ci": [-0.04, 0.02], "num_items": 128},
        "handoff": {"difference": 0.0, "difference_ci": [-0.03, 0.03], "num_items": 256}}})  # fmt: skip
    report["exact_layers"]["gate"] = {"used": True, "tolerance": 0.05, "items": 128, "max_items": 512}
    report["exact_layers"]["timing"].update(clock="process CPU time", rounds=5)
    card = str(render_model_card(mapper.config.to_dict(), report=report))
    assert "| -1.0 [-4.0, +2.0] on 128 | +0.0 [-3.0, +3.0] on 256 | yes | 20.0 / 50.0 | 2.50x | yes |" in card
    assert "low end is above -5 points on each, 128 items per task, up to 512" in card
    assert "512 prompt tokens, 1 thread, medians of process CPU time over 5 interleaved rounds" in card
    assert "**What the mapped layers read**: source K/V + target residual entering layer 1 (" in card
    assert "among\nthem what the target computed in its exact layers (its own residual stream)" in card  # the method


def test_fit_with_residual_inputs_runs_the_statistics_in_the_same_pass(pair):
    source, target, ids, _, _ = pair
    logs = []
    mapper = fit_mapper(source, target, ids, top_k=2, residual_inputs="auto", heldout_fraction=0, progress=False,
                        log=logs.append)  # fmt: skip
    assert any("residual-input statistics for residual layers [0, 1]" in line for line in logs), logs
    # Too few tokens for the probe here (6 x 40): it keeps the source-only default.
    assert not mapper.needs_exact_layers and "default 1 kept" in mapper.report["exact_layers"]["reason"]


def test_the_fit_searches_every_registered_fit_input(pair, monkeypatch):
    """The fit takes its consumers and candidates from the fit-input registry (`fitting/fit_inputs.py`), not from a
    named input: a plug-in registered beside the residual's is asked too, and the residual's own consumer sees the
    calibration pass and hands its sums to its candidates."""
    from hf_kvtransfer.fitting import fit_inputs

    source, target, ids, _, _ = pair
    calls = []

    class Toy(fit_inputs.FitInput):
        name, tag = "toy", "toy"

        def statistics(self, source, target, config, budget, log):
            calls.append("toy statistics")
            log("toy: not searched here")

    class Residual(residual_stats.ResidualFit):
        def candidates(self, mapper, statistics, config):
            calls.append(("residual candidates", sum(statistics.count.values())))
            return super().candidates(mapper, statistics, config)

    monkeypatch.setitem(fit_inputs.FIT_INPUTS, "toy", Toy)
    monkeypatch.setitem(fit_inputs.FIT_INPUTS, "residual", Residual)
    logs = []
    fit_mapper(source, target, ids, top_k=2, heldout_fraction=0, progress=False, stride=1, log=logs.append)
    assert calls[0] == "toy statistics" and "toy: not searched here" in logs
    # 6 sequences x 40 tokens, every token (stride 1), for each of the residual layers [0, 1]
    assert calls[1:] == [("residual candidates", 2 * 6 * 40)], calls


@pytest.mark.parametrize("kind", ["key", "value"])
def test_residual_alone_and_mean_maps_match_direct_solves(pair, kind):
    """`sources={t: []}`: a reader's map is a ridge on the residual block alone; a layer with no inputs at all keeps
    the calibration mean. Both against solves on hand-built features, and the cache applies them without reading
    any source layer."""
    source, target, ids, base, stats = pair
    alone = solve_residual_mapper(base, stats, residual_layer=1, sources={2: []}, residual_lambda=0.01)
    x, y, fs = _features_by_hand(source, target, ids, layer=1, kind=kind)
    xr = x[:, fs:]
    mu, sd = xr.mean(0), xr.std(0)
    xs = (xr - mu) / sd
    w = np.linalg.solve(xs.T @ xs / len(xs) + 0.01 * np.eye(xs.shape[1]), xs.T @ (y - y.mean(0)) / len(xs)) / sd[:, None]
    assert alone.config.selected_layers[2] == [] and getattr(alone.layers[2], kind).weight.shape[1] == 0
    np.testing.assert_allclose(alone.residual.weight(kind, 2).detach().double().numpy(), w.T, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(getattr(alone.layers[2], kind).bias.detach().double().numpy(), y.mean(0) - mu @ w,
                               rtol=1e-3, atol=1e-4)  # fmt: skip
    # Layer 2 reads the residual only: a mean map for layer 2 needs a reader elsewhere, so use residual layer 0 with
    # layer 1 reading and layer 2 without inputs.
    mean = solve_residual_mapper(base, stats, residual_layer=0, readers=[1], sources={2: []})
    np.testing.assert_allclose(getattr(mean.layers[2], kind).bias.detach().double().numpy(), y.mean(0), rtol=1e-4, atol=1e-5)
    assert mean.config.fit_r2_key[2] == pytest.approx(0.0, abs=1e-9)
    # The cache: no source layer is read by a mapped layer of `alone` (layers 0-1 exact, 2 from the residual).
    assert 2 not in {t for readers in alone.consumers().values() for t in readers}
    test_ids = random_ids(1, 16, seed=11)
    cache = TransferredCache(prefill(source, test_ids), alone, num_recompute_tokens=1, model=target)
    with torch.no_grad():
        target(test_ids[:, -1:], cache=cache)
    assert cache.layers[2].keys.shape == (1, 2, 16, 16) and torch.isfinite(cache.layers[2].keys).all()


def test_empty_source_selection_needs_a_residual_ridge_mapper(pair):
    _, _, _, base, _ = pair
    with pytest.raises(ValueError, match="selected_layers\\[2\\] is empty"):
        replace(base.config, selected_layers=[[0], [0], []])


def _ridge_r2(x, y, lam=0.01):
    mu, sd = x.mean(0), x.std(0)
    xs = (x - mu) / sd
    w = np.linalg.solve(xs.T @ xs / len(xs) + lam * np.eye(xs.shape[1]), xs.T @ (y - y.mean(0)) / len(xs)) / sd[:, None]
    resid = y - (x @ w + y.mean(0) - mu @ w)
    return 1 - (resid**2).sum() / ((y - y.mean(0)) ** 2).sum()


def test_variants_pick_the_layer_that_gains_most_from_the_residual(pair):
    from hf_kvtransfer.fitting.residual_stats import residual_r2_gain, residual_variants

    source, target, ids, base, stats = pair
    assert base.config.selected_layers[2] == [0, 1]  # every source layer: the hand-built features' source block
    gain = residual_r2_gain(base, stats, residual_layer=1)
    expected = np.mean([_ridge_r2(x, y) - _ridge_r2(x[:, :fs], y)
                        for x, y, fs in (_features_by_hand(source, target, ids, 1, kind) for kind in ("key", "value"))])  # fmt: skip
    assert gain[2] == pytest.approx(expected, abs=2e-3)
    gain = residual_r2_gain(base, stats, residual_layer=0)
    variants = residual_variants(base, stats, residual_layer=0)
    readers = [v.config.map_inputs["residual"].readers for v in variants]
    assert readers[0] is None and readers[1] == [max(gain, key=gain.get)]
    assert variants[2].config.selected_layers[1:] == [[1], [1]] and variants[-1].config.selected_layers[1:] == [[], []]
    # The probe's table names what each one reads (two of them differ only in the source layers).
    labels = [maps_read(v.config) for v in variants]
    assert labels[0].startswith("source K/V + target residual entering layer 0") and "read by every mapped layer" in labels[0]
    assert f"read by layer {readers[1][0]}" in labels[1]
    assert labels[2].startswith("source layer 1's K/V + ") and labels[-1].startswith("no source K/V + ")
    assert len(set(labels)) == len(labels)


def test_variants_end_with_a_reduced_rank_residual_alone_map_where_it_is_cheaper(pair, monkeypatch):
    from hf_kvtransfer.fitting import residual_stats

    source, target, ids, base, stats = pair
    # The tiny pair's maps need nearly every direction for 99%: ask for less, so that a rank is cheaper.
    monkeypatch.setattr(residual_stats, "RESIDUAL_RANK_ENERGY", 0.8)
    variants = residual_stats.residual_variants(base, stats, residual_layer=0)
    low, alone = variants[-1], variants[-2]
    assert alone.config.map_inputs["residual"].rank is None and low.config.selected_layers == alone.config.selected_layers == [[0, 1], [], []]
    rank, features, outputs = low.config.map_inputs["residual"].rank, len(LAGS) * 64, 2 * 2 * stats.target_layout.layer_dim
    assert rank is not None and rank * (features + outputs) <= features * outputs / 2
    assert low.residual.down.shape == (rank, features)
    # It keeps at least that fraction of what the full-rank maps fit (R^2 summed over the mapped layers, both kinds).
    fitted = lambda m: sum(m.config.fit_r2_key[1:]) + sum(m.config.fit_r2_value[1:])  # noqa: E731
    assert 0.8 * fitted(alone) - 1e-3 <= fitted(low) < fitted(alone)
    # An explicit rank applies to every variant, and no extra one is added.
    ranked = residual_stats.residual_variants(base, stats, residual_layer=0, residual_rank=8)
    assert {v.config.map_inputs["residual"].rank for v in ranked} == {8} and len(ranked) == len(variants) - 1


def test_residual_statistics_resume_from_a_checkpoint_as_if_uninterrupted(pair, tmp_path, monkeypatch):
    from hf_kvtransfer.fitting import calibration_pass as pass_module

    source, target, ids, _, _ = pair

    def fresh():
        return ResidualStatistics.for_models(source, target, layers=[0, 1], lags=LAGS, stride=1)

    whole = fresh()
    calibration_pass(source, target, ids, consumers=[whole], batch_size=2, num_heldout=2, progress=False)
    real, calls = pass_module.capture_kv, []

    def failing(*args, **kwargs):  # the source capture of the 3rd batch fails (after 2 checkpointed batches)
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(pass_module, "capture_kv", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        calibration_pass(source, target, ids, consumers=[fresh()], batch_size=2, num_heldout=2, checkpoint_dir=tmp_path,
                         checkpoint_every=1, progress=False)  # fmt: skip
    monkeypatch.setattr(pass_module, "capture_kv", real)
    resumed = fresh()
    calibration_pass(source, target, ids, consumers=[resumed], batch_size=2, num_heldout=2, checkpoint_dir=tmp_path,
                     progress=False)  # fmt: skip
    assert resumed.count == whole.count == {0: 4 * 40, 1: 4 * 40}  # the held-out shard (2 sequences) is not summed
    for key, sums in whole.sums.items():
        for name, tensor in sums.items():
            torch.testing.assert_close(resumed.sums[key][name], tensor, rtol=1e-12, atol=1e-9)
    with pytest.raises(ValueError, match="different fit.*residual"):  # other lags: a foreign checkpoint
        calibration_pass(source, target, ids, consumers=[ResidualStatistics.for_models(source, target, [0, 1], lags=(0,))],
                         batch_size=2, num_heldout=2, checkpoint_dir=tmp_path, progress=False)  # fmt: skip


def test_residual_statistics_do_not_depend_on_the_batch_size(pair):
    """`fit --batch-size` is the lever for the pass's memory (one batch's activations): the sums it collects, and so the
    maps solved from them, are those of one sequence at a time, up to the order of float additions."""
    source, target, ids, _, _ = pair
    sums = {}
    for batch_size in (1, 3):
        stats = ResidualStatistics.for_models(source, target, layers=[0, 1], lags=LAGS, stride=2)
        calibration_pass(source, target, ids, consumers=[stats], batch_size=batch_size, num_heldout=2, progress=False)
        sums[batch_size] = stats
    assert sums[1].count == sums[3].count and sums[1].source_features
    for key, by_name in sums[1].sums.items():
        for name, tensor in by_name.items():
            torch.testing.assert_close(sums[3].sums[key][name], tensor, rtol=1e-5, atol=1e-6)


def test_maps_without_source_inputs_follow_beam_search(pair):
    """Every mapped layer from the residual alone (the source cache gives only the length): beam search on the lazy
    cache writes what it writes on the same cache converted up front (the pending residual follows the beams)."""
    source, target, _, base, stats = pair
    alone = solve_residual_mapper(base, stats, residual_layer=0, sources={1: [], 2: []})
    assert alone.consumers() == {s: [0] for s in base.config.selected_layers[0]}  # only the exact layer lists any
    ids = random_ids(1, 18, seed=12)
    kwargs = dict(max_new_tokens=4, num_beams=2, do_sample=False)
    with torch.no_grad():
        lazy = target.generate(ids, cache=TransferredCache(prefill(source, ids), alone, num_recompute_tokens=2, model=target), **kwargs)
        ahead = TransferredCache(prefill(source, ids), alone, num_recompute_tokens=2, model=target)
        ahead.compute_exact_layers(target, ids).convert_all()
        ahead.batch_repeat_interleave(2)  # generate does not expand a given cache for its beams (a lazy one does)
        converted = target.generate(ids, cache=ahead, **kwargs)
    assert torch.equal(lazy, converted)


def test_a_mapper_can_record_its_recomputed_tokens(pair):
    from hf_kvtransfer import resolve_num_recompute_tokens

    source, target, _, base, _ = pair
    mapper = KVMapper(replace(base.config, num_recompute_tokens=3))
    mapper.layers.load_state_dict(base.layers.state_dict())
    ids = random_ids(1, 20, seed=13)
    assert TransferredCache(prefill(source, ids), mapper).num_recompute_tokens == 3
    assert TransferredCache(prefill(source, ids), base).num_recompute_tokens == 10  # the default, at most half
    assert resolve_num_recompute_tokens(None, 4, mapper.config) == 2 and resolve_num_recompute_tokens(5, 4, mapper) == 5
    with pytest.raises(ValueError, match="num_recompute_tokens must be an integer >= 1"):
        replace(base.config, num_recompute_tokens=0)


def test_candidates_are_timed_in_interleaved_rounds(monkeypatch):
    """A load that comes and goes falls on every candidate alike: each round times every candidate once (and the own
    prefill once), per-round figures of both clocks come back, and the row's medians are taken over rounds."""
    import hf_kvtransfer.evaluation.timing as timing
    from hf_kvtransfer.fitting import exact_layers

    true_ms = {"a": 10.0, "b": 12.0}
    calls, returned = [], {"a": [], "b": [], "own": []}

    def fake(source, target, mapper, ids, *, num_exact_layers, repeats, measure_own):
        slow = 3.0 if len(calls) < 3 else 1.0  # a load during the first calls only (wall clock: waiting for a core)
        calls.append((mapper, num_exact_layers, measure_own))
        returned[mapper].append(true_ms[mapper] * slow)
        own = 50.0 * slow if measure_own else None
        if own is not None:
            returned["own"].append(own)
        return {"transfer_ms": true_ms[mapper] * slow, "target_prefill_ms": own, "transfer_cpu_ms": true_ms[mapper],
                "target_prefill_cpu_ms": 50.0 if measure_own else None}  # fmt: skip

    monkeypatch.setattr(timing, "time_to_first_token", fake)
    out, own = exact_layers._time_candidates(None, None, [("a", 1), ("b", 2)], torch.zeros(1, 4, dtype=torch.long), rounds=5)
    assert calls == [("a", 1, True), ("b", 2, False)] * 5
    assert [o["wall"] for o in out] == [returned["a"], returned["b"]] and own["wall"] == returned["own"]
    assert [o["cpu"] for o in out] == [[10.0] * 5, [12.0] * 5]
    row = exact_layers._timing_row(out[0], own, "wall")
    assert row["transfer_ms"] == float(np.median(returned["a"])) == 10.0
    assert row["speedup"] == pytest.approx(np.median(returned["own"]) / 10.0)
    calls.clear()
    out, own = exact_layers._time_candidates(None, None, [("a", 1)], torch.zeros(1, 4, dtype=torch.long), rounds=2,
                                             measure_own=False)  # fmt: skip
    assert calls == [("a", 1, False)] * 2 and own == {"wall": [], "cpu": []}


def test_sign_test_threshold_matches_counting_every_outcome():
    """The fewest wins of n paired rounds whose two-sided sign test is at 5%, against an enumeration of all 2^n
    outcomes of fair coin tosses."""
    import itertools

    from hf_kvtransfer.evaluation.metrics import sign_test_min_wins

    for n in range(1, 15):
        counts = [sum(o) for o in itertools.product((0, 1), repeat=n)]
        expected = next((w for w in range(n // 2 + 1, n + 1)
                         if sum(max(c, n - c) >= w for c in counts) / len(counts) <= 0.05), None)  # fmt: skip
        assert sign_test_min_wins(n) == expected, n


@pytest.mark.parametrize("broadcast", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_add_product_is_rows_plus_the_product(broadcast, seed):
    g = torch.Generator().manual_seed(seed)
    n, f_in, f_out = 5 + 7 * seed, 3 + seed, 4 + 2 * seed
    features, weight = torch.randn(n, f_in, generator=g), torch.randn(f_out, f_in, generator=g)
    rows = torch.randn(f_out, generator=g).expand(n, -1) if broadcast else torch.randn(n, f_out, generator=g)
    want = rows.double() + features.double() @ weight.double().T
    torch.testing.assert_close(add_product(rows, features, weight).double(), want, rtol=1e-5, atol=1e-5)


def test_inverse_rms_normalises_as_rms_norm():
    x = torch.randn(3, 7, 2, 16, generator=torch.Generator().manual_seed(0)) * 3
    torch.testing.assert_close(x * inverse_rms(x, 1e-6), torch.nn.functional.rms_norm(x, (16,), eps=1e-6),
                               rtol=1e-5, atol=1e-6)  # fmt: skip


# -- statistics of the residual features alone (a real pair's source K/V would make the sums too large) -------------


@pytest.fixture(scope="module")
def residual_only(pair):
    source, target, ids, _, _ = pair
    stats = ResidualStatistics.for_models(source, target, layers=[0, 1], lags=LAGS, stride=1, source_features=False)
    calibration_pass(source, target, ids, consumers=[stats], progress=False)
    return stats


@pytest.mark.parametrize("kind", ["key", "value"])
def test_residual_alone_maps_solve_alike_without_the_source_features(pair, residual_only, kind):
    """Sums without the source's K/V give the maps of the residual alone: checked against a ridge on the residual
    block built by hand, with the sums' size as `residual_statistics_nbytes` counts it."""
    source, target, ids, base, _ = pair
    stats = residual_only
    fr = len(LAGS) * 64
    held = sum(t.nbytes for sums in stats.sums.values() for t in sums.values())
    assert held == residual_stats.residual_statistics_nbytes(stats.source_layout, stats.target_layout, 64, len(LAGS), 2,
                                                             source_features=False)  # fmt: skip
    assert stats.sums[(1, kind)]["gram"].shape == (fr, fr)
    alone = solve_residual_mapper(base, stats, residual_layer=1, sources={2: []}, residual_lambda=0.01)
    x, y, fs = _features_by_hand(source, target, ids, layer=1, kind=kind)
    xr = x[:, fs:]
    mu, sd = xr.mean(0), xr.std(0)
    xs = (xr - mu) / sd
    w = np.linalg.solve(xs.T @ xs / len(xs) + 0.01 * np.eye(fr), xs.T @ (y - y.mean(0)) / len(xs)) / sd[:, None]
    np.testing.assert_allclose(alone.residual.weight(kind, 2).detach().double().numpy(), w.T, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(getattr(alone.layers[2], kind).bias.detach().double().numpy(), y.mean(0) - mu @ w,
                               rtol=1e-3, atol=1e-4)  # fmt: skip
    with pytest.raises(ValueError, match="hold no source features: target layer 2 cannot read source layers"):
        solve_residual_mapper(base, stats, residual_layer=1)


def test_without_the_source_features_the_variants_read_the_residual_alone(pair, residual_only, monkeypatch):
    _, _, _, base, _ = pair
    monkeypatch.setattr(residual_stats, "RESIDUAL_RANK_ENERGY", 0.8)  # so that a reduced rank is cheaper here
    for layer in (0, 1):
        variants = residual_stats.residual_variants(base, residual_only, residual_layer=layer)
        assert [v.config.map_inputs["residual"].rank is None for v in variants] == [True, False][: len(variants)]
        assert all(v.config.selected_layers[layer + 1 :] == [[]] * (2 - layer) for v in variants)
        assert all(maps_read(v.config).startswith("no source K/V + ") for v in variants)


def _budget_fit(pair, monkeypatch, budget: int):
    """A fit whose residual-input statistics get `budget` bytes: its log and the candidates the probe is handed."""
    from hf_kvtransfer.fitting import budget as fit_budget
    from hf_kvtransfer.fitting import fit_inputs

    source, target, ids, _, _ = pair
    handed = []

    class Residual(residual_stats.ResidualFit):
        def candidates(self, mapper, statistics, config):
            groups = super().candidates(mapper, statistics, config)
            handed.extend(m for group in groups for m in group.solve())  # every group's maps, solved or not by the probe
            return groups

    monkeypatch.setitem(fit_inputs.FIT_INPUTS, "residual", Residual)
    monkeypatch.setattr(fit_budget, "RESIDUAL_STATISTICS_BYTES", budget)
    logs = []
    fit_mapper(source, target, ids, top_k=2, heldout_fraction=0, progress=False, stride=1, residual_lags=LAGS,
               log=logs.append)  # fmt: skip
    return [line for line in logs if line.startswith("residual-input")], handed


def test_the_fit_keeps_to_the_residual_features_where_the_source_would_cost_residual_layers(pair, monkeypatch):
    """The tiny pair's sums per residual layer, counted by hand: source K/V 2 x 2 x 16 and 2 lags x 64 residual
    features against 3 x 2 x 16 target features, both kinds, float64."""
    per_layer = {True: 16 * (192**2 + 192 * 96 + 192 + 192), False: 16 * (128**2 + 128 * 96 + 128 + 192)}
    (line,), handed = _budget_fit(pair, monkeypatch, 2 * per_layer[True])  # room for both layers either way
    assert line.startswith("residual-input statistics for residual layers [0, 1]") and "alone" not in line
    assert any(v.config.selected_layers[2] for v in handed)  # maps reading source layers too
    (line,), handed = _budget_fit(pair, monkeypatch, 2 * per_layer[False])  # with the source, only layer 0
    assert line.startswith("residual-input statistics for residual layers [0, 1]") and "the residual features alone" in line
    assert handed and not any(v.config.selected_layers[2] for v in handed)
    assert {v.config.map_inputs["residual"].layer for v in handed} == {0, 1}
    # Room for one whole residual layer: both, the residual features through fewer directions, as many as fit.
    (line,), handed = _budget_fit(pair, monkeypatch, per_layer[False])
    directions = _widest_by_hand(per_layer[False], 2)
    assert residual_stats.MIN_DIRECTIONS_PER_POSITION <= directions < 64
    assert line.startswith("residual-input statistics for residual layers [0, 1]")
    assert f"through {2 * directions} of their 128 dimensions" in line and "--max-statistics-memory raises it" in line
    assert handed and not any(v.config.selected_layers[2] for v in handed)
    assert {v.config.map_inputs["residual"].layer for v in handed} == {0, 1}
    assert all(v.residual.down.shape[1] == len(LAGS) * 64 and v.residual.down.shape[0] <= len(LAGS) * directions
               for v in handed)  # fmt: skip
    too_few = residual_stats.residual_statistics_nbytes(*_layouts(pair), 64, len(LAGS), 2, False,
                                                        residual_stats.MIN_DIRECTIONS_PER_POSITION)  # fmt: skip
    (line,), handed = _budget_fit(pair, monkeypatch, too_few - 1)
    assert line.startswith("residual-input maps: not tried") and "--max-statistics-memory raises it" in line
    assert handed == []


def _layouts(pair):
    from hf_kvtransfer.core.stats import KVLayout

    source, target = pair[0], pair[1]
    return KVLayout.from_config(source.config), KVLayout.from_config(target.config)


def _widest_by_hand(budget: int, layers: int) -> int:
    """The most directions per position whose sums (2 lags, the tiny target's 96 outputs, both kinds, float64, and
    the [2 x directions, 2 x 64] projection) for `layers` residual layers fit in `budget`, by counting up."""
    def nbytes(r):
        f = len(LAGS) * r
        return layers * (16 * (f * f + f * 96 + f + 192) + 8 * f * len(LAGS) * 64)

    return max(r for r in range(64) if nbytes(r) <= budget)


def _fit_logs(pair, **keywords) -> list[str]:
    source, target, ids, _, _ = pair
    logs = []
    fit_mapper(source, target, ids, top_k=2, heldout_fraction=0, progress=False, stride=1, residual_lags=LAGS,
               log=logs.append, **keywords)  # fmt: skip
    return logs


def test_a_given_statistics_budget_is_one_total_for_both_kinds_of_sums(pair):
    """`max_statistics_memory` bounds the K/V sums and the residual sums together (both on the CPU here): the residual
    sums get what the K/V sums leave. Sizes counted by hand: the K/V sums 2 x (64^2 + 64 x 96 + 64 + 2 x 96) float64
    (2 source layers x 2 heads x 16 against 3 x 2 x 16), one residual layer without the source's K/V as in
    `test_the_fit_keeps_to_the_residual_features_where_the_source_would_cost_residual_layers`."""
    kv = 16 * (64**2 + 64 * 96 + 64 + 2 * 96)
    alone = 16 * (128**2 + 128 * 96 + 128 + 192)
    logs = _fit_logs(pair, max_statistics_memory=(kv + alone) / 2**30)  # one whole layer's room: both, compressed
    line = next(line for line in logs if line.startswith("residual-input"))
    assert line.startswith("residual-input statistics for residual layers [0, 1]") and "residual features alone" in line
    assert f"through {2 * _widest_by_hand(alone, 2)} of their 128 dimensions" in line, line
    assert f"what the K/V sums' {kv / 2**20:,.1f} MiB leave of --max-statistics-memory" in line, line
    assert any(line.startswith("statistics: ") and "on cpu" in line for line in logs)  # the K/V sums in full, on CPU
    too_few = residual_stats.residual_statistics_nbytes(*_layouts(pair), 64, len(LAGS), 2, False,
                                                        residual_stats.MIN_DIRECTIONS_PER_POSITION)  # fmt: skip
    logs = _fit_logs(pair, max_statistics_memory=(kv + too_few - 1) / 2**30)  # the fewest directions' room, less a byte
    line = next(line for line in logs if line.startswith("residual-input"))
    assert line.startswith("residual-input maps: not tried"), line


# -- the residual features through fewer directions (a wide target's sums for every candidate layer) ------------------

DIRECTIONS = 8  # directions per position: 2 x 8 of the 2 x 64 residual features


@pytest.fixture(scope="module")
def with_directions(pair):
    source, target, ids, _, _ = pair
    stats = ResidualStatistics.for_models(source, target, layers=[0, 1], lags=LAGS, stride=1, source_features=False,
                                          directions=DIRECTIONS)  # fmt: skip
    calibration_pass(source, target, ids, consumers=[stats], progress=False, batch_size=len(ids))
    return stats


def test_the_sums_directions_are_what_a_ridge_on_the_residual_predicts_of_the_deeper_layers(pair, with_directions):
    """The 2 x 8 directions the sums of residual layer 1 hold (the one batch's: every token here) span the leading
    directions of reduced-rank regression computed by hand in the features' own space (numpy): the ridge (penalty
    0.01 on the standardised features' correlation) of target layer 2's keys (before the key norm) and values, each
    block scaled to unit total variance, then its coefficients along the leading right singular vectors of its fitted
    values; with the sums' size as `residual_statistics_nbytes` counts it."""
    source, target, ids, _, _ = pair
    stats = with_directions
    held = sum(t.nbytes for sums in stats.sums.values() for t in sums.values()) + sum(b.nbytes for b in stats.basis.values())
    assert held == residual_stats.residual_statistics_nbytes(stats.source_layout, stats.target_layout, 64, len(LAGS), 2,
                                                             source_features=False, directions=DIRECTIONS)  # fmt: skip
    blocks = []
    for kind in ("key", "value"):
        x, y, fs = _features_by_hand(source, target, ids, layer=1, kind=kind)
        y = y - y.mean(0)
        blocks.append(y / np.sqrt((y**2).sum() / len(y)))
    res = x[:, fs:]
    std = res.std(0)
    xs, y = (res - res.mean(0)) / std, np.concatenate(blocks, axis=1)
    assert len(xs) > xs.shape[1]  # more tokens than features: the feature space's closed form is the small one
    coef = np.linalg.solve(xs.T @ xs / len(xs) + 0.01 * np.eye(xs.shape[1]), xs.T @ y / len(xs))
    lead = np.linalg.svd(xs @ coef, full_matrices=False)[2][: len(LAGS) * DIRECTIONS].T
    want = np.linalg.qr(coef @ lead)[0]
    got = stats.basis[1].T.numpy() * std[:, None]  # back to the standardised features: orthonormal columns
    np.testing.assert_allclose(got.T @ got, np.eye(len(LAGS) * DIRECTIONS), atol=1e-8)
    np.testing.assert_allclose(got @ got.T, want @ want.T, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_maps_through_as_many_directions_as_the_outputs_rank_keep_the_whole_ridge(seed):
    """Where the outputs are a linear function of rank r of the features (plus noise), the ridge through the r
    directions predicts what the ridge on every feature predicts: they keep its predictive subspace. The r directions
    of the standardised features' largest covariance with the outputs (partial least squares, by hand) would not,
    where the predictive features are rotated among features that vary more."""
    gen = torch.Generator().manual_seed(seed)
    n, features, outputs, rank = 600, 40, 30, 4
    scales = torch.cat([torch.full((rank,), 1.0), torch.full((features - rank,), 3.0)]).double()
    latent = torch.randn(n, features, generator=gen, dtype=torch.float64) * scales
    x = latent @ torch.linalg.qr(torch.randn(features, features, generator=gen, dtype=torch.float64))[0]
    y = latent[:, :rank] @ torch.randn(rank, outputs, generator=gen, dtype=torch.float64)
    y = y + 0.05 * torch.randn(n, outputs, generator=gen, dtype=torch.float64)
    y = y - y.mean(0)
    y = y / y.pow(2).sum().div(n).sqrt()

    def fitted(z):
        zs = (z - z.mean(0)) / z.std(0, unbiased=False)
        return zs @ torch.linalg.solve(zs.T @ zs / n + 0.01 * torch.eye(z.shape[1], dtype=z.dtype), zs.T @ y / n)

    whole = fitted(x)
    lost = lambda z: float((whole - fitted(z)).pow(2).sum() / whole.pow(2).sum())  # noqa: E731
    assert lost(x @ residual_stats._predictive_directions(x, y @ y.T, rank, 0.01).T) < 0.02
    std = x.std(0, unbiased=False)
    covariance = torch.linalg.svd(((x - x.mean(0)) / std).T @ y, full_matrices=False)[0][:, :rank] / std[:, None]
    assert lost(x @ covariance) > 0.3


@pytest.mark.parametrize("kind", ["key", "value"])
def test_maps_through_the_directions_solve_as_a_ridge_on_the_projected_residual(pair, with_directions, kind):
    """Solved from those sums, the map the mapper applies (its per-layer weights after the shared projection) is a
    ridge on the residual block projected by hand onto the sums' directions."""
    source, target, ids, base, _ = pair
    stats = with_directions
    mapper = solve_residual_mapper(base, stats, residual_layer=1, sources={2: []}, residual_lambda=0.01)
    x, y, fs = _features_by_hand(source, target, ids, layer=1, kind=kind)
    directions = stats.basis[1].numpy()
    z = x[:, fs:] @ directions.T
    mu, sd = z.mean(0), z.std(0)
    zs = (z - mu) / sd
    w = np.linalg.solve(zs.T @ zs / len(zs) + 0.01 * np.eye(zs.shape[1]), zs.T @ (y - y.mean(0)) / len(zs)) / sd[:, None]
    applied = (mapper.residual.weight(kind, 2).double() @ mapper.residual.down.double()).detach().numpy()  # [out, 128]
    np.testing.assert_allclose(applied, w.T @ directions, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(getattr(mapper.layers[2], kind).bias.detach().double().numpy(), y.mean(0) - mu @ w,
                               rtol=1e-3, atol=1e-4)  # fmt: skip
    assert mapper.config.map_inputs["residual"].rank == len(LAGS) * DIRECTIONS


def test_the_residual_directions_resume_from_a_checkpoint(pair, with_directions):
    """A checkpoint holds each layer's directions with the sums (they were fixed by the pass's first batch), and the
    run key names their count; sums without the directions are refused."""
    source, target, _, _, _ = pair
    tensors, meta = with_directions.checkpoint_state()
    fresh = ResidualStatistics.for_models(source, target, layers=[0, 1], lags=LAGS, stride=1, source_features=False,
                                          directions=DIRECTIONS)  # fmt: skip
    assert fresh.run_key()["residual"]["directions"] == DIRECTIONS
    fresh.load_checkpoint_state(tensors, meta, "here")
    for j in (0, 1):
        assert torch.equal(fresh.basis[j], with_directions.basis[j])
        assert torch.equal(fresh.sums[(j, "key")]["cross"], with_directions.sums[(j, "key")]["cross"])
    with pytest.raises(ValueError, match="1.basis missing"):
        fresh.load_checkpoint_state({k: v for k, v in tensors.items() if k != "1.basis"}, meta, "here")


def test_a_fit_with_residual_directions_hands_mappers_that_save_and_serve(pair, monkeypatch, tmp_path):
    """Every mapper such a fit's search is handed, saved and loaded again, gives the same cache as before saving, and
    `generate` runs on it."""
    source, target, ids, _, _ = pair
    per_layer = 16 * (128**2 + 128 * 96 + 128 + 192)  # one whole residual layer's room: both through directions
    (line,), handed = _budget_fit(pair, monkeypatch, per_layer)
    assert "dimensions (those that carry most of what a ridge" in line and len(handed) >= 2
    prompt = ids[:1, :24]
    for i, mapper in enumerate(handed):
        mapper.save_pretrained(tmp_path / str(i))
        loaded = KVMapper.from_pretrained(tmp_path / str(i))
        caches = []
        for m in (mapper, loaded):
            cache = TransferredCache(prefill(source, prompt), m, model=target, input_ids=prompt)
            target(prompt[:, -cache.num_recompute_tokens :], cache=cache)
            caches.append(cache)
        for a, b in zip(caches[0].layers, caches[1].layers):
            torch.testing.assert_close(a.keys, b.keys)
            torch.testing.assert_close(a.values, b.values)
    cache = TransferredCache(prefill(source, prompt), loaded, model=target)
    out = target.generate(prompt, cache=cache, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 28)


@pytest.mark.parametrize("seed", range(30))
def test_the_statistics_choice_covers_every_layer_within_the_budget(seed):
    """Over random layouts and budgets: where the whole sums cannot cover every candidate layer, the choice takes
    every one through the most directions directions that fit the budget (one more would not), never fewer than
    `MIN_DIRECTIONS_PER_POSITION`; otherwise the whole features of as many of the shallowest layers as fit, as before."""
    from hf_kvtransfer.core.stats import KVLayout

    rng = np.random.default_rng(seed)
    layers_t, hidden = int(rng.integers(3, 40)), int(rng.choice([64, 256, 1024, 4096]))
    source = KVLayout(int(rng.integers(2, 30)), int(rng.choice([2, 8])), 128)
    target = KVLayout(layers_t, int(rng.choice([2, 8])), 128)
    budget = int(2 ** rng.uniform(20, 36))
    choice = residual_stats.residual_statistics_choice(source, target, hidden, 3, budget)
    candidates = residual_stats.residual_candidates(layers_t)
    nbytes = lambda r, n=len(candidates): residual_stats.residual_statistics_nbytes(source, target, hidden, 3, n, False, r)  # noqa: E731
    if choice.directions is None:
        whole = budget // choice.per_layer[choice.source_features]
        assert list(choice.layers) == candidates[: min(len(candidates), whole)]
        assert len(choice.layers) == len(candidates) or nbytes(residual_stats.MIN_DIRECTIONS_PER_POSITION) > budget
    else:
        assert list(choice.layers) == candidates and not choice.source_features
        assert residual_stats.MIN_DIRECTIONS_PER_POSITION <= choice.directions < hidden
        assert choice.nbytes == nbytes(choice.directions) <= budget < nbytes(choice.directions + 1)
        assert budget < len(candidates) * choice.per_layer[False]  # the whole features would not have covered them
