"""Ablation: the target's first layers computed by the target itself (`num_exact_layers`) vs mapped, on the bundled
family, paired over the same held-out windows (prefix-conditioned perplexity, floor-normalized retention).

    OMP_WAIT_POLICY=PASSIVE python research/exact_layers_ablation/exact_layers_ablation.py --windows 660 --json exact_layers.json

Windows are 2 x 128 tokens taken every 128 tokens of heldout.txt (overlapping, so >= 600 fit in it); CIs are
bootstrap 95% over windows, and the difference is bootstrapped on the same windows (paired).
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_kvtransfer import collect_statistics, solve_mapper
from hf_kvtransfer.fitting.calibration import build_calibration
from hf_kvtransfer.evaluation.evaluate import prefix_perplexity, split_documents

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--family", default=Path(__file__).resolve().parents[2] / "examples" / "family", type=Path)
parser.add_argument("--windows", type=int, default=660)
parser.add_argument("--prefix-len", type=int, default=128)
parser.add_argument("--top-k", type=int, default=4)
parser.add_argument("--exact", type=int, nargs="+", default=[0, 1, 2])
parser.add_argument("--num-sequences", type=int, default=400)
parser.add_argument("--json", type=Path)
args = parser.parse_args()

tok = AutoTokenizer.from_pretrained(args.family / "large")
models = {n: AutoModelForCausalLM.from_pretrained(args.family / n, dtype=torch.float32).eval() for n in ("small", "large")}
calib, _ = build_calibration(
    tok, str(args.family / "calibration.txt"), dataset_config=None, num_sequences=args.num_sequences, seq_len=256
)
docs = [tok(d, add_special_tokens=False).input_ids for d in split_documents((args.family / "heldout.txt").read_text())]
window, step = 2 * args.prefix_len, args.prefix_len
rows = [doc[i : i + window] for doc in docs for i in range(0, len(doc) - window + 1, step)]
keep = np.linspace(0, len(rows) - 1, min(args.windows, len(rows))).round().astype(int)
windows = torch.tensor([rows[i] for i in keep])

report = {"windows": len(windows), "prefix_len": args.prefix_len, "top_k": args.top_k, "pairs": {}}
for src, tgt in (("small", "large"), ("large", "small")):
    stats = collect_statistics(models[src], models[tgt], calib, progress=False)
    mapper = solve_mapper(stats, top_k=min(args.top_k, stats.source_layout.num_layers))
    per_window, rows_out = {}, {}
    for n in args.exact:
        r = prefix_perplexity(models[src], models[tgt], mapper, windows, diagnostics=False, num_exact_layers=n, progress=False)
        rows_out[n] = {k: r[k] for k in ("normalized_retention", "normalized_retention_ci", "perplexity")}
        per_window[n] = r
        print(f"{src}->{tgt} exact={n}: retention {100 * r['normalized_retention']:.1f}% "
              f"[{100 * r['normalized_retention_ci'][0]:.1f}, {100 * r['normalized_retention_ci'][1]:.1f}] "
              f"ppl own/transfer/floor {r['perplexity']['target']:.2f}/{r['perplexity']['transfer']:.2f}/{r['perplexity']['floor']:.2f}", flush=True)
    # paired bootstrap of the retention difference against exact=0, on the same windows
    base = {k: np.array(v) for k, v in per_window[args.exact[0]]["nll_per_window"].items()}
    rng = np.random.default_rng(0)
    draws = [rng.integers(0, len(windows), len(windows)) for _ in range(1000)]

    def retention(nll, idx):
        floor, own, trans = nll["floor"][idx].mean(), nll["target"][idx].mean(), nll["transfer"][idx].mean()
        return (floor - trans) / (floor - own)

    for n in args.exact[1:]:
        other = {k: np.array(v) for k, v in per_window[n]["nll_per_window"].items()}
        diffs = np.array([retention(other, i) - retention(base, i) for i in draws])
        full = retention(other, slice(None)) - retention(base, slice(None))
        rows_out[n]["difference_vs_first"] = [float(full), *map(float, np.percentile(diffs, [2.5, 97.5]))]
        print(f"  exact={n} minus exact={args.exact[0]}: {100 * full:+.1f} pp "
              f"[{100 * np.percentile(diffs, 2.5):+.1f}, {100 * np.percentile(diffs, 97.5):+.1f}] (paired)", flush=True)
    report["pairs"][f"{src}->{tgt}"] = rows_out
if args.json:
    args.json.write_text(json.dumps(report, indent=2, default=float) + "\n")
