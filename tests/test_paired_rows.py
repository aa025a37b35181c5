"""research/content_at_speed/paired_rows.py: each frontier row minus the best row, paired on the same items, checked
against the saved evals' own per-item answers; rows scored on different items are refused."""

import json
from pathlib import Path

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
DEEP = ROOT / "research/family_builder/results/deep_pair"
ROWS = {"default": "eval_source_to_target.json", "recompute_1": "eval_recompute_1_source_to_target.json",
        "source_kv_14_exact": "eval_source_kv_14_exact_source_to_target.json"}  # fmt: skip


@pytest.fixture(scope="module")
def paired_rows():
    return load_script(ROOT / "research/content_at_speed/paired_rows.py")


def accuracy(path: Path, task: str) -> float:
    items = json.loads(path.read_text())[task]["correct_per_item"]["transfer"]
    return sum(items) / len(items)


def test_each_row_minus_the_best_is_the_difference_of_their_accuracies(paired_rows, tmp_path):
    out = tmp_path / "paired.json"
    paired_rows.main(["--eval", *(f"{name}={DEEP / file}" for name, file in ROWS.items()), "--json", str(out)])
    result = json.loads(out.read_text())
    best = max(ROWS, key=lambda name: accuracy(DEEP / ROWS[name], "passage_recall"))
    assert result["best"] == best
    for name, file in ROWS.items():
        for task in ("passage_recall", "handoff"):
            stat = result["minus_best"][name][task]
            expected = accuracy(DEEP / file, task) - accuracy(DEEP / ROWS[best], task)
            assert stat["mean"] == pytest.approx(expected, abs=1e-12)
            low, high = stat["ci"]
            assert low <= stat["mean"] <= high and (high > low or name == best)


def test_rows_scored_on_different_items_are_refused(paired_rows, tmp_path):
    other = json.loads((DEEP / ROWS["default"]).read_text())
    own = other["handoff"]["correct_per_item"]["own"]
    own[0] = 1.0 - own[0]  # one item whose own answer differs: not the same items
    changed = tmp_path / "other.json"
    changed.write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="did not score the same handoff items"):
        paired_rows.main(["--eval", f"default={DEEP / ROWS['default']}", f"other={changed}",
                          "--json", str(tmp_path / "out.json")])  # fmt: skip
