"""Markdown tables from speed_levers.py results: python table.py results/*.json"""
import json, sys
for fn in sys.argv[1:]:
    r = json.load(open(fn))
    a = r["args"]
    print(f"\n**{fn.split('/')[-1]}** — {r['pair']}, {a['n_win']} windows, {a['n_cal']}x256 calibration tokens, "
          f"TTFT at {a['ttft_len']} tokens, {a['ttft_repeats']} interleaved repeats; own NLL {r['own_nll']:.3f}, "
          f"floor {r['floor_nll']:.3f}; one target layer = {r['target_layer_macs_per_token']/1e3:.0f}k MACs/token; "
          f"started {r['date']} ({r['uptime_start'].split('load average:')[-1].strip()} load)\n")
    print("| variant | spec | retention [95% CI] | paired diff vs first row [CI] | map MACs/token (target layers) | wall own / transfer ms, R=32 | speed-up wall R=32 | CPU own / transfer ms, R=32 | speed-up CPU R=32 | speed-up wall R=1 | load (1 min) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for x in r["rows"]:
        pd = x.get("paired_diff_vs_first")
        pds = f"{pd[0]:+.3f} [{pd[1]:+.3f}, {pd[2]:+.3f}]" if pd else "—"
        cpu = f"{x['cpu_own_ms']:.0f} / {x['cpu_transfer_ms']:.0f} | {x['cpu_speedup']:.2f}x" if "cpu_own_ms" in x else "— | —"
        print(f"| {x['name']} | `{x['spec']}` | {x['retention']:.3f} [{x['ci'][0]:.3f}, {x['ci'][1]:.3f}] | {pds} | "
              f"{x['map_macs_per_token']/1e3:.0f}k ({x['map_macs_in_target_layers']:.2f}) | {x['ttft_own_ms']:.0f} / {x['ttft_transfer_ms']:.0f} | "
              f"{x['speedup']:.2f}x | {cpu} | {x['speedup_alt']:.2f}x | {x['uptime'].split(',')[0]} |")
