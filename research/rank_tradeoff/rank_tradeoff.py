"""Size and speed against retention: full-rank, reduced-rank and bf16 mappers of one pair, from one statistics pass.

For each mapper spec it reports the parameters and bytes, the floor-normalized perplexity retention on held-out
text (`hf-kvtransfer eval`'s prefix perplexity: windows of 2 x 128 tokens, the target scores the second half on a
cache of the first) and the transfer time at one context length (strip + map + re-apply RoPE for every layer,
median), and writes `tradeoff.json`, `tradeoff.md` and `tradeoff.png` (retention vs bytes, transfer time vs bytes).

    python research/rank_tradeoff/rank_tradeoff.py --output-dir research/rank_tradeoff/results/tradeoff
    python research/rank_tradeoff/rank_tradeoff.py --specs full full@bf16 energy=0.99 16 budget=0.25 --seq-len 4096

Specs are those of `hf-kvtransfer bench --ranks`: full, an integer rank, energy=F, budget=F, each optionally with
@bf16 (weights and GEMMs in bf16, the cache stays float32) and a kN: prefix for another top-k.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_kvtransfer import TransferredCache, collect_statistics, prefill
from hf_kvtransfer.commands.bench import build_mappers, environment, mapper_size
from hf_kvtransfer.fitting.calibration import build_calibration
from hf_kvtransfer.commands.demo import find_family
from hf_kvtransfer.evaluation.evaluate import prefix_perplexity, split_documents, text_windows

DEFAULT_SPECS = ["full", "full@bf16", "energy=0.995", "energy=0.99", "energy=0.99@bf16", "budget=0.5", "32", "16",
                 "budget=0.25", "8", "k2:full", "k1:full"]  # fmt: skip

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument(
    "--family", default=Path(__file__).resolve().parents[2] / "examples" / "family", help="model family directory (default: the bundled one)"
)
parser.add_argument("--direction", choices=["small-to-large", "large-to-small"], default="small-to-large")
parser.add_argument("--specs", nargs="+", default=DEFAULT_SPECS, help="mappers to compare (default: %(default)s)")
parser.add_argument("--top-k", type=int, default=4, help="source layers per target layer (default 4)")
parser.add_argument("--num-sequences", type=int, default=400, help="calibration sequences of 256 tokens (default 400)")
parser.add_argument("--windows", type=int, default=128, help="held-out windows of 2 x 128 tokens (default 128)")
parser.add_argument("--seq-len", type=int, default=4096, help="context length for the transfer time (default 4096)")
parser.add_argument("--repeats", type=int, default=15, help="timing rounds (default 15)")
parser.add_argument("--output-dir", default="tradeoff_results", help="where tradeoff.{json,md,png} go")
args = parser.parse_args()

family = find_family(args.family)
src_name, tgt_name = ("small", "large") if args.direction == "small-to-large" else ("large", "small")
tokenizer = AutoTokenizer.from_pretrained(family / tgt_name)
source = AutoModelForCausalLM.from_pretrained(family / src_name, dtype=torch.float32).eval()
target = AutoModelForCausalLM.from_pretrained(family / tgt_name, dtype=torch.float32).eval()

# One statistics pass; every mapper below is solved from it (no model runs in between).
calibration_ids, info = build_calibration(tokenizer, family / "calibration.txt", num_sequences=args.num_sequences, seq_len=256)
stats = collect_statistics(source, target, calibration_ids, stride=4)
documents = split_documents((family / "heldout.txt").read_text(), tokenizer.eos_token)
docs = [tokenizer(doc, add_special_tokens=False).input_ids for doc in documents]
windows = text_windows(docs, 256, args.windows)
timing_ids = torch.randint(4, tokenizer.vocab_size, (1, args.seq_len), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    timing_cache = prefill(source, timing_ids)


def timed_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


specs = list(dict.fromkeys(args.specs))  # one mapper per distinct spec, in the order given
solved, _ = build_mappers(source, target, specs, top_k=args.top_k, statistics=stats)
rows, mappers = [], list(solved.values())
for spec, mapper in zip(specs, mappers):
    quality = prefix_perplexity(source, target, mapper, windows, 128, diagnostics=False, progress=False)
    size = mapper_size(mapper)  # parameters, bytes, dtype, rank, top_k
    rows.append({
        "spec": spec, **{key: size[key] for key in ("top_k", "parameters", "bytes", "dtype", "rank")},
        "normalized_retention": quality["normalized_retention"], "normalized_retention_ci": quality["normalized_retention_ci"],
    })  # fmt: skip
    print(f"{spec:>18}: {rows[-1]['parameters']:>9,} parameters, retention {100 * quality['normalized_retention']:.1f}%", flush=True)

# Timing round-robin (every mapper once per round, the target's prefill every round too), so drifting machine
# load hits all of them alike; medians over rounds.
converts = [lambda m=m: TransferredCache(timing_cache, m, num_recompute_tokens=0, num_exact_layers=0).convert_all() for m in mappers]
own = lambda: prefill(target, timing_ids)  # noqa: E731
times: list[list[float]] = [[] for _ in mappers]
own_times: list[float] = []
with torch.no_grad():
    for fn in [own, *converts]:
        fn()  # warm-up
    for _ in range(args.repeats):
        own_times.append(timed_ms(own))
        for i, fn in enumerate(converts):
            times[i].append(timed_ms(fn))
prefill_ms = statistics.median(own_times)
for row, t in zip(rows, times):
    row["transfer_ms"] = statistics.median(t)
    print(f"{row['spec']:>18}: transfer {row['transfer_ms']:.1f} ms at T={args.seq_len}", flush=True)

base = rows[0]
report = {
    "command": " ".join([Path(sys.executable).name, *sys.argv]),
    "direction": args.direction, "seq_len": args.seq_len, "target_prefill_body_ms": prefill_ms,
    "calibration": info, "num_windows": int(windows.shape[0]), "environment": environment(), "rows": rows,
}  # fmt: skip
lines = [
    f"{args.direction}, retention on {windows.shape[0]} held-out windows of 2 x 128 tokens; transfer at T={args.seq_len}, "
    f"medians of {args.repeats} rounds (every mapper and the target's prefill once per round); target prefill (body) "
    f"{prefill_ms:.1f} ms; torch threads {torch.get_num_threads()}, "
    f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}.",
    "",
    "| mapper | parameters | bytes (x smaller) | retention [95% CI] | vs first (pp) | transfer ms (x faster than prefill) |",
    "|---|---:|---:|---|---:|---:|",
]
for row in rows:
    lo, hi = row["normalized_retention_ci"]
    lines.append(
        f"| {row['spec']} | {row['parameters']:,} | {row['bytes'] / 2**10:.0f} KiB ({base['bytes'] / row['bytes']:.1f}x) | "
        f"{100 * row['normalized_retention']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] | "
        f"{100 * (row['normalized_retention'] - base['normalized_retention']):+.1f} | "
        f"{row['transfer_ms']:.1f} ({prefill_ms / row['transfer_ms']:.1f}x) |"
    )
out = Path(args.output_dir)
out.mkdir(parents=True, exist_ok=True)
(out / "tradeoff.json").write_text(json.dumps(report, indent=2) + "\n")
(out / "tradeoff.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))

try:
    import matplotlib

    matplotlib.use("Agg")  # written to a file, never shown
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit(f"tables written to {out}; the plot needs matplotlib: pip install 'hf-kvtransfer[plot]'")
fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
for row in rows:
    kib = row["bytes"] / 2**10
    marker = "s" if row["dtype"] == "bfloat16" else "o"
    axes[0].errorbar(kib, 100 * row["normalized_retention"], marker=marker, capsize=2,
                     yerr=[[100 * (row["normalized_retention"] - row["normalized_retention_ci"][0])],
                           [100 * (row["normalized_retention_ci"][1] - row["normalized_retention"])]])  # fmt: skip
    axes[0].annotate(row["spec"], (kib, 100 * row["normalized_retention"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    axes[1].plot(kib, row["transfer_ms"], marker)
    axes[1].annotate(row["spec"], (kib, row["transfer_ms"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
axes[0].axhline(100 * (base["normalized_retention"] - 0.01), color="grey", ls="--", lw=0.8, label=f"{base['spec']} - 1 pp")
axes[0].set(xscale="log", xlabel="mapper size (KiB)", ylabel="floor-normalized retention (%)", title=args.direction)
axes[0].legend(fontsize=8)
axes[1].axhline(prefill_ms / 25, color="grey", ls="--", lw=0.8, label="target prefill / 25")
axes[1].set(xscale="log", xlabel="mapper size (KiB)", ylabel=f"transfer ms at T={args.seq_len}", title="o float32, s bf16")
axes[1].legend(fontsize=8)
for ax in axes:
    ax.grid(True, which="both", alpha=0.3)
fig.tight_layout()
fig.savefig(out / "tradeoff.png", dpi=120)
print(f"results in {out}/tradeoff.{{json,md,png}}")
