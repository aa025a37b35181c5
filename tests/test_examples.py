"""Smoke tests: every script in examples/, the research scripts the docs quote, and the `demo` / `eval` commands run offline on the bundled family.

Each is a fresh process (imports, model loads, a small fit). The scripts that fit with the content probe run it on
fewer items (`--exact-layers-items`): the same code path, a cheaper choice. quickstart and cascade are marked slow
(`pytest -m slow`; .ci/run runs them). The subprocess timeout is a hang guard only (`HANG_GUARD_S`): a busy machine
may take several times as long.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HANG_GUARD_S
from hf_kvtransfer.commands.demo import find_family

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
RESEARCH = ROOT / "research"

try:
    # HF_KVTRANSFER_FAMILY points the examples at another family directory (they read it too).
    FAMILY = find_family(os.environ.get("HF_KVTRANSFER_FAMILY") or ROOT / "examples" / "family")
except FileNotFoundError:
    FAMILY = None

pytestmark = pytest.mark.skipif(
    FAMILY is None,
    reason="the bundled model family is not in examples/family (small/ and large/ model.safetensors); "
    "build it with `python research/family_builder/train_family.py --output-dir examples/family`",
)


# Items per content probe of the fits below (default 64): a quarter of the scoring, the same probe and choice rule.
PROBE_ITEMS = ["--exact-layers-items", "16"]


def _run(args: list[str]) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "OMP_NUM_THREADS": "2",
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, f"{' '.join(map(str, args))} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def fitted_mapper(tmp_path_factory):
    out = tmp_path_factory.mktemp("mapper") / "small-to-large"
    stdout = _run([sys.executable, str(EXAMPLES / "fit_and_publish.py"), "--output-dir", str(out),
                   "--num-sequences", "16", "--eval-windows", "16"])
    assert "not published" in stdout and (out / "model.safetensors").is_file()
    return out


# Slow (a fit with the content probe, about 80 s on 2 cores; .ci/run runs it): the README's quickstart block
# (tests/test_readme.py, in the default run) goes through the same fit, transfer and generation.
@pytest.mark.slow
def test_quickstart():
    out = _run([sys.executable, str(EXAMPLES / "quickstart.py"), "--num-sequences", "16", *PROBE_ITEMS])
    assert "large, transferred cache:" in out and "large, its own prefill:" in out


# Slow (its own fit with the content probe, about 95 s on 2 cores; .ci/run runs it).
@pytest.mark.slow
def test_cascade():
    out = _run([sys.executable, str(EXAMPLES / "cascade.py"), "--new-tokens", "12", "--num-sequences", "16", *PROBE_ITEMS])
    assert "small answers:" in out and "greedy tokens equal" in out


def test_multi_turn():
    out = _run([sys.executable, str(EXAMPLES / "multi_turn.py"), "--new-tokens", "8", "--num-sequences", "16"])
    assert "turn 1 (small)" in out and "turn 2 (large)" in out and "turn 3 (small)" in out


def test_fit_and_publish_saves_a_loadable_mapper(fitted_mapper):
    report = json.loads((fitted_mapper / "fit_report.json").read_text())
    assert isinstance(report["eval_results"]["normalized_retention"], float)
    assert "normalized_retention" in (fitted_mapper / "README.md").read_text()
    assert (fitted_mapper / "README.md").is_file()


# Slow (the demo as a user runs it: its fit with the whole content probe, about 4 minutes on 2 cores; .ci/run runs it).
@pytest.mark.slow
def test_demo_without_arguments(tmp_path):
    out = _run([sys.executable, str(EXAMPLES / "demo.py"), "--recall-items", "8", *PROBE_ITEMS, "--json", str(tmp_path / "demo.json")])
    assert "target on the transferred cache" in out and "recall" in out and "Q: " in out
    result = json.loads((tmp_path / "demo.json").read_text())
    # the demo's question is the first recall item; its answer is stated in the prompt's passage
    assert f"``{result['answer']}``" in result["prompt"]
    assert set(result["answers"]) == {"own", "transfer", "no_context"}
    assert result["recall"]["num_items"] == 8 and result["timing"]["transfer_ms"] > 0
    # the exact layers are the ones the demo's fit chose with its content probe, used by every part of the demo
    chosen = result["mapper"]["num_exact_layers"]
    assert result["mapper"]["exact_layers_probe_retention"] == 0.95 and 1 <= chosen <= 8
    assert result["mapper"]["exact_layers_probe_items"] == 16  # --exact-layers-items reached the fit
    assert result["recall"]["num_exact_layers"] == result["timing"]["num_exact_layers"] == chosen
    assert f"first {chosen} of 8 layers" in out and f"{chosen} exact layer(s)" in out and "content probe chose" in out


def test_eval_command(tmp_path, fitted_mapper):
    pytest.importorskip("matplotlib")
    out = _run([
        sys.executable, "-m", "hf_kvtransfer.commands.cli", "eval", "--source", str(FAMILY / "small"),
        "--target", str(FAMILY / "large"), "--mapper", str(fitted_mapper), "--text", str(FAMILY / "heldout.txt"),
        "--max-windows", "8", "--num-items", "8", "--items", "8", "--turns", "2", "--json", str(tmp_path / "e.json"),
        "--plot", str(tmp_path / "e.png"),
    ])
    assert "prefix-conditioned perplexity" in out and "continuation task" in out and "passage recall accuracy" in out
    results = json.loads((tmp_path / "e.json").read_text())
    for key in ("repeated_span", "passage_recall", "handoff"):
        assert results[key]["num_items"] == 8, key
    assert results["greedy_agreement"]["num_prompts"] == 8
    # the float32 family gets the bf16 rounding reference beside the transfer's agreement, in the JSON and the table
    assert results["greedy_agreement"]["reference"]["dtype"] == "bfloat16"
    assert len(results["greedy_agreement"]["reference"]["all_tokens_agreement_per_item"]) == 8
    assert "own cache rounded to bfloat16 (numeric reference)" in out
    num_layers = json.loads((FAMILY / "large" / "config.json").read_text())["num_hidden_layers"]
    assert len(results["kv_r2"]["key"]) == len(results["prefix_perplexity"]["attention_cosine"]) == num_layers
    assert (tmp_path / "e.png").read_bytes()[:4] == b"\x89PNG"


def test_rank_tradeoff(tmp_path):
    pytest.importorskip("matplotlib")
    _run([sys.executable, str(RESEARCH / "rank_tradeoff" / "rank_tradeoff.py"), "--num-sequences", "16", "--windows", "8",
          "--seq-len", "128", "--repeats", "2", "--specs", "full", "8@bf16", "--output-dir", str(tmp_path)])  # fmt: skip
    report = json.loads((tmp_path / "tradeoff.json").read_text())
    full, low = report["rows"]
    # Sizes follow from the shapes alone: per target layer and K/V, a full map is (k * inputs) x outputs + biases,
    # rank 8 stores (k * inputs + outputs) x 8 + biases, in bf16 (2 bytes).
    small, large = (json.loads((FAMILY / name / "config.json").read_text()) for name in ("small", "large"))
    f_in = min(4, small["num_hidden_layers"]) * small["num_key_value_heads"] * small["head_dim"]
    f_out, layers = large["num_key_value_heads"] * large["head_dim"], large["num_hidden_layers"]
    assert full["parameters"] == layers * 2 * (f_in * f_out + f_out) and full["bytes"] == 4 * full["parameters"]
    assert low["parameters"] == layers * 2 * ((f_in + f_out) * 8 + f_out) and low["bytes"] == 2 * low["parameters"]
    assert all(r["transfer_ms"] > 0 for r in report["rows"]) and (tmp_path / "tradeoff.png").stat().st_size > 1000


def test_family_context(tmp_path):
    out = _run([sys.executable, str(RESEARCH / "family_builder" / "family_context.py"), "--family", str(FAMILY), "--models", "small",
                "--items", "8", "--extra-items", "4", "--hard-items", "4", "--windows", "8",
                "--output", str(tmp_path / "ctx.json")])
    assert "| context gain (nats/token) |" in out and "| two-hop recall acc % with passage |" in out
    res = json.loads((tmp_path / "ctx.json").read_text())["models"]["small"]
    assert res["recall"]["items"] == 8 and res["context"]["windows"] == 8
    assert res["hard_recall"]["items"] == 4 and res["two_hop"]["items"] == 4


def test_exact_layers_ablation(tmp_path):
    out = tmp_path / "exact.json"
    _run([sys.executable, str(RESEARCH / "exact_layers_ablation" / "exact_layers_ablation.py"), "--windows", "8", "--exact", "0", "1",
          "--num-sequences", "16", "--json", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    for pair in ("small->large", "large->small"):
        rows = report["pairs"][pair]
        # Same windows, same own and floor perplexities: only the transferred cache differs between settings.
        assert rows["0"]["perplexity"]["target"] == rows["1"]["perplexity"]["target"]
        assert rows["0"]["perplexity"]["transfer"] != rows["1"]["perplexity"]["transfer"]
        low, high = rows["1"]["difference_vs_first"][1:]
        assert low <= rows["1"]["difference_vs_first"][0] <= high


def test_fidelity_ablation(tmp_path):
    out = _run([sys.executable, str(RESEARCH / "fidelity_ablation" / "fidelity_ablation.py"), "--rows", "default,exact2,exact6", "--items",
                "6", "--windows", "6", "--directions", "large-small", "--num-sequences", "4", "--ttft-len", "64",
                *PROBE_ITEMS, "--json", str(tmp_path / "a.json")])  # fmt: skip
    assert "large-small exact2" in out and "large-small exact6: skipped" in out  # small has 4 layers
    rows = json.loads((tmp_path / "a.json").read_text())["directions"]["large-small"]["rows"]
    assert set(rows) == {"default", "exact2"} and "ppl_diff_ci" in rows["exact2"]
    assert rows["exact2"]["num_exact_layers"] == 2 and isinstance(rows["default"]["num_exact_layers"], int)
    assert all(row["ttft_ms"] > 0 for row in rows.values())
    out = _run([sys.executable, str(RESEARCH / "fidelity_ablation" / "fidelity_ablation.py"), "--rows", "default,recompute8", "--ttft-only",
                "--items", "2", "--windows", "2", "--directions", "large-small", "--num-sequences", "4", "--ttft-len",
                "64", *PROBE_ITEMS, "--json", str(tmp_path / "t.json")])  # fmt: skip
    rows = json.loads((tmp_path / "t.json").read_text())["directions"]["large-small"]["rows"]
    assert set(rows) == {"default", "recompute8"} and all(set(r) == {"what", "ttft_ms"} for r in rows.values())
    assert "| recompute8: 8 recomputed tokens | - | - |" in out
