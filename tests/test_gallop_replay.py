"""research/fit_timing/gallop_replay.py: the verdicts a scanning fit logged, replayed through the search's gallop,
land on the count that fit chose, and a count the scan never scored is reported as unknown, not guessed."""

import json
from pathlib import Path

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
PIN2 = ROOT / "research/family_builder/results/deep_pin2_long"
PIN4 = ROOT / "research/family_builder/results/deep_pin4_long"


def test_the_replay_lands_where_the_scanning_fit_chose_in_fewer_gate_verdicts():
    replay = load_script(ROOT / "research/fit_timing/gallop_replay.py")
    verdicts = replay.widest_verdicts(PIN2 / "fit_source_to_target.log")
    chosen = json.loads((PIN2 / "mapper_config_source_to_target.json").read_text())["num_exact_layers"]
    assert [n for n, v in sorted(verdicts.items()) if v["passes"]] == [chosen]  # the scan stopped at its first pass
    result = replay.replay(verdicts, list(range(1, 24)))
    assert result["gallop_answer"] == chosen and result["scan_tried"] == list(range(1, chosen + 1))
    assert result["gallop_gated"] < result["scan_gated"] == sum(v["gated"] for v in verdicts.values())
    assert len(set(result["gallop_tried"])) == len(result["gallop_tried"])


def test_a_count_the_scan_never_scored_stops_the_replay():
    replay = load_script(ROOT / "research/fit_timing/gallop_replay.py")
    verdicts = replay.widest_verdicts(PIN4 / "fit_rerun_source_to_target.log")
    result = replay.replay(verdicts, list(range(1, 22)))
    assert result["unknown_count"] not in verdicts and "gallop_answer" not in result
    assert result["gallop_tried"][-1] == result["unknown_count"]
