"""research/probe_calibration/every_candidate.py: the fit's configuration search with its skip-after-a-failed-count
rule off, every other rule the library's. Checked against the library's own search on the same state."""

import copy
from pathlib import Path

import pytest

from conftest import exact_identity_mapper, load_script, tiny_model
from hf_kvtransfer.fitting import exact_layers

ROOT = Path(__file__).resolve().parents[1]


class Scored(Exception):
    """Raised where the search would score a candidate (it got past every skip)."""


@pytest.fixture(scope="module")
def every():
    return load_script(ROOT / "research/probe_calibration/every_candidate.py")


def _search():
    search = object.__new__(exact_layers._InputSearch)
    search.faithful_kv, search.refine, search.spans = None, None, []

    def probe(*args):
        raise Scored

    search.probe = probe
    return search


def _state(**sets):
    return {"failed": set(), "passed": set(), "seen": set(), "failed_full_rank": set(), "cheapest_kept": {}, **sets}


@pytest.mark.parametrize("state,library_skips,every_skips", [
    (_state(failed={2}, seen={2}), True, False),  # the count's first candidate failed: only the library skips
    (_state(passed={1}, seen={1}), True, True),  # fewer exact layers passed: both skip
    (_state(), False, False),  # nothing decided yet: both score it
])  # fmt: skip
def test_only_the_failed_count_rule_is_off(every, state, library_skips, every_skips):
    mapper = exact_identity_mapper(tiny_model("qwen3", num_hidden_layers=3, seed=1))
    for candidate, skips in ((exact_layers._InputSearch.candidate, library_skips), (every._every_candidate, every_skips)):
        before = copy.deepcopy(state)
        row = {"num_exact_layers": 2}
        if skips:
            assert candidate(_search(), mapper, row, state) is mapper and row["skipped"]
        else:
            with pytest.raises(Scored):
                candidate(_search(), mapper, row, state)
        assert state == before  # the failed counts are kept for the candidates after it
