"""Maps that read the target's residual stream (`core/residual.py`, `fitting/residual_stats.py`): the closed-form solve
against a direct least-squares solve on features built without the library's hooks, the cache's keys and values
against the same map written out, checkpoints, and the refusals when the residual cannot be computed."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import random_ids, tiny_model
from rope_reference import apply_rope
from hf_kvtransfer import KVMapper, TransferredCache, fit_mapper, prefill
from hf_kvtransfer.core.capture import capture_kv
from hf_kvtransfer.core.residual import RESIDUAL_EPS, residual_features, residual_input_features
from hf_kvtransfer.core.rope import rotary_cos_sin
from hf_kvtransfer.fitting import exact_layers
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
    assert (c.residual_layer, c.residual_lags, c.key_before_norm, c.num_exact_layers) == (1, list(LAGS), True, 2)
    assert residual_input_features(c) == [0, 0, len(LAGS) * 64]


def test_cache_applies_the_map_and_the_targets_key_norm(pair):
    source, target, _, base, stats = pair
    mapper = solve_residual_mapper(base, stats, residual_layer=1)
    ids = random_ids(1, 24, seed=9)
    held = ids.shape[1] - 1
    cache = TransferredCache(prefill(source, ids), mapper, num_recompute_tokens=1)
    with torch.no_grad():
        target(ids[:, held:], cache=cache)
    # Written out: source K/V (stripped) and the target's own residual entering layer 1, map, k_norm, RoPE.
    keys, values = capture_kv(source, ids[:, :held])
    with torch.no_grad():
        h = target(ids[:, :held], output_hidden_states=True).hidden_states[1]
    r = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + RESIDUAL_EPS)
    res = torch.cat([r, torch.cat([torch.zeros_like(r[:, :1]), r[:, :-1]], 1)], -1)
    attn = target.model.layers[2].self_attn
    positions = torch.arange(held).unsqueeze(0)
    cos, sin = rotary_cos_sin(target.model.rotary_emb, positions, torch.device("cpu"))
    for kind, states in (("key", keys), ("value", values)):
        x = torch.cat([s.permute(0, 2, 1, 3).flatten(2) for s in states], -1)
        linear = getattr(mapper.layers[2], kind)
        y = x @ linear.weight.T + linear.bias + res @ mapper.residual.weight(kind, 2).T
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
    assert plain.residual is None and not plain.needs_target_residual
    assert not any(k.startswith("residual") for k in plain.state_dict())
    ids = random_ids(1, 20, seed=2)
    outs = []
    for m in (loaded, mapper):
        with torch.no_grad():
            out = target(ids[:, -1:], cache=TransferredCache(prefill(source, ids), m, num_recompute_tokens=1)).logits
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


def test_refusals_say_why(pair):
    source, target, _, base, stats = pair
    mapper = solve_residual_mapper(base, stats, residual_layer=1)
    ids = random_ids(1, 20, seed=3)
    src_cache = prefill(source, ids)
    with pytest.raises(ValueError, match="num_exact_layers must be >= 2"):
        TransferredCache(src_cache, mapper, num_exact_layers=1)
    with pytest.raises(ValueError, match="residual"):
        TransferredCache(src_cache, mapper, num_recompute_tokens=1).convert_all()
    legacy = tuple((layer.keys, layer.values) for layer in src_cache.layers)  # no prompt ids
    with pytest.raises(ValueError, match="residual stream.*input_ids="):
        with torch.no_grad():
            target(ids[:, -1:], cache=TransferredCache(legacy, mapper, num_recompute_tokens=1))
    with pytest.raises(ValueError, match="TransferredCache"):
        mapper(2, torch.zeros(1, 4, 64), torch.zeros(1, 4, 64))
    # generate knows the prompt (its input ids): a legacy cache works there.
    out = target.generate(ids, cache=TransferredCache(legacy, mapper), max_new_tokens=2, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 2)
    with pytest.raises(ValueError, match="residual_layer must be in"):
        replace(mapper.config, residual_layer=2)
    with pytest.raises(ValueError, match="residual_lags"):
        replace(mapper.config, residual_lags=[0, 0])
    with pytest.raises(ValueError, match="num_exact_layers >= 2"):
        replace(mapper.config, num_exact_layers=1)
    with pytest.raises(ValueError, match="need residual_layer"):
        replace(base.config, key_before_norm=True)


def test_residual_features_lags_and_padding():
    h = torch.randn(2, 5, 3)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    f = residual_features(h, [0, 2], mask)
    r = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + RESIDUAL_EPS) * mask.unsqueeze(-1)
    torch.testing.assert_close(f[..., :3], r)
    torch.testing.assert_close(f[:, 2:, 3:], r[:, :3])
    assert torch.all(f[:, :2, 3:] == 0) and torch.all(f[0, 2:4, 3:] == 0)  # before the row's first real token


def test_search_keeps_the_fastest_candidate_reaching_the_retention(pair, monkeypatch):
    source, target, _, base, stats = pair
    residual = {j: solve_residual_mapper(base, stats, residual_layer=j) for j in (0, 1)}
    fake_tried = [{"num_exact_layers": 1, "retention": 0.1, "retention_ci": [0, 0.2]},
                  {"num_exact_layers": 2, "retention": 0.97, "retention_ci": [0.9, 1.0]}]  # fmt: skip

    def fake_probe(*args, **kwargs):
        return 2, {"tried": [dict(r) for r in fake_tried], "prefix_len": 64, "copy_gain": {"mean": 5.0, "ci": [4, 6]},
                   "reason": "the fewest"}  # fmt: skip

    retention = {1: 0.96, 2: 0.99}  # residual candidates by exact layers
    monkeypatch.setattr(exact_layers, "choose_num_exact_layers", fake_probe)
    monkeypatch.setattr(exact_layers, "repeated_span_retention",
                        lambda s, t, m, items, num_exact_layers, **kw: {"retention": retention[num_exact_layers],
                                                                       "retention_ci": [0.9, 1.0]})  # fmt: skip
    times = {(False, 1): 10.0, (False, 2): 30.0, (True, 1): 20.0, (True, 2): 25.0}
    monkeypatch.setattr(exact_layers, "_time_candidate", lambda s, t, m, ids, n: {
        "transfer_ms": times[(m.needs_target_residual, n)], "target_prefill_ms": 100.0,
        "speedup": 100.0 / times[(m.needs_target_residual, n)]})  # fmt: skip
    stream = random_ids(1, 600, seed=1)[0].tolist()
    chosen, report = exact_layers.choose_configuration(source, target, base, stream, residual_mappers=residual,
                                                      min_retention=0.95)  # fmt: skip
    # Source-only with 1 exact layer is fastest but loses the content; of the rest, residual J=0 (1 exact) is fastest.
    assert chosen.config.residual_layer == 0 and chosen.config.num_exact_layers == 1
    assert [r["chosen"] for r in report["candidates"]] == [False, False, True, False]
    assert report["chosen"] == 1 and "residual" in report["chosen_inputs"]
    retention.update({1: 0.5, 2: 0.5})
    chosen, report = exact_layers.choose_configuration(source, target, base, stream, residual_mappers=residual,
                                                      min_retention=0.95)  # fmt: skip
    assert not chosen.needs_target_residual and chosen.config.num_exact_layers == 2


def test_only_the_readers_read_the_residual(pair):
    source, target, _, base, stats = pair
    mapper = solve_residual_mapper(base, stats, residual_layer=0, readers=[2])
    assert residual_input_features(mapper.config) == [0, 0, len(LAGS) * 64]
    assert sorted(mapper.residual.key.keys()) == ["2"]
    # Layer 1 keeps the source-only map: the cache's keys there are the source-only mapper's.
    ids = random_ids(1, 20, seed=4)
    caches = []
    for m in (mapper, base):
        cache = TransferredCache(prefill(source, ids), m, num_recompute_tokens=1, num_exact_layers=1)
        with torch.no_grad():
            target(ids[:, -1:], cache=cache)
        caches.append(cache)
    torch.testing.assert_close(caches[0].layers[1].keys, caches[1].layers[1].keys)
    assert not torch.allclose(caches[0].layers[2].keys, caches[1].layers[2].keys)
    with pytest.raises(ValueError, match="residual_readers"):
        replace(mapper.config, residual_readers=[0])


def test_fit_config_residual_fields():
    from hf_kvtransfer import FitConfig

    config = FitConfig(residual_lags="0,2", residual_rank=16)
    assert config.residual_lags == (0, 2) and config.residual_rank == 16 and config.exact_layers_retention == 0.95
    assert config.residual_inputs == "off"  # opt-in until the probe scores recall too (research/content_at_speed)
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
             "retention": 0.97, "retention_ci": [0.95, 0.99], "transfer_ms": 20.0, "target_prefill_ms": 50.0,
             "speedup": 2.5, "chosen": True}]  # fmt: skip
    report = {"exact_layers": {"candidates": rows, "tried": [], "timing": {"num_tokens": 512, "threads": 1}}}
    card = str(render_model_card(mapper.config.to_dict(), report=report))
    assert "What this mapper keeps at what speed" in card and "512 prompt tokens, 1 thread" in card
    assert "| source K/V + target residual entering layer 1 (t, t-1) | 2 | 97.0% [95.0, 99.0] | 20.0 / 50.0 | 2.50x | yes |" in card


def test_fit_with_residual_inputs_runs_the_statistics_in_the_same_pass(pair):
    source, target, ids, _, _ = pair
    logs = []
    mapper = fit_mapper(source, target, ids, top_k=2, residual_inputs="auto", heldout_fraction=0, progress=False,
                        log=logs.append)  # fmt: skip
    assert any("residual-input statistics for residual layers [0]" in line for line in logs), logs
    # Too few tokens for the probe here (6 x 40): it keeps the source-only default.
    assert not mapper.needs_target_residual and "default 1 kept" in mapper.report["exact_layers"]["reason"]
