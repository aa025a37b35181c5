"""Where the time to the first token of a transfer goes, at a saved mapper's defaults, next to the target's own
prefill: the cache's construction, the exact pass (the target's first layers on the prompt), the maps of the other
layers, and the forward of the recomputed tokens over the converted cache. Each round times the own prefill, the
whole transfer (layers converted lazily inside the target's forward, as `generate` does) and the same transfer in
stages (`compute_exact_layers`, `convert_all`, then the forward), at each prompt length; medians of wall and process
CPU time over interleaved rounds, one thread. The last columns are the speed-ups left if a stage cost nothing.
`floor` is the target's forward of the recomputed tokens alone (no cache): what those tokens cost whatever the
context, so `speedup_cpu_bound` (own prefill over exact pass + floor) is the most any cheaper maps and attention
could give at these exact layers and recomputed tokens. `one_token` is the target's forward of the prompt's last
token alone: what any forward of the target costs whatever its tokens (the layers' fixed cost on this machine).
Each length also records the FLOPs of the own prefill and of each stage (`flops.mapper_first_token`, transformer
bodies: what the transfer computes, counted from the shapes), and the speed-up they predict (`speedup_flops`).

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python research/content_at_speed/time_split.py --source small \\
        --target large --mapper DIR --lengths 512 1024 4096 --rounds 15 [--recompute-tokens 1] \\
        [--also NAME=DIR ...] --output results/time_split_s2l.json

`--compile-target` times everything with the target's forward compiled (`torch.compile(target.forward,
dynamic=True)`, compiled again for each length with room for every variant timed: otherwise dynamo's recompile limit
leaves some of them eager; two warm-up rounds): the own prefill, the recomputed tokens' forward and `floor` /
`one_token` traced, the exact pass (the target's first layers called directly) and the maps eager.

`--also` times other mappers' whole transfers (at their own defaults) in the same interleaved rounds, so their
speed-ups are paired with the first mapper's (`speedup_cpu_NAME`).

DIR is a mapper fit at the defaults: `python research/token_tables/fit_pair.py small large 512 DIR`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from content_at_speed import FAMILY, load_pair

from hf_kvtransfer import KVMapper, TransferredCache, prefill
from hf_kvtransfer.core.flops import mapper_first_token

STAGES = ("construct", "exact", "maps", "recomputed")


def clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", type=Path, default=FAMILY, help="family directory (default: examples/family)")
    p.add_argument("--source", default="small")
    p.add_argument("--target", default="large")
    p.add_argument("--mapper", required=True, help="a saved mapper directory, timed at its defaults")
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 4096])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--recompute-tokens", type=int, nargs="*", default=[],
                   help="also time the whole transfer with these recomputed tokens (besides the cache's default)")
    p.add_argument("--also", nargs="*", default=[], metavar="NAME=DIR",
                   help="other mappers whose whole transfer is timed in the same rounds")
    p.add_argument("--compile-target", action="store_true", help="time with the target's forward compiled")
    p.add_argument("--output", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    pair = load_pair(args.source, args.target, args.family)
    if args.compile_target:
        torch._dynamo.config.recompile_limit = 64
        pair.target.forward = torch.compile(pair.target.forward, dynamic=True)
    mapper = KVMapper.from_pretrained(args.mapper)
    also = {name: KVMapper.from_pretrained(path) for name, path in (item.split("=", 1) for item in args.also)}
    target = pair.target
    stream = pair.tokenizer(pair.heldout, verbose=False)["input_ids"]
    result = {"family": str(args.family), "source": args.source, "target": args.target, "mapper": args.mapper,
              "threads": 1, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "rounds": args.rounds,
              "also": dict(item.split("=", 1) for item in args.also), "compile_target": args.compile_target,
              "load_average_before": os.getloadavg(), "lengths": {}}  # fmt: skip
    for n in args.lengths:
        torch._dynamo.reset()
        ids = torch.tensor(stream[:n]).unsqueeze(0)
        src_cache = prefill(pair.source, ids)
        others = [f"transfer@{r}" for r in args.recompute_tokens] + list(also)
        times: dict[str, list[tuple[float, float]]] = {
            k: [] for k in ("own", "transfer", *others, *STAGES, "floor", "one_token")
        }

        def own():
            target(ids, use_cache=True, logits_to_keep=1)

        recomputed = ids[:, -TransferredCache(src_cache, mapper).num_recompute_tokens :]

        def floor():
            target(recomputed, use_cache=True, logits_to_keep=1)

        def one_token():
            target(ids[:, -1:], use_cache=True, logits_to_keep=1)

        def transfer(recompute: int | None = None, with_mapper=mapper):
            cache = TransferredCache(src_cache, with_mapper, num_recompute_tokens=recompute, model=target)
            target(ids[:, -cache.num_recompute_tokens :], use_cache=True, logits_to_keep=1, cache=cache)

        def staged() -> list[tuple[float, float]]:
            marks = [clocks()]
            cache = TransferredCache(src_cache, mapper, model=target)
            marks.append(clocks())
            cache.compute_exact_layers(target)
            marks.append(clocks())
            cache.convert_all()
            marks.append(clocks())
            target(ids[:, -cache.num_recompute_tokens :], use_cache=True, logits_to_keep=1, cache=cache)
            marks.append(clocks())
            return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks, marks[1:])]

        calls = [("own", own), ("transfer", transfer), ("floor", floor), ("one_token", one_token)]
        calls += [(name, lambda r=r: transfer(r)) for name, r in zip(others, args.recompute_tokens)]
        calls += [(name, lambda m=m: transfer(with_mapper=m)) for name, m in also.items()]
        with torch.no_grad():
            for _ in range(2 if args.compile_target else 1):  # warm-up (compiling: its recompiles too)
                for _, fn in calls:
                    fn()
                staged()
            for _ in range(args.rounds):
                for name, fn in calls:
                    start = clocks()
                    fn()
                    end = clocks()
                    times[name].append((end[0] - start[0], end[1] - start[1]))
                for name, spent in zip(STAGES, staged()):
                    times[name].append(spent)
        med = {k: tuple(1e3 * statistics.median(t[i] for t in v) for i in (0, 1)) for k, v in times.items()}
        used = TransferredCache(src_cache, mapper)
        row = {k: {"wall_ms": w, "cpu_ms": c} for k, (w, c) in med.items()}
        row["num_exact_layers"], row["num_recompute_tokens"] = used.num_exact_layers, used.num_recompute_tokens
        row["also_num_exact_layers"] = {name: TransferredCache(src_cache, m).num_exact_layers for name, m in also.items()}
        total = sum(med[s][1] for s in STAGES)
        row["stages_sum_cpu_ms"] = total
        row["speedup_cpu"] = med["own"][1] / med["transfer"][1]
        # What the own prefill over the staged transfer would be with one stage free (CPU time: robust to load).
        row["speedup_cpu_if_free"] = {s: med["own"][1] / (total - med[s][1]) for s in STAGES}
        row["speedup_cpu_bound"] = med["own"][1] / (med["exact"][1] + med["floor"][1])
        def by_flops(m: KVMapper, recompute: int | None = None) -> dict[str, int]:
            return mapper_first_token(m, (n,), recompute)[n]

        flops = by_flops(mapper)
        row["flops"] = flops
        row["speedup_flops"] = flops["own_prefill"] / flops["total"]
        for name, r in zip(others, args.recompute_tokens):
            row[f"speedup_flops_{name}"] = flops["own_prefill"] / by_flops(mapper, r)["total"]
        for name, m in also.items():
            row[f"speedup_flops_{name}"] = flops["own_prefill"] / by_flops(m)["total"]
        for name in others:
            row[f"speedup_cpu_{name}"] = med["own"][1] / med[name][1]
        result["lengths"][str(n)] = row
        print(f"{n} tokens ({used.num_exact_layers} exact layers, {used.num_recompute_tokens} recomputed tokens): own "
              f"{med['own'][1]:.1f} ms, transfer {med['transfer'][1]:.1f} ms ({row['speedup_cpu']:.2f}x); stages "
              + ", ".join(f"{s} {med[s][1]:.1f}" for s in STAGES) + f" ms (sum {total:.1f}); speed-up if free: "
              + ", ".join(f"{s} {v:.2f}x" for s, v in row["speedup_cpu_if_free"].items())
              + f"; floor {med['floor'][1]:.1f} ms, bound {row['speedup_cpu_bound']:.2f}x"
              + f"; one token {med['one_token'][1]:.1f} ms; by FLOPs {row['speedup_flops']:.2f}x"
              + "".join(f"; {name} {med[name][1]:.1f} ms ({row[f'speedup_cpu_{name}']:.2f}x)" for name in others)
              + "  [CPU time]", flush=True)  # fmt: skip
    result["load_average_after"] = os.getloadavg()
    if args.output:
        args.output.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
