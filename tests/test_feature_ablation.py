"""research/feature_ablation/feature_ablation.py on tiny random models: its baseline must be the library's mapper (selection, weights,
held-out R^2) and its hand-built caches must score like `prefix_perplexity` (the harness's self-tests)."""

import json
from pathlib import Path

import pytest

from conftest import load_script
from fit_fixtures import make_tokenizer, save_pair, write_corpus

EXAMPLE = Path(__file__).resolve().parent.parent / "research" / "feature_ablation" / "feature_ablation.py"


@pytest.fixture(scope="module")
def ablation():
    return load_script(EXAMPLE)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("ablation")
    source, target = save_pair(root, make_tokenizer(), source_layers=3, target_layers=2)
    return source, target, write_corpus(root / "corpus.txt", num_paragraphs=40, seed=3)


def _args(pair, tmp_path, *extra):
    source, target, corpus = pair
    return [
        "--source", str(source), "--target", str(target), "--calibration-text", str(corpus), "--heldout-text",
        str(corpus), "--windows", "4", "--prefix-len", "8", "--num-sequences", "12", "--seq-len", "32",
        "--batch-size", "4", "--num-bootstrap", "50", "--no-progress", "--json", str(tmp_path / "out.json"), *extra,
    ]  # fmt: skip


def test_harness_baseline_is_the_library_mapper(ablation, pair, tmp_path, capsys):
    # k=2 of 3 source layers: attn-select really chooses (among the R^2 top-3) and may differ from the baseline.
    assert ablation.main(_args(pair, tmp_path, "--top-k", "2")) == 0
    report = json.loads((tmp_path / "out.json").read_text())
    checks = report["checks"]
    assert checks["passed"] and checks["weights_close_rtol_1e-5"] and checks["selected_layers_equal"]
    assert checks["weights_max_rel_error"] < 1e-5 and checks["heldout_r2_max_abs_error"] < 1e-6
    assert all(err <= 1e-4 for err in checks["nll_max_abs_error"].values()) and checks["kl_within_1e-5"]
    assert checks["attention_probe_ok"]
    assert list(report["variants"]) == list(ablation.VARIANTS) and report["windows"] == 4
    for name in ("attn-select", "attn-greedy"):
        attn = report["variants"][name]
        assert all(len(sel) == 2 for sel in attn["selected_layers"]) and attn["attention_selection_scores"]
    # target layer 0 is computed exactly: the attention rules score (and may change) only layer 1
    assert set(report["variants"]["attn-greedy"]["attention_selection_scores"]) == {"1"}
    # the extra features are extra rows of the same solve: more parameters, exactly as many as they add
    base, both = report["variants"]["baseline"], report["variants"]["embed+prev"]
    per_map_in = 2 * 16 * 2 + 64  # k * F_s more for t-1, plus the target's 64-wide embedding
    assert both["params"] - base["params"] == 2 * 2 * per_map_in * 8  # 2 target layers x K/V x inputs x F_t
    assert "| embed+prev |" in capsys.readouterr().out


def test_lambda_auto_matches_the_library(ablation, pair, tmp_path):
    assert ablation.main(_args(pair, tmp_path, "--ridge-lambda", "auto", "--variants", "embed")) == 0
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["checks"]["passed"] and report["checks"]["ridge_lambda_equal"]
    assert list(report["variants"]) == ["baseline", "embed"]


def test_feature_index_and_shift(ablation):
    import torch

    from hf_kvtransfer.core.stats import KVLayout

    src = KVLayout(3, 2, 4)  # F_s = 8, 24 features per copy
    idx = ablation.feature_index(ablation.VARIANT_SPECS["embed+prev"], [0, 2], src, embed_dim=5)
    assert idx.tolist() == [*range(0, 8), *range(16, 24), *range(24, 32), *range(40, 48), *range(48, 53)]
    x = torch.arange(6.0).reshape(1, 3, 2)
    assert ablation.shifted(x).tolist() == [[[0.0, 0.0], [0.0, 1.0], [2.0, 3.0]]]
