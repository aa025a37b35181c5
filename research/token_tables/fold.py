"""Turn a saved mapper that reads the embeddings (residual layer 0) with token tables into the one the fit now makes
from it: the embedding's part of its maps held in the tables (`fold_residual_into_tables`) and layer 0's keys and
values looked up per token id (`tabulate_first_layer`); `--check` compares the two transfers on held-out prompts.

    python research/token_tables/fold.py --source small --target large IN_DIR OUT_DIR [--no-first-layer] --check 4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "content_at_speed"))
from content_at_speed import load_pair  # noqa: E402

from hf_kvtransfer import KVMapper, TransferredCache, prefill  # noqa: E402
from token_tables_plugin import fold_residual_into_tables, tabulate_first_layer  # noqa: E402  (this folder's plug-in)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", type=Path)
    p.add_argument("output", type=Path)
    p.add_argument("--source", default="small")
    p.add_argument("--target", default="large")
    p.add_argument("--no-first-layer", action="store_true", help="fold only: layer 0 still projected, not looked up")
    p.add_argument("--check", type=int, default=0, help="held-out prompts of 1024 tokens to compare the transfers on")
    args = p.parse_args()
    pair = load_pair(args.source, args.target)
    mapper = KVMapper.from_pretrained(args.input)
    folded = fold_residual_into_tables(mapper, pair.target)
    if not args.no_first_layer:
        folded = tabulate_first_layer(folded, pair.target)
    folded.save_pretrained(args.output)
    print(f"saved {args.output}: {mapper.num_parameters():,} -> {folded.num_parameters():,} parameters")
    stream = pair.tokenizer(pair.heldout, verbose=False)["input_ids"]
    for i in range(args.check):
        ids = torch.tensor(stream[i * 1024 : (i + 1) * 1024]).unsqueeze(0)
        logits, states = [], []
        for m in (mapper, folded):
            cache = TransferredCache(prefill(pair.source, ids), m, model=pair.target)
            with torch.no_grad():
                logits.append(pair.target(ids[:, -cache.num_recompute_tokens :], cache=cache).logits[0, -1])
            states.append(torch.cat([torch.cat((layer.keys, layer.values)).flatten() for layer in cache.layers]))
        print(f"prompt {i}: max |logit difference| {(logits[0] - logits[1]).abs().max():.2e}, max |K/V difference| "
              f"{(states[0] - states[1]).abs().max():.2e}, same greedy token: {bool(logits[0].argmax() == logits[1].argmax())}")


if __name__ == "__main__":
    main()
