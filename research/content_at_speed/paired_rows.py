"""Rows of a frontier against its best row, paired on the same items: for each content task, each row's transfer
accuracy minus the best row's, per item, with a 95% bootstrap interval.

Each row is an `hf-kvtransfer eval --json` file of one configuration on the same items (same text, seed and
`--items`): the script checks that the target's own answers agree item by item, and stops with one line if they do
not. The best row is the one with the highest passage recall (or `--best NAME`).

    python research/content_at_speed/paired_rows.py \\
        --eval default=research/family_builder/results/deep_pair/eval_source_to_target.json \\
               recompute_8=research/family_builder/results/deep_pair/eval_recompute_8_source_to_target.json \\
        --json FILE
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from hf_kvtransfer.evaluation.metrics import mean_and_ci

TASKS = ("passage_recall", "handoff")


def load_rows(specs: list[str]) -> dict[str, dict]:
    """`NAME=FILE` pairs to their eval results, in the order given."""
    rows = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--eval takes NAME=FILE, got {spec!r}")
        rows[name] = json.loads(Path(path).read_text(encoding="utf-8"))
    return rows


def correct(result: dict, task: str, who: str) -> np.ndarray:
    return np.asarray(result[task]["correct_per_item"][who], dtype=np.float64)


def check_same_items(rows: dict[str, dict]) -> None:
    """The rows must score the same items: the target's own answers, which no mapper touches, agree item by item."""
    first_name, first = next(iter(rows.items()))
    for task in TASKS:
        reference = correct(first, task, "own")
        for name, result in rows.items():
            own = correct(result, task, "own")
            if own.shape != reference.shape or not np.array_equal(own, reference):
                raise SystemExit(f"{name} and {first_name} did not score the same {task} items (the target's own "
                                 "answers differ); run eval on each with the same --text, --items and seed")  # fmt: skip


def paired_against(rows: dict[str, dict], best: str, num_bootstrap: int, seed: int) -> dict[str, dict]:
    """Per row and task: the row's transfer accuracy minus the best row's, paired per item (`{"mean", "ci"}`)."""
    out = {}
    for name, result in rows.items():
        out[name] = {
            task: mean_and_ci(correct(result, task, "transfer") - correct(rows[best], task, "transfer"),
                              num_bootstrap, seed)
            for task in TASKS
        }  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eval", nargs="+", required=True, metavar="NAME=FILE", help="one eval JSON per row")
    parser.add_argument("--best", default=None, help="the row to pair against (default: the highest passage recall)")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples (default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", required=True, help="where to write the result")
    args = parser.parse_args(argv)
    rows = load_rows(args.eval)
    check_same_items(rows)
    if args.best is not None and args.best not in rows:
        raise SystemExit(f"--best {args.best} is not one of the rows: {', '.join(rows)}")
    best = args.best or max(rows, key=lambda name: correct(rows[name], "passage_recall", "transfer").mean())
    result = {
        "best": best,
        "chosen_by": "--best" if args.best else "highest passage recall",
        "num_bootstrap": args.bootstrap,
        "seed": args.seed,
        "files": dict(spec.split("=", 1) for spec in args.eval),
        "num_items": {task: int(correct(rows[best], task, "own").size) for task in TASKS},
        "minus_best": paired_against(rows, best, args.bootstrap, args.seed),
    }
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    for name, tasks in result["minus_best"].items():
        cells = (f"{task} {100 * s['mean']:+.1f} [{100 * s['ci'][0]:+.1f}, {100 * s['ci'][1]:+.1f}]"
                 for task, s in tasks.items())  # fmt: skip
        print(f"{name} minus {best}: " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
