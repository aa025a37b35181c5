"""The per-request quality gate (`core/quality_gate.py`): the score against numpy, the threshold rule, and the gate's
place in the mapper's config (saved, loaded, absent from mappers saved before it)."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from hf_kvtransfer.core.quality_gate import QualityGateConfig, TransferStatus, gate_scores, passes


def _pairs(g, batch=3, layers=4, shape=(2, 5, 8)):
    return [(torch.randn(batch, *shape, generator=g), torch.randn(batch, *shape, generator=g)) for _ in range(layers)]


def _numpy_score(predicted, exact):
    """Worst cosine over layers and K/V per row, written independently with numpy."""
    batch = predicted[0][0].shape[0]
    out = np.full(batch, np.inf)
    for (pk, pv), (ek, ev) in zip(predicted, exact):
        for p, e in ((pk, ek), (pv, ev)):
            p, e = p.numpy().reshape(batch, -1).astype(np.float64), e.numpy().reshape(batch, -1).astype(np.float64)
            cos = (p * e).sum(1) / (np.linalg.norm(p, axis=1) * np.linalg.norm(e, axis=1))
            out = np.minimum(out, cos)
    return out


def test_score_matches_numpy():
    g = torch.Generator().manual_seed(0)
    exact = _pairs(g)
    predicted = [(k + 0.3 * torch.randn(k.shape, generator=g), v + 0.1 * (i + 1) * torch.randn(v.shape, generator=g))
                 for i, (k, v) in enumerate(exact)]  # fmt: skip
    np.testing.assert_allclose(gate_scores(predicted, exact).numpy(), _numpy_score(predicted, exact), rtol=1e-5)


def test_score_is_one_for_exact_prediction_and_lower_for_one_bad_row():
    g = torch.Generator().manual_seed(1)
    exact = _pairs(g)
    predicted = [(k.clone(), v.clone()) for k, v in exact]
    predicted[2][1][1] = torch.randn(predicted[2][1][1].shape, generator=g)  # row 1, layer 2's values: noise
    scores = gate_scores(predicted, exact)
    assert scores[0] == pytest.approx(1.0, abs=1e-6) and scores[2] == pytest.approx(1.0, abs=1e-6)
    assert scores[1] < 0.5


def test_score_refuses_mismatched_layers():
    g = torch.Generator().manual_seed(2)
    with pytest.raises(ValueError, match="one \\(key, value\\) pair per layer"):
        gate_scores(_pairs(g, layers=2), _pairs(g, layers=3))


def test_passes_thresholds_rows_and_lets_all_through_without_gate():
    scores = torch.tensor([0.99, 0.5, 0.9])
    assert passes(scores, QualityGateConfig(threshold=0.9)).tolist() == [True, False, True]
    assert passes(scores, None).tolist() == [True, True, True]


def test_status_names_fallback_rows():
    status = TransferStatus(applied=(True, False), scores=(0.99, 0.2), threshold=0.9)
    assert status.reason == "quality gate" and status.fallback_rows == [1]
    assert TransferStatus(applied=(True, True)).reason is None


def test_gate_config_refuses_out_of_range_threshold():
    with pytest.raises(ValueError, match="threshold is a cosine"):
        QualityGateConfig(threshold=1.5)


def test_gate_saved_and_loaded_with_mapper(identity_mapper, tmp_path):
    from hf_kvtransfer import KVMapper

    mapper = KVMapper(dataclasses.replace(identity_mapper.config, quality_gate=QualityGateConfig(0.97, 0.01, 200, 256)),
                      identity_mapper.layers)  # fmt: skip
    mapper.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quality_gate"]
    assert saved == {"threshold": 0.97, "quantile": 0.01, "num_prompts": 200, "prompt_length": 256}
    assert KVMapper.from_pretrained(tmp_path).config.quality_gate == QualityGateConfig(0.97, 0.01, 200, 256)


def test_mapper_saved_before_the_gate_loads_without_one(identity_mapper, tmp_path):
    from hf_kvtransfer import KVMapper

    identity_mapper.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data.pop("quality_gate", None)  # a config.json written before the field existed
    path.write_text(json.dumps(data))
    assert KVMapper.from_pretrained(tmp_path).config.quality_gate is None
