"""Markdown table of content_at_speed.py results: one row per variant of each result file, in the order given.

    python research/content_at_speed/table.py research/content_at_speed/results/small_to_large.json \\
        research/content_at_speed/results/large_to_small.json
"""

import argparse
import json


def pct(x):
    return f"{100 * x:.1f}"


def print_table(paths):
    print("| pair | variant | exact layers | recall retention [95% CI] | minus today [paired CI] | hand-off retention | "
          "minus today | repeated spans | minus today | TTFT own / transfer ms (speed-up) 512 | 1024 | 4096 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        r = json.load(open(path))
        for name, v in r["variants"].items():
            cells = [f"{r['source']} -> {r['target']}", name + (" (today's default)" if name == r["reference"] else ""),
                     str(v["num_exact_layers"])]  # fmt: skip
            for task in ("recall", "handoff", "spans"):
                t = v.get(task)
                if t is None:
                    cells += ["–", "–"]
                    continue
                cells.append(f"{pct(t['retention'])} [{pct(t['retention_ci'][0])}, {pct(t['retention_ci'][1])}]")
                cells.append("–" if name == r["reference"] else
                             f"{pct(t['minus_reference'])} [{pct(t['minus_reference_ci'][0])}, {pct(t['minus_reference_ci'][1])}]")
            for n in ("512", "1024", "4096"):
                t = v["ttft"].get(n)
                cells.append("–" if t is None else f"{t['own_ms']:.0f} / {t['transfer_ms']:.0f} ({t['speedup']:.2f}x)")
            print("| " + " | ".join(cells) + " |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="result files written by content_at_speed.py (--output)")
    print_table(parser.parse_args(argv).results)


if __name__ == "__main__":
    main()
