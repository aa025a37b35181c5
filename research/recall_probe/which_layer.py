"""Which mapped layer, and which of its keys or values, loses passage recall through a residual-reading transfer.

The target's own prefill cache with one mapped layer's keys, values or both swapped for what `TransferredCache`
computes (all other layers the target's own), scored by greedy accuracy of the answer's first token on passage
recall items (32 recomputed tokens, as the cache's default). One thread.

    python research/recall_probe/which_layer.py --source large --target small --residual-layer 1 --items 200
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_kvtransfer import TransferredCache, fit_mapper, prefill
from hf_kvtransfer.evaluation.tasks import passage_recall_items
from hf_kvtransfer.fitting.calibration_pass import calibration_pass
from hf_kvtransfer.fitting.residual_stats import ResidualStatistics, solve_residual_mapper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "content_at_speed"))
from content_at_speed import load_pair  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="large")
    p.add_argument("--target", default="small")
    p.add_argument("--residual-layer", type=int, default=1)
    p.add_argument("--items", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(1)
    pair = load_pair(args.source, args.target)
    tok, src, tgt, cal = pair.tokenizer, pair.source, pair.target, pair.calibration_rows(128)
    base = fit_mapper(src, tgt, cal[:64], top_k=4, num_exact_layers=1, residual_inputs="off", progress=False)
    j = args.residual_layer
    stats = ResidualStatistics.for_models(src, tgt, [j])
    calibration_pass(src, tgt, cal, consumers=[stats], progress=False)
    mapper = solve_residual_mapper(base, stats, j)
    docs = pair.documents
    items = passage_recall_items(tok, args.items, seed=0, distractor_texts=docs)
    num_layers, r = tgt.config.num_hidden_layers, 32
    swaps = [None] + [(t, k) for t in range(j + 1, num_layers) for k in ("key", "value", "both")] + ["all"]
    correct = {s: 0 for s in swaps}
    with torch.no_grad():
        for it in items:
            ids = torch.tensor([it.prompt_ids])
            held = ids.shape[1] - r
            own = prefill(tgt, ids[:, :held])
            transferred = TransferredCache(prefill(src, ids), mapper, num_recompute_tokens=r, model=tgt)
            tgt(ids[:, -r:], cache=transferred)
            for s in swaps:
                cache = DynamicCache()
                for t in range(num_layers):
                    k, v = own.layers[t].keys, own.layers[t].values
                    tk, tv = transferred.layers[t].keys[:, :, :held], transferred.layers[t].values[:, :, :held]
                    if s == "all" or (s is not None and s[0] == t and s[1] in ("key", "both")):
                        k = tk
                    if s == "all" or (s is not None and s[0] == t and s[1] in ("value", "both")):
                        v = tv
                    cache.update(k.clone(), v.clone(), t)
                correct[s] += int(tgt(ids[:, -r:], cache=cache).logits[0, -1].argmax() == it.answer_ids[0])
    for s, n in correct.items():
        label = "own cache" if s is None else "every mapped layer" if s == "all" else f"layer {s[0]} {s[1]}"
        print(f"{label}: {n / len(items):.3f}")


if __name__ == "__main__":
    main()
