"""Time to the first token of saved mappers at their own defaults (exact layers, recomputed tokens), next to the
target's own prefill, timed in interleaved rounds in one process: each round times the own prefill and every
mapper's transfer once, at each prompt length; medians of wall and process CPU time, ratios own / transfer.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python research/token_tables/ttft.py --source small --target large \\
        --mappers DIR_A DIR_B --lengths 512 1024 4096 --rounds 15 [--recompute-tokens 32] --output results/ttft.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "content_at_speed"))
from content_at_speed import load_pair  # noqa: E402

import token_tables_plugin  # noqa: E402, F401  (this folder's plug-in: mappers with tables load)
from hf_kvtransfer import KVMapper, TransferredCache, prefill  # noqa: E402
from hf_kvtransfer.evaluation.timing import time_call  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="small")
    p.add_argument("--target", default="large")
    p.add_argument("--mappers", nargs="+", required=True, help="saved mapper directories, timed at their defaults")
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 4096])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--recompute-tokens", type=int, nargs="*", default=[],
                   help="also time every mapper with these recomputed tokens (besides the cache's default)")
    p.add_argument("--output", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    pair = load_pair(args.source, args.target)
    mappers = {d: KVMapper.from_pretrained(d) for d in args.mappers}
    stream = pair.tokenizer(pair.heldout, verbose=False)["input_ids"]
    result = {"threads": 1, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "rounds": args.rounds,
              "load_average_before": os.getloadavg(), "lengths": {}}  # fmt: skip
    for n in args.lengths:
        ids = torch.tensor(stream[:n]).unsqueeze(0)
        src_cache = prefill(pair.source, ids)

        def own():
            pair.target(ids, use_cache=True, logits_to_keep=1)

        def transfer(m, r=None):
            cache = TransferredCache(src_cache, m, num_recompute_tokens=r, model=pair.target)
            pair.target(ids[:, -cache.num_recompute_tokens:], use_cache=True, logits_to_keep=1, cache=cache)

        runs = {d: (m, None) for d, m in mappers.items()}
        runs.update({f"{d}@r={r}": (m, r) for d, m in mappers.items() for r in args.recompute_tokens})
        calls = {"own": own, **{d: (lambda m=m, r=r: transfer(m, r)) for d, (m, r) in runs.items()}}
        times = {name: ([], []) for name in calls}
        with torch.no_grad():
            for fn in calls.values():  # warm-up
                fn()
            for _ in range(args.rounds):
                for name, fn in calls.items():
                    wall, cpu = time_call(fn, "cpu", repeats=1, warmup=0)
                    times[name][0].append(wall[0])
                    times[name][1].append(cpu[0])
        med = {name: (1e3 * statistics.median(w), 1e3 * statistics.median(c)) for name, (w, c) in times.items()}
        row = {"own_ms": med["own"][0], "own_cpu_ms": med["own"][1], "mappers": {}}
        for d, (m, r) in runs.items():
            used = TransferredCache(src_cache, m, num_recompute_tokens=r).num_recompute_tokens
            row["mappers"][d] = {"num_exact_layers": m.num_exact_layers, "num_recompute_tokens": used, "transfer_ms": med[d][0],
                                 "transfer_cpu_ms": med[d][1], "speedup": med["own"][0] / med[d][0],
                                 "speedup_cpu": med["own"][1] / med[d][1]}  # fmt: skip
            print(f"{n} tokens, {d}: own {med['own'][0]:.1f} ms, transfer {med[d][0]:.1f} ms ({med['own'][0] / med[d][0]:.2f}x wall, "
                  f"{med['own'][1] / med[d][1]:.2f}x CPU), {m.num_exact_layers} exact layers, {used} recomputed tokens", flush=True)
        result["lengths"][str(n)] = row
    result["load_average_after"] = os.getloadavg()
    if args.output:
        args.output.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
