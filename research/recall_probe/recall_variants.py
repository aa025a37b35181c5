"""Passage recall (greedy first answer token) through `TransferredCache` for residual-mapper variants, fast.

    python research/recall_probe/recall_variants.py --source small --target large --items 200 --recompute 32 \\
        "2;0,1,2;all;" "2;0,1,2;3;" "2;0,1,2;all;3=3|4=3|5=3|6=3|7=3"

A variant is `J;LAGS;READERS;SOURCES`: residual layer J (J + 1 exact layers), lags, the reader layers (`all`, or
comma-separated), and `|`-separated per-layer sources `t=all|none|s,s` (default: the fit's top 4). Prints the own
accuracy first, then each variant's, with the residual's in-sample R^2 gain per mapped layer
(`residual_stats.residual_r2_gain`). One thread.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from hf_kvtransfer import TransferredCache, fit_mapper, prefill
from hf_kvtransfer.evaluation.tasks import passage_recall_items
from hf_kvtransfer.fitting.calibration_pass import calibration_pass
from hf_kvtransfer.fitting.residual_stats import ResidualStatistics, residual_r2_gain, solve_residual_mapper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "content_at_speed"))
from content_at_speed import load_pair  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="small")
    p.add_argument("--target", default="large")
    p.add_argument("--items", type=int, default=200)
    p.add_argument("--recompute", type=int, default=32, help="prompt tokens the target recomputes")
    p.add_argument("variants", nargs="+")
    args = p.parse_args()
    torch.set_num_threads(1)
    pair = load_pair(args.source, args.target)
    tok, src, tgt, cal = pair.tokenizer, pair.source, pair.target, pair.calibration_rows(128)
    base = fit_mapper(src, tgt, cal[:64], top_k=4, num_exact_layers=1, residual_inputs="off", progress=False)
    num_source = src.config.num_hidden_layers
    stats: dict = {}
    docs = pair.documents
    items = passage_recall_items(tok, args.items, seed=0, distractor_texts=docs)

    def accuracy(mapper, num_exact):
        ok = 0
        with torch.no_grad():
            for it in items:
                ids = torch.tensor([it.prompt_ids])
                cache = TransferredCache(prefill(src, ids), mapper, num_recompute_tokens=args.recompute, num_exact_layers=num_exact, model=tgt)
                ok += int(tgt(ids[:, -args.recompute :], cache=cache).logits[0, -1].argmax() == it.answer_ids[0])
        return ok / len(items)

    print("own", accuracy(base, tgt.config.num_hidden_layers), flush=True)
    for spec in args.variants:
        j, lags, readers, sources_spec = spec.split(";")
        j, lags = int(j), tuple(int(x) for x in lags.split(","))
        readers = None if readers == "all" else [int(x) for x in readers.split(",")]
        sources = {}
        for part in filter(None, sources_spec.split("|")):
            t, v = part.split("=")
            sources[int(t)] = list(range(num_source)) if v == "all" else [] if v == "none" else [int(x) for x in v.split(",")]
        if (j, lags) not in stats:
            stats[(j, lags)] = ResidualStatistics.for_models(src, tgt, [j], lags=lags)
            calibration_pass(src, tgt, cal, consumers=[stats[(j, lags)]], progress=False)
        mapper = solve_residual_mapper(base, stats[(j, lags)], j, readers=readers, sources=sources)
        gain = {t: round(g, 3) for t, g in residual_r2_gain(base, stats[(j, lags)], j).items()}
        print(spec, accuracy(mapper, j + 1), "R^2 gain", gain, flush=True)


if __name__ == "__main__":
    main()
