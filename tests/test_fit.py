"""Statistics, layer selection and the ridge solve, against closed-form references on materialised features."""

import numpy as np
import pytest
import torch

from conftest import random_ids, tiny_model
from hf_kvtransfer import (
    KVMapper,
    KVStatistics,
    TransferredCache,
    capture_kv,
    collect_statistics,
    fit_mapper,
    prefill,
    solve_mapper,
)
from hf_kvtransfer.fitting.accumulate import accumulate_statistics
from hf_kvtransfer.fitting.fit import solve_mappers
from hf_kvtransfer.core.ridge import select_layers, single_source_r2, solve_layer
from hf_kvtransfer.core.stats import BlockStatistics, flatten_layers, token_selection


def test_linear_pair_selection_r2_and_generation(linear_models):
    source, target, true_source_of = linear_models
    mapper = fit_mapper(source, target, random_ids(24, 64, seed=9), top_k=1, progress=False)
    for t, s in enumerate(true_source_of):
        if s is None:
            continue
        assert mapper.config.selected_layers[t] == [s], f"target layer {t} should read source layer {s}"
        assert mapper.config.fit_r2_key[t] > 0.999 and mapper.config.fit_r2_value[t] > 0.999
    # the inserted layers' KV is not a linear function of any source layer
    assert max(mapper.config.fit_r2_key[t] for t, s in enumerate(true_source_of) if s is None) < 0.95

    ids = random_ids(2, 24, seed=7)
    kw = dict(do_sample=False, max_new_tokens=12, min_new_tokens=12, return_dict_in_generate=True, output_logits=True)
    ref = target.generate(ids, **kw)
    out = target.generate(ids, cache=TransferredCache(prefill(source, ids), mapper, model=target), **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits)) < 2e-3


def test_linear_pair_topk_contains_true_layer(linear_models):
    source, target, true_source_of = linear_models
    stats = collect_statistics(source, target, random_ids(16, 64, seed=3), progress=False)
    scores = single_source_r2(stats)["mean"]
    selected = select_layers(scores, 2)
    for t, s in enumerate(true_source_of):
        if s is not None:
            assert s in selected[t]
            assert scores[s, t] > 0.999


def _materialise(source, target, ids, stride):
    sk, sv = capture_kv(source, ids)
    tk, tv = capture_kv(target, ids)
    index = token_selection(ids.shape[0], ids.shape[1], stride, None, ids.device)
    return {
        "key": (flatten_layers(sk, index).double().numpy(), flatten_layers(tk, index).double().numpy()),
        "value": (flatten_layers(sv, index).double().numpy(), flatten_layers(tv, index).double().numpy()),
    }


@pytest.fixture(scope="module")
def mismatched_pair():
    # Different depth, KV heads and head dim: the map must still be a plain least-squares problem.
    source = tiny_model("qwen3", num_hidden_layers=3, seed=1)
    target = tiny_model("qwen3", num_hidden_layers=2, seed=2, num_key_value_heads=1, head_dim=8, num_attention_heads=2)
    return source, target


