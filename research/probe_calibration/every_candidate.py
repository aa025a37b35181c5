"""`hf-kvtransfer fit` with one rule of the configuration search off: every candidate of an exact-layer count the
search tries is scored, where the library skips the rest of a count once its first (widest) candidate fails (which
counts it tries is the library's: its gallop over the counts reads the first candidates only).

The question: does that rule skip configurations that would pass the content gate? A narrower candidate (maps that
read less: fewer source layers, no source K/V, fewer readers) is taken to keep no more than the widest one of the
same exact layers. With the rule off the fit scores those candidates too and chooses among everything that passes,
so its choice and its log say whether the rule cost anything. Every other rule (and option) is the library's.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python research/probe_calibration/every_candidate.py -v \
        --source examples/family_deep/source --target examples/family_deep/target \
        --dataset examples/family_deep/calibration.txt --output DIR > LOG 2>&1

Arguments are `hf-kvtransfer fit`'s.
"""

from __future__ import annotations

import sys

from hf_kvtransfer.commands.cli import main
from hf_kvtransfer.fitting import exact_layers

_library_candidate = exact_layers._InputSearch.candidate


def _every_candidate(self, mapper, row, state, **keywords):
    """The library's `candidate`, shown no failed exact-layer count (its other skips stay)."""
    failed = set(state["failed"])
    state["failed"].clear()
    try:
        return _library_candidate(self, mapper, row, state, **keywords)
    finally:
        state["failed"].update(failed)


if __name__ == "__main__":
    exact_layers._InputSearch.candidate = _every_candidate
    sys.exit(main(["fit", *sys.argv[1:]]))
