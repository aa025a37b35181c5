"""The MLP mapper: it recovers a nonlinear KV relation ridge cannot, stays at ridge on a linear one, and is a
`KVMapper` to every caller (TransferredCache, save/load, Hub)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from conftest import linear_pair, random_ids
from hf_kvtransfer import KVMapper, TransferredCache, capture_kv, fit_mapper, fit_mlp_mapper, prefill
from hf_kvtransfer.fitting.mlp import MLPKindMap, MLPTraining, mlp_fit_nbytes, train_mlp_map

@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Thousands of tiny Adam steps: with several OpenMP threads on a busy 2-core machine each step waits on
    # spinning threads (~10x slower here). One thread is the fast setting for maps this small.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Small and fast, but big enough to learn a ReLU of a linear map of 16-dim heads.
FAST = dict(hidden_size=64, epochs=40, lr=3e-3, mlp_batch_size=128, stride=1, heldout_fraction=0.25, progress=False)


# -- features only: a synthetic nonlinear relation -----------------------------------------------------------


def _synthetic(n: int, nonlinear: bool, seed: int = 0):
    a = torch.randn(12, 8, generator=torch.Generator().manual_seed(1234)) / 12**0.5  # the same relation for all seeds
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 12, generator=g) * 2 + 1
    z = x @ a
    # elementwise nonlinear function of a linear map of x, plus noise
    y = (torch.relu(z) + 0.5 * torch.tanh(3 * z) if nonlinear else z) + 0.01 * torch.randn(n, 8, generator=g)
    return x, y


def _numpy_ridge_heldout_mse(x, y, xh, yh) -> float:
    # Independent reference: ordinary least squares with an intercept, held-out MSE.
    xa = np.c_[x.double().numpy(), np.ones(len(x))]
    coef, *_ = np.linalg.lstsq(xa, y.double().numpy(), rcond=None)
    pred = np.c_[xh.double().numpy(), np.ones(len(xh))] @ coef
    return float(((pred - yh.double().numpy()) ** 2).mean())


def _mse(module, x, y) -> float:
    with torch.no_grad():
        return float(((module(x).double() - y.double()) ** 2).mean())


@pytest.mark.parametrize("residual", [True, False])
def test_mlp_removes_most_of_ridge_error_on_nonlinear_features(residual):
    x, y = _synthetic(3000, nonlinear=True)
    xh, yh = _synthetic(1000, nonlinear=True, seed=1)
    training = MLPTraining(ridge_lambda=0.0, residual=residual, hidden_size=64, epochs=40, lr=3e-3, batch_size=128)
    module, report = train_mlp_map(x, y, xh, yh, num_kv_heads=2, training=training)
    ridge_mse = _numpy_ridge_heldout_mse(x, y, xh, yh)
    variance = float(yh.double().var(0, unbiased=False).mean())
    assert ridge_mse > 0.05 * variance, "the relation must leave ridge a clear error"
    assert report["ridge_mse"] == pytest.approx(ridge_mse, rel=1e-4)
    mlp_mse = _mse(module, xh, yh)
    assert report["mlp_mse"] == pytest.approx(mlp_mse, rel=1e-4)
    assert mlp_mse < 0.2 * ridge_mse, f"MLP held-out MSE {mlp_mse:.4g} vs ridge {ridge_mse:.4g}"


def test_residual_mlp_stays_at_ridge_on_linear_features():
    x, y = _synthetic(2000, nonlinear=False)
    xh, yh = _synthetic(500, nonlinear=False, seed=1)
    training = MLPTraining(ridge_lambda=0.0, hidden_size=64, epochs=10, lr=3e-3)
    module, report = train_mlp_map(x, y, xh, yh, num_kv_heads=2, training=training)
    ridge_mse = _numpy_ridge_heldout_mse(x, y, xh, yh)
    assert ridge_mse < 2e-4  # only the 0.01 noise is left
    assert _mse(module, xh, yh) <= ridge_mse * (1 + 1e-3)


def test_per_head_training_is_deterministic_and_folds_exactly():
    x, y = _synthetic(600, nonlinear=True)
    xh, yh = _synthetic(200, nonlinear=True, seed=1)
    training = MLPTraining(per_head=True, hidden_size=16, epochs=3, seed=3)
    a, report = train_mlp_map(x, y, xh, yh, num_kv_heads=2, training=training)
    b, _ = train_mlp_map(x, y, xh, yh, num_kv_heads=2, training=training)
    assert a.mlp[0].weight.shape == (2, 12, 16) and a.mlp[-1].weight.shape == (2, 16, 4)  # one MLP per head
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), f"{name} differs between two runs with the same seed"
    # The held-out error is that of the returned (folded) module on raw features.
    assert report["mlp_mse"] == pytest.approx(_mse(a, xh, yh), rel=1e-4)
    c, _ = train_mlp_map(x, y, xh, yh, num_kv_heads=2, training=dataclasses.replace(training, seed=4))
    assert not torch.equal(a.mlp[0].weight, c.mlp[0].weight)


# -- model pairs ---------------------------------------------------------------------------------------------


class _ReluProjection(torch.nn.Module):
    """`relu(v_proj(x))`: the layer stores an elementwise nonlinear function of a linear map of its input."""

    def __init__(self, proj: torch.nn.Module):
        super().__init__()
        self.proj = proj

    def forward(self, x):
        return torch.relu(self.proj(x))


@pytest.fixture(scope="module")
def nonlinear_pair():
    # The linear pair, with the target's last layer storing relu(A V) instead of A V: its values are a
    # nonlinear function of the source's; every other layer stays exactly linear (keys and earlier values).
    source, target, _ = linear_pair(num_source_layers=2, inserted_after=())
    last = target.model.layers[-1].self_attn
    last.v_proj = _ReluProjection(last.v_proj)
    ids = random_ids(48, 64, seed=5)
    mlp = fit_mlp_mapper(source, target, ids, top_k=1, **FAST)
    ridge = fit_mapper(source, target, ids, top_k=1, stride=1, progress=False)
    return source, target, mlp, ridge


def _mapped_r2(mapper, source, target, ids) -> dict[str, list[float]]:
    """Out-of-sample R^2 per target layer of the mapper's K and V against the target's own stripped KV."""
    sk, sv = capture_kv(source, ids)
    tk, tv = capture_kv(target, ids)
    out = {"key": [], "value": []}
    for t, selected in enumerate(mapper.config.selected_layers):
        feats = [torch.cat([s[i].transpose(1, 2).flatten(2) for i in selected], -1) for s in (sk, sv)]
        with torch.no_grad():
            keys, values = mapper(t, *feats)
        for kind, got, want in (("key", keys, tk[t]), ("value", values, tv[t])):
            sse = ((got.double() - want.double()) ** 2).sum()
            sst = ((want.double() - want.double().mean((0, 2), keepdim=True)) ** 2).sum()
            out[kind].append(float(1 - sse / sst))
    return out


def test_mlp_mapper_recovers_nonlinear_model_pair(nonlinear_pair):
    source, target, mlp, ridge = nonlinear_pair
    assert mlp.config.mapper_type == "mlp"
    ids = random_ids(8, 64, seed=99)  # fresh tokens, seen by neither fit
    r2_mlp, r2_ridge = _mapped_r2(mlp, source, target, ids), _mapped_r2(ridge, source, target, ids)
    assert r2_ridge["value"][-1] < 0.85, "ridge must leave a clear error on the nonlinear layer"
    assert 1 - r2_mlp["value"][-1] < 0.25 * (1 - r2_ridge["value"][-1])
    # Linear layers stay exact.
    assert min(r2_mlp["key"] + r2_mlp["value"][:-1]) > 0.999
    # The recorded held-out report agrees: ridge and MLP per layer, MLP never worse.
    report = mlp.report["mlp"]["heldout"]
    for kind in ("key", "value"):
        assert all(m <= r * (1 + 1e-9) for m, r in zip(report[kind]["mlp_mse"], report[kind]["ridge_mse"]))
    assert report["value"]["ridge_r2"][-1] < 0.85 < 0.95 < report["value"]["mlp_r2"][-1]
    assert mlp.config.heldout_r2_value == report["value"]["mlp_r2"]


def test_transferred_cache_generates_with_mlp_mapper(nonlinear_pair):
    source, target, mlp, ridge = nonlinear_pair
    ids = random_ids(4, 32, seed=0)
    kw = dict(do_sample=False, max_new_tokens=8, min_new_tokens=8, return_dict_in_generate=True, output_logits=True)
    ref = target.generate(ids, **kw)

    def first_step_error(mapper):
        out = target.generate(ids, cache=TransferredCache(prefill(source, ids), mapper, model=target), **kw)
        assert out.sequences.shape == ref.sequences.shape
        # The first generated step reads the whole transferred prefix (later steps may follow other tokens).
        return (out.logits[0] - ref.logits[0]).abs().mean().item()

    err_mlp, err_ridge = first_step_error(mlp), first_step_error(ridge)
    assert err_mlp < 0.5 * err_ridge, f"logit error with the MLP mapper {err_mlp:.3g} vs ridge {err_ridge:.3g}"


def test_residual_mlp_stays_at_ridge_on_linear_pair(linear_models):
    source, target, true_source_of = linear_models
    calibration = random_ids(24, 64, seed=9)
    mlp = fit_mlp_mapper(source, target, calibration, top_k=1, **{**FAST, "epochs": 5})
    ridge = fit_mapper(source, target, calibration, top_k=1, progress=False)
    ids = random_ids(6, 64, seed=11)
    r2_mlp, r2_ridge = _mapped_r2(mlp, source, target, ids), _mapped_r2(ridge, source, target, ids)
    for t, s in enumerate(true_source_of):
        if s is None:
            continue
        assert mlp.config.selected_layers[t] == [s]
        for kind in ("key", "value"):
            assert r2_mlp[kind][t] > 0.999
            assert 1 - r2_mlp[kind][t] <= (1 - r2_ridge[kind][t]) * 1.5 + 1e-6, (t, kind, r2_mlp, r2_ridge)
    report = mlp.report["mlp"]["heldout"]
    for kind in ("key", "value"):
        assert all(m <= r * (1 + 1e-9) for m, r in zip(report[kind]["mlp_mse"], report[kind]["ridge_mse"]))


def _assert_same_maps(a, b):
    """Both mappers give the same target K/V on random features, layer by layer."""
    for t in range(len(a.layers)):
        feats = _random_features(a, t, seed=t)
        with torch.no_grad():
            for x, y in zip(a(t, *feats), b(t, *feats)):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_untrained_residual_mapper_is_ridge_on_the_training_sequences(linear_models):
    source, target, _ = linear_models
    ids = random_ids(10, 32, seed=4)
    mlp = fit_mlp_mapper(source, target, ids, top_k=2, stride=2, hidden_size=8, epochs=0, heldout_fraction=0.3,
                         progress=False)  # fmt: skip
    held = mlp.report["mlp"]["heldout_sequences"]
    assert held == [7, 8, 9]  # the last 30% of the sequences, as for every fit
    # The ridge fit through the ordinary path on the training sequences only.
    ridge = fit_mapper(source, target, ids[[i for i in range(10) if i not in held]], top_k=2, stride=2, progress=False)
    assert mlp.config.selected_layers == ridge.config.selected_layers
    _assert_same_maps(mlp, ridge)


def test_top_k_beyond_source_depth_means_every_layer_as_for_ridge(linear_models):
    # fit_mapper's default top_k=8 on a 4-layer source must not fail for the MLP while ridge accepts it.
    source, target, _ = linear_models
    ids = random_ids(10, 32, seed=5)
    depth = source.config.num_hidden_layers
    kwargs = dict(stride=2, heldout_fraction=0.3, progress=False)
    mlp = fit_mlp_mapper(source, target, ids, top_k=depth + 3, hidden_size=8, epochs=0, **kwargs)
    ridge = fit_mapper(source, target, ids[:7], top_k="all", **{**kwargs, "heldout_fraction": 0})
    assert mlp.config.selected_layers == ridge.config.selected_layers == [list(range(depth))] * len(mlp.layers)
    assert mlp.config.top_k == depth
    _assert_same_maps(mlp, ridge)


def test_fit_mapper_dispatches_and_reports_memory(linear_models):
    source, target, _ = linear_models
    ids = random_ids(10, 32, seed=2)
    mapper = fit_mapper(
        source, target, ids, top_k=2, stride=2, mapper_type="mlp", hidden_size=8, epochs=1, mlp_batch_size=64,
        feature_stride=4, heldout_fraction=0.2, progress=False,
    )  # fmt: skip
    settings = mapper.report["mlp"]
    assert mapper.config.mapper_type == "mlp" and settings["batch_size"] == 64 and mapper.config.mlp["hidden_size"] == 8
    # 2 of 10 sequences held out; every 4th of 32 tokens kept as features.
    assert (settings["train_tokens"], settings["heldout_tokens"]) == (8 * 8, 2 * 8)
    assert mapper.config.calibration["num_tokens"] == 8 * 16  # ridge statistics: training sequences, stride 2
    src, tgt = mapper.source_layout, mapper.target_layout
    assert settings["memory_bytes"]["features"] == 80 * 2 * 4 * (src.num_layers + tgt.num_layers) * 2 * 16
    assert settings["memory_bytes"] == mlp_fit_nbytes(src, tgt, 64, 16, 2, 8, 2, False, 64)
    assert all(isinstance(m, MLPKindMap) for layer in mapper.layers for m in (layer.key, layer.value))
    with pytest.raises(ValueError, match="mapper_type"):
        fit_mapper(source, target, ids, mapper_type="tree", progress=False)
    with pytest.raises(ValueError, match="one top_k"):
        fit_mlp_mapper(source, target, ids, top_k=[1, 2], progress=False)


# -- persistence ---------------------------------------------------------------------------------------------


def _random_features(mapper, t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n_in = len(mapper.config.selected_layers[t]) * mapper.source_layout.layer_dim
    return torch.randn(2, 5, n_in, generator=g), torch.randn(2, 5, n_in, generator=g)


def test_save_load_round_trip_is_bit_identical(nonlinear_pair, tmp_path):
    _, _, mlp, _ = nonlinear_pair
    mlp.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["mapper_type"] == "mlp" and config["mlp"]["hidden_size"] == 64
    assert "mlp" in (tmp_path / "README.md").read_text().lower()
    loaded = KVMapper.from_pretrained(tmp_path)
    assert loaded.config.mlp == mlp.config.mlp
    for t in range(len(mlp.layers)):
        feats = _random_features(mlp, t, seed=t)
        with torch.no_grad():
            for a, b in zip(mlp(t, *feats), loaded(t, *feats)):
                assert torch.equal(a, b)


def test_loading_is_strict_for_mlp_weights(nonlinear_pair, tmp_path):
    from safetensors.torch import load_file, save_file

    _, _, mlp, _ = nonlinear_pair
    mlp.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["layers.0.value.mlp.1.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing tensors.*layers.0.value.mlp.1.weight"):
        KVMapper.from_pretrained(tmp_path)
    # A config that says a different hidden size does not load these weights either.
    mlp.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["mlp"]["hidden_size"] = 32
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="shape"):
        KVMapper.from_pretrained(tmp_path)


def test_push_pull_round_trip(nonlinear_pair, hub_server):
    _, _, mlp, _ = nonlinear_pair
    repo_id = f"{hub_server.user}/tiny-mlp-mapper"
    mlp.push_to_hub(repo_id, token=hub_server.write_token)
    pulled = KVMapper.from_pretrained(repo_id, token=hub_server.read_token)
    assert pulled.config.mapper_type == "mlp" and pulled.config.mlp == mlp.config.mlp
    feats = _random_features(mlp, 1, seed=4)
    with torch.no_grad():
        for a, b in zip(mlp(1, *feats), pulled(1, *feats)):
            assert torch.equal(a, b)
