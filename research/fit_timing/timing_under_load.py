"""Does the fit's timing choice survive another process on the machine? Two saved mappers are timed as the fit
times its candidates (time to the first token on the first 512 held-out tokens, one thread, interleaved rounds of
5, each call after one warm-up), in several trials, first with the machine otherwise idle, then with `--load`
busy processes (one-thread matrix products) started by this script. Each trial's choice is made by the wall
clock's medians and by process CPU time's; a choice is right when it names the mapper that is faster on the idle
machine over all its trials.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python research/fit_timing/timing_under_load.py \\
        --mappers research/token_tables/results/mappers/small_to_large_tables_922 \\
                  research/token_tables/results/mappers/small_to_large_tables_1843 \\
        --trials 12 --load 2 --output research/fit_timing/results/small_to_large.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "content_at_speed"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "token_tables"))
from content_at_speed import load_pair  # noqa: E402

import token_tables_plugin  # noqa: E402, F401  (research/token_tables's plug-in: the mappers with tables load)

from hf_kvtransfer import KVMapper  # noqa: E402
from hf_kvtransfer.evaluation.timing import time_to_first_token  # noqa: E402

BUSY = "import torch, time, sys\ntorch.set_num_threads(1)\na = torch.randn({n}, {n})\nwhile True:\n    a @ a\n"


def trial(pair, mappers, ids, rounds):
    times = {name: {"wall": [], "cpu": []} for name in mappers}
    for _ in range(rounds):
        for name, m in mappers.items():
            t = time_to_first_token(pair.source, pair.target, m, ids, repeats=1, measure_own=False)
            times[name]["wall"].append(t["transfer_ms"])
            times[name]["cpu"].append(t["transfer_cpu_ms"])
    return times


def run(pair, mappers, ids, trials, rounds, label):
    out = []
    for i in range(trials):
        times = trial(pair, mappers, ids, rounds)
        med = {clock: {n: statistics.median(t[clock]) for n, t in times.items()} for clock in ("wall", "cpu")}
        row = {"times": times, "load_average": os.getloadavg()[0],
               "choice": {clock: min(med[clock], key=med[clock].get) for clock in med}}  # fmt: skip
        out.append(row)
        print(f"{label} trial {i}: load {row['load_average']:.2f}; " + "; ".join(
            f"{c}: " + ", ".join(f"{Path(n).name} {v:.1f}" for n, v in med[c].items()) for c in med), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="small")
    p.add_argument("--target", default="large")
    p.add_argument("--mappers", nargs=2, required=True)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--load", type=int, default=2, help="busy processes beside the loaded trials")
    p.add_argument("--load-size", type=int, default=768, help="matrix size of each busy process")
    p.add_argument("--output", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    pair = load_pair(args.source, args.target)
    mappers = {d: KVMapper.from_pretrained(d) for d in args.mappers}
    stream = pair.tokenizer(pair.heldout, verbose=False)["input_ids"]
    ids = torch.tensor(stream[: args.tokens]).unsqueeze(0)
    started = time.time()
    with torch.no_grad():
        idle = run(pair, mappers, ids, args.trials, args.rounds, "idle")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        busy = [subprocess.Popen([sys.executable, "-c", BUSY.format(n=args.load_size)], env=env) for _ in range(args.load)]
        try:
            time.sleep(2)
            loaded = run(pair, mappers, ids, args.trials, args.rounds, f"{args.load} busy")
        finally:
            for proc in busy:
                proc.kill()
    pooled = {n: statistics.median([v for row in idle for v in row["times"][n]["cpu"]]) for n in mappers}
    truth = min(pooled, key=pooled.get)
    summary = {
        clock: {"idle_right": sum(r["choice"][clock] == truth for r in idle), "loaded_right": sum(r["choice"][clock] == truth for r in loaded)}
        for clock in ("wall", "cpu")
    }  # fmt: skip
    print(f"faster when idle: {Path(truth).name} ({', '.join(f'{Path(n).name} {v:.1f} ms' for n, v in pooled.items())}); "
          f"right choices of {args.trials} trials: " + "; ".join(f"{c}: idle {s['idle_right']}, loaded {s['loaded_right']}"
                                                             for c, s in summary.items()) + f"; {time.time() - started:.0f} s")  # fmt: skip
    if args.output:
        args.output.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "truth": truth,
                                           "idle_ms": pooled, "summary": summary, "idle": idle, "loaded": loaded},
                                          indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