@pytest.mark.parametrize("kind", ["key", "value"])
def test_ridge_matches_numpy_on_materialised_features(mismatched_pair, kind):
    source, target = mismatched_pair
    ids = random_ids(6, 40, seed=4)
    stats = collect_statistics(source, target, ids, stride=3, progress=False)
    x, y = _materialise(source, target, ids, stride=3)[kind]
    assert stats.count == x.shape[0]
    lam, selected, t = 0.5, [0, 2], 1
    ls, lt = 2 * 16, 1 * 8  # per-layer dims of source and target
    xs = np.concatenate([x[:, s * ls : (s + 1) * ls] for s in selected], axis=1)
    yt = y[:, t * lt : (t + 1) * lt]
    xc, yc = xs - xs.mean(0), yt - yt.mean(0)
    w_ref = np.linalg.solve(xc.T @ xc + lam * np.eye(xs.shape[1]), xc.T @ yc)
    b_ref = yt.mean(0) - xs.mean(0) @ w_ref
    weight, bias, r2 = solve_layer(stats, kind, t, selected, ridge_lambda=lam)
    np.testing.assert_allclose(weight.numpy().T, w_ref, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(bias.numpy(), b_ref, rtol=1e-6, atol=1e-8)
    resid = yt - (xs @ w_ref + b_ref)
    r2_ref = np.mean(1 - (resid**2).sum(0).reshape(1, -1).sum(-1) / (yc**2).sum(0).reshape(1, -1).sum(-1))
    assert abs(r2 - r2_ref) < 1e-8


def test_single_source_r2_matches_numpy(mismatched_pair):
    source, target = mismatched_pair
    ids = random_ids(4, 32, seed=5)
    stats = collect_statistics(source, target, ids, stride=2, progress=False)
    feats = _materialise(source, target, ids, stride=2)
    scores = single_source_r2(stats, ridge_lambda=0.1)
    for kind in ("key", "value"):
        x, y = feats[kind]
        for s in range(3):
            xs = x[:, s * 32 : (s + 1) * 32]
            xc = xs - xs.mean(0)
            for t in range(2):
                yc = y[:, t * 8 : (t + 1) * 8] - y[:, t * 8 : (t + 1) * 8].mean(0)
                w = np.linalg.solve(xc.T @ xc + 0.1 * np.eye(32), xc.T @ yc)
                r2 = 1 - ((yc - xc @ w) ** 2).sum() / (yc**2).sum()  # one target head
                assert abs(scores[kind][s, t].item() - r2) < 1e-8


def test_merged_shards_equal_one_pass_and_save_load(mismatched_pair, tmp_path):
    source, target = mismatched_pair
    ids = random_ids(8, 32, seed=6)
    whole = collect_statistics(source, target, ids, progress=False)
    a = collect_statistics(source, target, ids[:3], progress=False)
    b = collect_statistics(source, target, ids[3:], progress=False)
    b.save(tmp_path / "shard")
    merged = a + KVStatistics.load(tmp_path / "shard")
    assert merged.count == whole.count
    for name in whole.tensors:
        torch.testing.assert_close(merged.tensors[name], whole.tensors[name], rtol=1e-10, atol=1e-9)
    m1, m2 = solve_mapper(whole, top_k=2), solve_mapper(merged, top_k=2)
    assert m1.config.selected_layers == m2.config.selected_layers
    for (n1, p1), (n2, p2) in zip(m1.state_dict().items(), m2.state_dict().items()):
        torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-6)


def test_top_k_and_lambda_change_without_models(mismatched_pair):
    source, target = mismatched_pair
    stats = collect_statistics(source, target, random_ids(4, 32, seed=7), progress=False)
    m_all = solve_mapper(stats, top_k="all", ridge_lambda=1.0)
    assert all(sel == [0, 1, 2] for sel in m_all.config.selected_layers)
    assert m_all.layers[0].key.weight.shape == (8, 3 * 32)
    with pytest.raises(ValueError, match="top_k must be between 1"):
        solve_mapper(stats, top_k=4)


def test_padded_calibration_uses_only_real_tokens(mismatched_pair):
    source, target = mismatched_pair
    ids = random_ids(2, 24, seed=8)
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    padded = collect_statistics(source, target, ids, attention_mask=mask, stride=1, progress=False)
    assert padded.count == 24 + 14
    # the padded row's real tokens, prefilled alone at positions 0..13, give the same statistics
    row0 = collect_statistics(source, target, ids[:1], stride=1, progress=False)
    row1 = collect_statistics(source, target, ids[1:, 10:], stride=1, progress=False)
    torch.testing.assert_close(padded.tensors["key.gram"], (row0 + row1).tensors["key.gram"], rtol=1e-5, atol=1e-4)


