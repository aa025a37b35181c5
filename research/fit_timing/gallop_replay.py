"""Replays the verdicts a fit logged through the configuration search's gallop over exact-layer counts.

A fit's log (`hf-kvtransfer fit -v`) has one line per configuration it scored; the first of each exact-layer count is
the widest, whose verdict decides the count. A fit that scanned the counts from the fewest logged every count's
verdict up to its answer; this script hands those verdicts to `exact_layers._gallop` and reports which counts the
gallop tries and how many of them reach the content gate, against the scan's. A count the gallop would try that the
scan never scored (above the scan's answer) has no logged verdict: the replay stops there and says so.

    python research/fit_timing/gallop_replay.py --log FIT_LOG [--log ...] --json OUT
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from hf_kvtransfer.fitting.exact_layers import _gallop

LINE = re.compile(r"configuration probe, candidate \d+(?: of \d+)?: (\d+) exact, .*: (passes|fails)\s*$")


class Unknown(Exception):
    """The gallop asks for a count the log holds no verdict for."""


def widest_verdicts(log: Path) -> dict[int, dict]:
    """Each exact-layer count's first logged configuration: passes, and whether the content gate judged it."""
    verdicts: dict[int, dict] = {}
    for line in log.read_text(encoding="utf-8", errors="replace").replace("\r", "\n").splitlines():
        m = LINE.search(line)
        if m and int(m.group(1)) not in verdicts:
            verdicts[int(m.group(1))] = {"passes": m.group(2) == "passes", "gated": "content gate:" in line}
    return verdicts


def replay(verdicts: dict[int, dict], counts: list[int]) -> dict:
    tried: list[int] = []

    def passes(i: int) -> bool:
        n = counts[i]
        tried.append(n)
        if n not in verdicts:
            raise Unknown(n)
        return verdicts[n]["passes"]

    scan = [n for n in counts if n <= min([c for c in verdicts if verdicts[c]["passes"]] or [counts[-1]])]
    out = {"scan_tried": scan, "scan_gated": sum(verdicts[n]["gated"] for n in scan if n in verdicts)}
    try:
        found = _gallop(passes, len(counts))
    except Unknown as exc:
        return {**out, "gallop_tried": tried, "unknown_count": exc.args[0],
                "note": "the gallop tries a count the scan never scored: its verdict is not in the log"}  # fmt: skip
    return {**out, "gallop_tried": tried, "gallop_answer": None if found is None else counts[found],
            "gallop_gated": sum(verdicts[n]["gated"] for n in tried)}  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="example: python research/fit_timing/gallop_replay.py --log research/"
                                       "family_builder/results/deep_pin2_long/fit_source_to_target.log --json OUT")  # fmt: skip
    p.add_argument("--log", action="append", required=True, help="a fit's -v log (repeat for several)")
    p.add_argument("--max-count", type=int, action="append",
                   help="the most exact layers the search may try for each --log, in order (default: the log's "
                        "largest count; the source-only answer's count bounds it in the fit)")  # fmt: skip
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    results = {}
    for i, log in enumerate(args.log):
        verdicts = widest_verdicts(Path(log))
        top = args.max_count[i] if args.max_count else max(verdicts)
        results[log] = replay(verdicts, list(range(1, top + 1)))
        print(log, json.dumps(results[log]))
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
