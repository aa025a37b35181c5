"""Markdown tables from speed_levers.py results: one table per result file, in the order given (commands.sh writes
all_rows.md with it).

    python research/speed_levers/table.py research/speed_levers/results/*.json > research/speed_levers/all_rows.md
"""

import argparse
import json


def print_tables(paths):
    for fn in paths:
        r = json.load(open(fn))
        a = r["args"]
        print(f"\n**{fn.split('/')[-1]}** — {r['pair']}, {a['n_win']} windows, {a['n_cal']}x256 calibration tokens, "
              f"TTFT at {a['ttft_len']} tokens, {a['ttft_repeats']} interleaved repeats; own NLL {r['own_nll']:.3f}, "
              f"floor {r['floor_nll']:.3f}; one target layer = {r['target_layer_macs_per_token']/1e3:.0f}k MACs/token; "
              f"started {r['date']} ({r['uptime_start'].split('load average:')[-1].strip()} load)\n")
        print("| variant | spec | retention [95% CI] | paired diff vs first row [CI] | map MACs/token (target layers) "
              "| wall own / transfer ms, R=32 | speed-up wall R=32 | CPU own / transfer ms, R=32 | speed-up CPU R=32 "
              "| speed-up wall R=1 | load (1 min) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for x in r["rows"]:
            pd = x.get("paired_diff_vs_first")
            pds = f"{pd[0]:+.3f} [{pd[1]:+.3f}, {pd[2]:+.3f}]" if pd else "—"
            cpu = (f"{x['cpu_own_ms']:.0f} / {x['cpu_transfer_ms']:.0f} | {x['cpu_speedup']:.2f}x" if "cpu_own_ms" in x
                   else "— | —")
            print(f"| {x['name']} | `{x['spec']}` | {x['retention']:.3f} [{x['ci'][0]:.3f}, {x['ci'][1]:.3f}] "
                  f"| {pds} | "
                  f"{x['map_macs_per_token']/1e3:.0f}k ({x['map_macs_in_target_layers']:.2f}) | "
                  f"{x['ttft_own_ms']:.0f} / {x['ttft_transfer_ms']:.0f} | "
                  f"{x['speedup']:.2f}x | {cpu} | {x['speedup_alt']:.2f}x | {x['uptime'].split(',')[0]} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="result files written by speed_levers.py (--out)")
    print_tables(parser.parse_args(argv).results)


if __name__ == "__main__":
    main()
