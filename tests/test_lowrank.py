"""Reduced-rank ridge mappers against closed-form references on materialised features."""

import numpy as np
import pytest
import torch

from conftest import random_ids, tiny_model
from hf_kvtransfer import KVMapper, TransferredCache, capture_kv, collect_statistics, prefill, solve_mapper
from hf_kvtransfer.core.lowrank import allocate_ranks, rank_for_energy, reduce_mapper_rank
from hf_kvtransfer.core.stats import flatten_layers, token_selection

LAM = 0.3
SRC_DIM, TGT_DIM = 2 * 16, 2 * 8  # per-layer feature dims of the pair below


@pytest.fixture(scope="module")
def pair_stats():
    source = tiny_model("qwen3", num_hidden_layers=3, seed=1)
    target = tiny_model("qwen3", num_hidden_layers=2, seed=2, head_dim=8)
    ids = random_ids(6, 48, seed=4)
    stats = collect_statistics(source, target, ids, stride=2, progress=False)
    sk, sv = capture_kv(source, ids)
    tk, tv = capture_kv(target, ids)
    index = token_selection(ids.shape[0], ids.shape[1], 2, None, ids.device)
    feats = {
        "key": (flatten_layers(sk, index).double().numpy(), flatten_layers(tk, index).double().numpy()),
        "value": (flatten_layers(sv, index).double().numpy(), flatten_layers(tv, index).double().numpy()),
    }
    return source, target, stats, feats


def _layer_data(feats, kind, selected, t):
    x, y = feats[kind]
    xs = np.concatenate([x[:, s * SRC_DIM : (s + 1) * SRC_DIM] for s in selected], axis=1)
    return xs, y[:, t * TGT_DIM : (t + 1) * TGT_DIM]


def _dense(proj):
    """(weight [F_out, F_in], bias) of a full-rank or factored projection, float64 numpy."""
    if hasattr(proj, "down"):
        return (proj.up.weight.double() @ proj.down.weight.double()).detach().numpy(), proj.up.bias.double().detach().numpy()
    return proj.weight.double().detach().numpy(), proj.bias.double().detach().numpy()


def _reference_rrr(xs, yt, lam, r):
    """Reduced-rank ridge by the textbook route: ridge = least squares on rows [Xc; sqrt(lam) I], then project
    the coefficients on the top-r right singular vectors of the augmented fitted values."""
    mx, my = xs.mean(0), yt.mean(0)
    xa = np.concatenate([xs - mx, np.sqrt(lam) * np.eye(xs.shape[1])])
    ya = np.concatenate([yt - my, np.zeros((xs.shape[1], yt.shape[1]))])
    b = np.linalg.lstsq(xa, ya, rcond=None)[0]  # (F_in, F_out)
    _, _, vt = np.linalg.svd(xa @ b, full_matrices=False)
    b_r = b @ vt[:r].T @ vt[:r]
    return b_r.T, my - mx @ b_r  # weight (F_out, F_in), bias


def _sse(xs, yt, weight, bias):
    return float(((yt - xs @ weight.T - bias) ** 2).sum())