def test_vocab_mismatch_is_refused():
    a = tiny_model("qwen3")
    b = tiny_model("qwen3", vocab_size=128)
    with pytest.raises(ValueError, match="vocabularies differ"):
        fit_mapper(a, b, random_ids(2, 16), progress=False)


def test_non_finite_states_are_refused(mismatched_pair):
    source, target = mismatched_pair
    stats = collect_statistics(source, target, random_ids(1, 16), progress=False)
    sk, sv = capture_kv(source, random_ids(1, 16))
    tk, tv = capture_kv(target, random_ids(1, 16))
    sk[1][0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite key states"):
        stats.update(sk, sv, tk, tv, stride=1)


@pytest.mark.parametrize("kind", ["key", "value"])
def test_heldout_r2_matches_numpy(mismatched_pair, kind):
    source, target = mismatched_pair
    ids = random_ids(8, 40, seed=11)
    lam = 0.5
    mapper = fit_mapper(
        source, target, ids, top_k=2, ridge_lambda=lam, stride=3, heldout_fraction=0.25, refit=False, progress=False
    )
    (x_fit, y_fit), (x_held, y_held) = (_materialise(source, target, part, stride=3)[kind] for part in (ids[:6], ids[6:]))
    ls, lt = 32, 8
    for t, selected in enumerate(mapper.config.selected_layers):
        cols = np.concatenate([np.arange(s * ls, (s + 1) * ls) for s in selected])
        xs, yt = x_fit[:, cols], y_fit[:, t * lt : (t + 1) * lt]
        xc, yc = xs - xs.mean(0), yt - yt.mean(0)
        w = np.linalg.solve(xc.T @ xc + lam * np.eye(xs.shape[1]), xc.T @ yc)
        b = yt.mean(0) - xs.mean(0) @ w
        proj = getattr(mapper.layers[t], kind)
        np.testing.assert_allclose(proj.weight.detach().double().numpy().T, w, rtol=1e-4, atol=1e-5)
        yh = y_held[:, t * lt : (t + 1) * lt]
        resid = yh - (x_held[:, cols] @ w + b)
        r2_ref = 1 - (resid**2).sum() / ((yh - yh.mean(0)) ** 2).sum()  # the target has one KV head
        assert abs(getattr(mapper.config, f"heldout_r2_{kind}")[t] - r2_ref) < 1e-8


def test_two_stage_blocks_equal_full_statistics(mismatched_pair, tmp_path):
    source, target = mismatched_pair
    ids = random_ids(8, 40, seed=12)
    kw = dict(stride=2, batch_size=3, num_heldout=2, progress=False)
    full, full_held = accumulate_statistics(source, target, ids, **kw)
    # a probe larger than the fit shard ranks on exactly the full statistics' tokens
    blocks, blocks_held = accumulate_statistics(source, target, ids, two_stage=True, probe_tokens=10**6, max_top_k=2, **kw)
    assert isinstance(blocks, BlockStatistics) and blocks.count == full.count and blocks_held.count == full_held.count
    torch.testing.assert_close(blocks.scores_at(0.01), single_source_r2(full)["mean"], rtol=1e-8, atol=1e-10)
    assert blocks.selections == select_layers(single_source_r2(full)["mean"], 2)
    assert blocks.nbytes() < full.nbytes()
    for k in (1, 2):
        (a,) = solve_mappers(full, full_held, top_k=k).values()
        (b,) = solve_mappers(blocks, blocks_held, top_k=k).values()
        assert a.config.selected_layers == b.config.selected_layers
        np.testing.assert_allclose(a.config.heldout_r2_key, b.config.heldout_r2_key, rtol=1e-7, atol=1e-9)
        for name, tensor in a.state_dict().items():
            torch.testing.assert_close(b.state_dict()[name], tensor, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="did not keep"):
        solve_mappers(blocks, blocks_held, top_k="all")
    blocks.save(tmp_path / "blocks")
    loaded = KVStatistics.load(tmp_path / "blocks")
    assert isinstance(loaded, BlockStatistics) and loaded.selections == blocks.selections
    for name, tensor in blocks.tensors.items():
        assert torch.equal(loaded.tensors[name], tensor)


@pytest.fixture(scope="module")
def lambda_sensitive_pair():
    # On this pair (and these tokens) the single-source ranking at lambda 100 differs from the one at 0.01, so a
    # two-stage fit that ranks at the wrong lambda selects other layers than the full statistics.
    source = tiny_model("qwen3", num_hidden_layers=3, seed=3)
    target = tiny_model("qwen3", num_hidden_layers=2, seed=2, num_key_value_heads=1, head_dim=8, num_attention_heads=2)
    return source, target, random_ids(8, 40, seed=12)


def test_two_stage_selects_as_the_full_statistics_at_every_lambda(lambda_sensitive_pair):
    source, target, ids = lambda_sensitive_pair
    kw = dict(stride=2, batch_size=3, num_heldout=2, progress=False)
    full, full_held = accumulate_statistics(source, target, ids, **kw)
    by_lambda = {lam: single_source_r2(full, lam)["mean"] for lam in (0.01, 100.0)}
    assert select_layers(by_lambda[0.01], 1) != select_layers(by_lambda[100.0], 1), "the test needs a lambda-sensitive ranking"
    # the probe covers every fit token: its rankings must be those of the full statistics, at each lambda
    blocks, blocks_held = accumulate_statistics(
        source, target, ids, two_stage=True, probe_tokens=10**6, max_top_k=2, ridge_lambdas=(0.01, 100.0), **kw
    )
    for lam, scores in by_lambda.items():
        torch.testing.assert_close(blocks.scores_at(lam), scores, rtol=1e-8, atol=1e-10)
        for k in (1, 2):
            # refit=False: both rank on the fit shard (a refit ranks the full statistics on fit + held-out tokens)
            (a,) = solve_mappers(full, full_held, top_k=k, ridge_lambda=lam, refit=False).values()
            (b,) = solve_mappers(blocks, blocks_held, top_k=k, ridge_lambda=lam, refit=False).values()
            assert a.config.selected_layers == b.config.selected_layers == select_layers(scores, k), (lam, k)
            np.testing.assert_allclose(a.config.heldout_r2_value, b.config.heldout_r2_value, rtol=1e-7, atol=1e-9)
            for name, tensor in a.state_dict().items():
                torch.testing.assert_close(b.state_dict()[name], tensor, rtol=1e-5, atol=1e-6)
    # a lambda the probe did not rank with is refused rather than ranked at another lambda
    with pytest.raises(ValueError, match="ranked layers at ridge_lambda"):
        solve_mappers(blocks, blocks_held, top_k=1, ridge_lambda=1.0)


def test_fit_mapper_two_stage_equals_full_at_the_fit_lambda(lambda_sensitive_pair):
    source, target, ids = lambda_sensitive_pair
    # 2 of 8 sequences held out and no refit: layers are ranked on the 6 fit sequences, where lambda matters
    kw = dict(top_k=1, stride=2, batch_size=3, heldout_fraction=0.25, refit=False, progress=False)
    selected = {}
    for lam in (0.01, 100.0):
        full = fit_mapper(source, target, ids, ridge_lambda=lam, two_stage=False, **kw)
        two_stage = fit_mapper(source, target, ids, ridge_lambda=lam, two_stage=True, probe_tokens=10**6, **kw)
        assert two_stage.config.selected_layers == full.config.selected_layers, lam
        for name, tensor in full.state_dict().items():
            torch.testing.assert_close(two_stage.state_dict()[name], tensor, rtol=1e-5, atol=1e-6)
        selected[lam] = full.config.selected_layers
    assert selected[0.01] != selected[100.0]


def test_two_stage_small_probe_finds_the_true_layers(linear_models):
    source, target, true_source_of = linear_models
    blocks, _ = accumulate_statistics(
        source, target, random_ids(12, 64, seed=9), batch_size=4, two_stage=True, probe_tokens=64, max_top_k=1,
        progress=False,
    )
    assert blocks.count == 12 * 64 // 4  # the probe's tokens count once: they enter the block sums too
    (mapper,) = solve_mappers(blocks, top_k=1).values()
    for t, s in enumerate(true_source_of):
        if s is not None:
            assert mapper.config.selected_layers[t] == [s]
            assert mapper.config.fit_r2_key[t] > 0.999 and mapper.config.fit_r2_value[t] > 0.999


def test_float32_products_with_chan_merge_stay_close_to_float64(mismatched_pair):
    source, target = mismatched_pair
    # an offset much larger than the spread: raw float32 sums of squares would lose the centered signal
    ids = random_ids(6, 40, seed=13)
    exact, _ = accumulate_statistics(source, target, ids, stride=1, batch_size=2, progress=False)
    fast, _ = accumulate_statistics(source, target, ids, stride=1, batch_size=2, progress=False, product_dtype=torch.float32)
    x, y = _materialise(source, target, ids, stride=1)["value"]
    x, y = x + 100.0, y - 50.0
    ref = KVStatistics(exact.source_layout, exact.target_layout)
    ref._add("value", torch.from_numpy(x), torch.from_numpy(y))
    shifted = KVStatistics(exact.source_layout, exact.target_layout)
    shifted.product_dtype = torch.float32
    shifted._add("value", torch.from_numpy(x).float(), torch.from_numpy(y).float())
    ref.count = shifted.count = x.shape[0]
    for a, b in ((exact, fast), (ref, shifted)):
        for kind in ("value",) if a is ref else ("key", "value"):
            ca, cb = a.centered(kind), b.centered(kind)
            for name in ("gram", "cross", "var_y"):
                scale = ca[name].abs().max().item()
                torch.testing.assert_close(cb[name], ca[name], rtol=0, atol=2e-6 * scale)


def test_fit_mapper_returns_one_mapper_and_points_to_fit_mappers_for_several(qwen3_model, calibration_ids):
    from hf_kvtransfer import fit_mappers

    with pytest.raises(ValueError, match=r"use fit_mappers\(\.\.\.\)"):
        fit_mapper(qwen3_model, qwen3_model, calibration_ids, top_k="1,all", progress=False, num_exact_layers=1)
    several = fit_mappers(qwen3_model, qwen3_model, calibration_ids, top_k="1,all", progress=False, num_exact_layers=1)
    one = fit_mapper(qwen3_model, qwen3_model, calibration_ids, top_k=1, progress=False, num_exact_layers=1)
    assert sorted(several) == ["k1", "kall"] and isinstance(one, KVMapper)
    for kind in ("key", "value"):  # the same pass and solve: the k=1 mapper is the same either way
        torch.testing.assert_close(several["k1"].layers[0].linear_parts(kind).up, one.layers[0].linear_parts(kind).up)


def test_accumulation_options_and_keywords(mismatched_pair):
    """`AccumulationOptions` carries the pass's options; a keyword overrides it (the count is the tokens read at the
    keyword's stride, counted independently), and an unknown option is a one-line TypeError naming it."""
    from hf_kvtransfer.fitting.accumulate import AccumulationOptions

    source, target = mismatched_pair
    ids = random_ids(3, 24, seed=14)
    options = AccumulationOptions(stride=2, batch_size=2, progress=False)
    stats, held = accumulate_statistics(source, target, ids, options=options, stride=1)
    x, _ = _materialise(source, target, ids, stride=1)["value"]
    assert stats.count == x.shape[0] and held is None
    strided, _ = accumulate_statistics(source, target, ids, None, stride=2, batch_size=2, progress=False)
    assert strided.count == _materialise(source, target, ids, stride=2)["value"][0].shape[0] < x.shape[0]
    with pytest.raises(TypeError, match="unknown option.*strid"):
        accumulate_statistics(source, target, ids, options, strid=1)
