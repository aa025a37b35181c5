"""The calibration plot: the content gate's predicted paired difference (probe items) against what eval measures
(eval's items) for every candidate in the result files of `calibrate.py`, plus a markdown table.

    python research/probe_calibration/plot.py research/probe_calibration/results/calibration*.json \
        --png research/probe_calibration/results/calibration.png --md research/probe_calibration/results/calibration.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TASKS = (("recall", "passage recall"), ("handoff", "hand-off"))


def rows_of(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        tolerance = data.get("settings", {}).get("tolerance", 0.05)
        for direction, cands in data.items():
            if direction == "settings":
                continue
            for label, row in cands.items():
                rows.append({"direction": direction, "label": label, "tolerance": tolerance, **row})
    return rows


def _pts(v: dict, key: str = "difference") -> str:
    low, high = v[f"{key}_ci"]
    return f"{100 * v[key]:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}]"


def markdown(rows: list[dict]) -> str:
    lines = ["| direction | candidate | gate kept | " + " | ".join(
        f"{name}: probe - own (pts) | {name}: eval - own (pts) | {name}: eval retention" for _, name in TASKS) + " |",
        "|---|---|---|" + "---|---|---|" * len(TASKS)]  # fmt: skip
    for r in rows:
        cells = [r["direction"], r["label"], "yes" if r["probe"]["accepted"] else "no"]
        for task, _ in TASKS:
            p, e = r["probe"]["tasks"].get(task), r["eval"][task]
            ret = "n/a" if e.get("retention") is None else f"{100 * e['retention']:.1f}%"
            cells += [_pts(p) if p else "–", _pts(e), ret]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], png: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(TASKS), figsize=(11, 5))
    colors = {"large-small": "tab:blue", "small-large": "tab:orange"}
    for ax, (task, name) in zip(axes, TASKS):
        for r in rows:
            p, e = r["probe"]["tasks"].get(task), r["eval"][task]
            if not p:
                continue
            x, y = 100 * p["difference"], 100 * e["difference"]
            xerr = [[x - 100 * p["difference_ci"][0]], [100 * p["difference_ci"][1] - x]]
            yerr = [[y - 100 * e["difference_ci"][0]], [100 * e["difference_ci"][1] - y]]
            ax.errorbar(x, y, xerr=xerr, yerr=yerr, fmt="o" if r["probe"]["accepted"] else "x",
                        color=colors.get(r["direction"], "gray"), alpha=0.8, capsize=2)  # fmt: skip
        lo = min([-100] + [100 * r["eval"][task]["difference"] for r in rows]) - 5
        ax.plot([lo, 10], [lo, 10], color="gray", lw=0.8)
        tol = 100 * rows[0]["tolerance"] if rows else 5
        ax.axhline(-tol, color="red", lw=0.8, ls="--")
        ax.axvline(-tol, color="red", lw=0.8, ls="--")
        ax.set_xlabel(f"gate (probe items): {name}, candidate - own, points")
        ax.set_ylabel(f"eval (eval's items): {name}, candidate - own, points")
        ax.set_title(name)
    handles = [plt.Line2D([], [], color=c, marker="o", ls="", label=d) for d, c in colors.items()]
    handles.append(plt.Line2D([], [], color="gray", marker="x", ls="", label="rejected by the gate"))
    axes[0].legend(handles=handles, loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+")
    p.add_argument("--png", default=str(Path(__file__).parent / "results" / "calibration.png"))
    p.add_argument("--md", default=str(Path(__file__).parent / "results" / "calibration.md"))
    args = p.parse_args(argv)
    rows = rows_of(args.results)
    Path(args.md).write_text(markdown(rows))
    if not plot(rows, Path(args.png)):
        print("matplotlib is not installed: wrote the markdown table only", file=sys.stderr)
    print(f"{len(rows)} candidates -> {args.md}" + (f", {args.png}" if Path(args.png).exists() else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