@pytest.mark.parametrize("kind", ["key", "value"])
@pytest.mark.parametrize("rank", [1, 3, 7])
def test_rank_r_equals_reduced_rank_regression_reference(pair_stats, kind, rank):
    _, _, stats, feats = pair_stats
    mapper = solve_mapper(stats, top_k=2, ridge_lambda=LAM, rank=rank, dtype=torch.float64)
    assert mapper.config.rank == [[rank, rank]] * 2
    for t, selected in enumerate(mapper.config.selected_layers):
        xs, yt = _layer_data(feats, kind, selected, t)
        w_ref, b_ref = _reference_rrr(xs, yt, LAM, rank)
        weight, bias = _dense(getattr(mapper.layers[t], kind))
        np.testing.assert_allclose(weight, w_ref, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(bias, b_ref, rtol=1e-5, atol=1e-7)
        assert np.linalg.matrix_rank(weight, tol=1e-8 * np.abs(weight).max()) == rank
        # Optimality in the fitted-value metric: better than truncating the ridge weights' own SVD.
        full = solve_mapper(stats, top_k=2, ridge_lambda=LAM, dtype=torch.float64)
        w_full, _ = _dense(getattr(full.layers[t], kind))
        u, s, vt = np.linalg.svd(w_full)
        naive = (u[:, :rank] * s[:rank]) @ vt[:rank]
        naive_bias = yt.mean(0) - xs.mean(0) @ naive.T
        assert _sse(xs, yt, weight, bias) <= _sse(xs, yt, naive, naive_bias) + 1e-9


def test_error_non_increasing_in_rank_and_full_rank_is_ridge(pair_stats):
    _, _, stats, feats = pair_stats
    full = solve_mapper(stats, top_k=2, ridge_lambda=LAM, dtype=torch.float64)
    for kind in ("key", "value"):
        for t, selected in enumerate(full.config.selected_layers):
            xs, yt = _layer_data(feats, kind, selected, t)
            errors, r2s = [], []
            for rank in range(1, TGT_DIM + 1):
                low = solve_mapper(stats, top_k=2, ridge_lambda=LAM, rank=rank, dtype=torch.float64)
                errors.append(_sse(xs, yt, *_dense(getattr(low.layers[t], kind))))
                r2s.append(getattr(low.config, f"fit_r2_{kind}")[t])
            assert all(a >= b - 1e-9 * a for a, b in zip(errors, errors[1:])), errors
            assert all(a <= b + 1e-12 for a, b in zip(r2s, r2s[1:])), r2s
            # Full rank: exactly the ridge solution (weights, bias and recorded R^2).
            w_full, b_full = _dense(getattr(full.layers[t], kind))
            w_low, b_low = _dense(getattr(low.layers[t], kind))
            np.testing.assert_allclose(w_low, w_full, rtol=1e-6, atol=1e-9)
            np.testing.assert_allclose(b_low, b_full, rtol=1e-6, atol=1e-9)
            assert abs(r2s[-1] - getattr(full.config, f"fit_r2_{kind}")[t]) < 1e-9
            # The recorded R^2 is the one on the data (per target head, averaged).
            w, b = _dense(getattr(low.layers[t], kind))
            resid = (yt - xs @ w.T - b).reshape(len(yt), 2, -1)
            centered = (yt - yt.mean(0)).reshape(len(yt), 2, -1)
            r2 = np.mean(1 - (resid**2).sum((0, 2)) / (centered**2).sum((0, 2)))
            assert abs(r2 - r2s[-1]) < 1e-8


def test_energy_and_budget_choose_ranks(pair_stats):
    _, _, stats, feats = pair_stats
    assert solve_mapper(stats, top_k=2, ridge_lambda=LAM, energy=1.0).config.rank == [[TGT_DIM, TGT_DIM]] * 2
    low = solve_mapper(stats, top_k=2, ridge_lambda=LAM, energy=0.9, dtype=torch.float64)
    full = solve_mapper(stats, top_k=2, ridge_lambda=LAM, dtype=torch.float64)
    for t, selected in enumerate(full.config.selected_layers):
        for i, kind in enumerate(("key", "value")):
            xs, yt = _layer_data(feats, kind, selected, t)
            w, _ = _dense(getattr(full.layers[t], kind))
            xa = np.concatenate([xs - xs.mean(0), np.sqrt(LAM) * np.eye(xs.shape[1])])
            s = np.linalg.svd(xa @ w.T, compute_uv=False) ** 2
            expected = int(np.searchsorted(np.cumsum(s) / s.sum(), 0.9 - 1e-12) + 1)
            assert low.config.rank[t][i] == expected
    budget = solve_mapper(stats, top_k=2, ridge_lambda=LAM, size_budget=0.25)
    full_weights = 2 * 2 * (2 * SRC_DIM) * TGT_DIM
    factor_params = sum(p.numel() for n, p in budget.named_parameters() if n.endswith("weight"))
    assert factor_params <= 0.25 * full_weights
    assert factor_params > 0.25 * full_weights - 2 * (2 * SRC_DIM + TGT_DIM)  # nothing left unspent that fits
    with pytest.raises(ValueError, match="exactly one of rank, energy or size_budget"):
        solve_mapper(stats, top_k=2, rank=2, energy=0.9)
    with pytest.raises(ValueError, match="cannot give every one"):
        solve_mapper(stats, top_k=2, size_budget=10)


def test_allocate_ranks_and_rank_for_energy_by_hand():
    gains = {"a": torch.tensor([5.0, 4.0, 0.1]), "b": torch.tensor([3.0, 2.0, 1.0])}
    costs = {"a": 10, "b": 10}
    assert allocate_ranks(gains, costs, budget=40) == {"a": 2, "b": 2}  # picks 4.0 then 2.0
    assert allocate_ranks(gains, costs, budget=50) == {"a": 2, "b": 3}  # then 1.0 before 0.1
    assert rank_for_energy(torch.tensor([6.0, 3.0, 1.0]), 0.9) == 2
    assert rank_for_energy(torch.tensor([6.0, 3.0, 1.0]), 0.91) == 3
    with pytest.raises(ValueError, match="energy must be in"):
        rank_for_energy(torch.tensor([1.0]), 0.0)


def test_save_load_strict_bf16_and_transfer(pair_stats, tmp_path):
    source, target, stats, _ = pair_stats
    low = solve_mapper(stats, top_k=2, ridge_lambda=LAM, rank=[[3, 5], [16, 1]])
    assert reduce_mapper_rank(solve_mapper(stats, top_k=2, ridge_lambda=LAM), stats, rank=[[3, 5], [16, 1]]).config.rank == low.config.rank
    low.save_pretrained(tmp_path / "m")
    loaded = KVMapper.from_pretrained(tmp_path / "m")
    assert loaded.config.rank == [[3, 5], [16, 1]]
    assert loaded.layers[0].key.down.weight.shape == (3, 2 * SRC_DIM)
    for a, b in zip(low.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)

    # The factored mapper through TransferredCache equals the same map applied densely (a full-rank mapper
    # holding W_r = up @ down), i.e. the factored forward computes what the factors say.
    dense = solve_mapper(stats, top_k=2, ridge_lambda=LAM)
    with torch.no_grad():
        for t in range(2):
            for kind in ("key", "value"):
                w, b = _dense(getattr(low.layers[t], kind))
                getattr(dense.layers[t], kind).weight.copy_(torch.from_numpy(w))
                getattr(dense.layers[t], kind).bias.copy_(torch.from_numpy(b))
    ids = random_ids(2, 20, seed=8)
    a = TransferredCache(prefill(source, ids), loaded, num_exact_layers=0).convert_all()
    b = TransferredCache(prefill(source, ids), dense, num_exact_layers=0).convert_all()
    for la, lb in zip(a.layers, b.layers):
        assert (la.keys - lb.keys).abs().max() < 1e-4 and (la.values - lb.values).abs().max() < 1e-4

    # bf16 storage: half the bytes, weights within bf16 rounding, loads as bf16.
    half = solve_mapper(stats, top_k=2, ridge_lambda=LAM, rank=[[3, 5], [16, 1]], dtype=torch.bfloat16)
    half.save_pretrained(tmp_path / "h")
    size = lambda d: (tmp_path / d / "model.safetensors").stat().st_size  # noqa: E731
    assert size("h") < 0.6 * size("m")
    reloaded = KVMapper.from_pretrained(tmp_path / "h")
    assert next(reloaded.parameters()).dtype == torch.bfloat16
    card = (tmp_path / "h" / "README.md").read_text()  # the card says what a downloader gets
    assert "**Reduced rank (key/value per target layer)**: 3/5, 16/1" in card
    assert f"**Weights**: bfloat16, {2 * half.num_parameters() / 2**20:.2f} MiB" in card
    for p16, p32 in zip(reloaded.parameters(), low.parameters()):
        assert torch.allclose(p16.float(), p32, rtol=1e-2, atol=1e-2 * p32.abs().max().item())

    # Strict loading: a config whose ranks disagree with the tensors is refused, with the tensor named.
    import json

    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["rank"] = [[4, 5], [16, 1]]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="layers.0.key.down.weight has shape"):
        KVMapper.from_pretrained(tmp_path / "m")
    cfg["rank"] = [[0, 5], [16, 1]]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mapper needs `rank`: one"):
        KVMapper.from_pretrained(tmp_path / "m")


def _heldout_r2_direct(xs, yt, weight, bias, num_heads):
    """Head-averaged R^2 of `xs @ W^T + b` on materialised held-out features (around the held-out mean)."""
    err = ((yt - xs @ weight.T - bias) ** 2).reshape(len(yt), num_heads, -1).sum((0, 2))
    tot = ((yt - yt.mean(0)) ** 2).reshape(len(yt), num_heads, -1).sum((0, 2))
    return float((1 - err / tot).mean())


@pytest.mark.parametrize("spec", [{"rank": 2}, {"energy": 0.9}])
def test_reduced_rank_mapper_reports_its_own_heldout_r2(pair_stats, spec):
    from hf_kvtransfer.fitting.fit import solve_mappers

    source, target, stats, _ = pair_stats
    ids = random_ids(4, 40, seed=11)  # other sequences than the fit's
    heldout = collect_statistics(source, target, ids, stride=1, progress=False)
    sk, sv = capture_kv(source, ids)
    tk, tv = capture_kv(target, ids)
    index = token_selection(ids.shape[0], ids.shape[1], 1, None, ids.device)
    feats = {
        "key": (flatten_layers(sk, index).double().numpy(), flatten_layers(tk, index).double().numpy()),
        "value": (flatten_layers(sv, index).double().numpy(), flatten_layers(tv, index).double().numpy()),
    }
    # refit=False: the weights are the fit-shard solution whose held-out score is recorded, so applying them to
    # the held-out features is an independent computation of the same number.
    common = dict(top_k=2, ridge_lambda=LAM, refit=False, dtype=torch.float64)
    low = next(iter(solve_mappers(stats, heldout, **common, **spec).values()))
    full = next(iter(solve_mappers(stats, heldout, **common).values()))
    assert low.config.rank is not None and full.config.rank is None
    num_heads = target.config.num_key_value_heads
    for kind in ("key", "value"):
        for mapper in (low, full):
            stored = getattr(mapper.config, f"heldout_r2_{kind}")
            for t, selected in enumerate(mapper.config.selected_layers):
                xs, yt = _layer_data(feats, kind, selected, t)
                direct = _heldout_r2_direct(xs, yt, *_dense(getattr(mapper.layers[t], kind)), num_heads)
                assert stored[t] == pytest.approx(direct, rel=1e-6, abs=1e-9), (kind, t, mapper.config.rank)
        # ... and it is not the full-rank number any more
        low_r2, full_r2 = getattr(low.config, f"heldout_r2_{kind}"), getattr(full.config, f"heldout_r2_{kind}")
        assert max(abs(a - b) for a, b in zip(low_r2, full_r2)) > 1e-3
