"""Does a probe built from any held-out text predict passage recall through a transfer?

For each variant of one direction of the bundled family, on the same variant: passage-recall retention (the fact
task, `--recompute` tokens left to the target), repeated-span retention (the fit's first probe) and cued-recall
retention (`tasks.cued_recall_items`: records key + shared cue + value of held-out text, the prefix ending with
one record's key and cue; 1 recomputed token), one thread. Question, commands and answer: README.md here.

    python research/recall_probe/recall_probe.py --source large --target small --items 200 \\
        --variants kv:4 kv:2 res:1 res:2 --output /tmp/l2s.json

Variants as in `research/content_at_speed/content_at_speed.py` (`kv:E`, `res:J[:R][:readers][:src]`), a residual
variant optionally with `@LAGS` (e.g. `res:1@0,1,2,3,4,5`: the residual at t .. t-5).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from hf_kvtransfer import fit_mapper
from hf_kvtransfer.evaluation.content import passage_recall, repeated_span_retention
from hf_kvtransfer.evaluation.metrics import retention_over_items
from hf_kvtransfer.evaluation.tasks import cued_recall_items, passage_recall_items, repeated_span_items
from hf_kvtransfer.fitting.calibration_pass import calibration_pass
from hf_kvtransfer.fitting.residual_stats import ResidualStatistics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "content_at_speed"))
from content_at_speed import build, load_pair  # noqa: E402


def parse_lags(variant: str) -> tuple[str, tuple[int, ...]]:
    """`res:1@0,1,2,3` -> (`res:1`, (0, 1, 2, 3)); without `@` the library's lags t, t-1, t-2."""
    body, _, lags = variant.partition("@")
    return body, tuple(int(x) for x in lags.split(",")) if lags else (0, 1, 2)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="small")
    p.add_argument("--target", default="large")
    p.add_argument("--variants", nargs="+", required=True)
    p.add_argument("--items", type=int, default=200)
    p.add_argument("--recompute", type=int, default=None, help="recomputed tokens of the recall items (default: the cache's)")
    p.add_argument("--base-sequences", type=int, default=64)
    p.add_argument("--residual-sequences", type=int, default=128)
    p.add_argument("--output", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    started = time.time()
    pair = load_pair(args.source, args.target)
    tok, source, target, cal = pair.tokenizer, pair.source, pair.target, pair.calibration_ids
    ids = cal[: max(args.base_sequences, args.residual_sequences) * 256].reshape(-1, 256)
    base = fit_mapper(source, target, ids[: args.base_sequences], top_k=4, num_exact_layers=1, progress=False)
    by_lags: dict[tuple[int, ...], set[int]] = {}
    for v in args.variants:
        if v.startswith("res"):
            body, lags = parse_lags(v)
            by_lags.setdefault(lags, set()).add(int(body.split(":")[1]))
    stats = {lags: ResidualStatistics.for_models(source, target, sorted(layers), lags=lags) for lags, layers in by_lags.items()}
    for s in stats.values():
        calibration_pass(source, target, ids[: args.residual_sequences], consumers=[s], progress=False)
    heldout, docs = pair.heldout, pair.documents
    stream = tok(heldout, verbose=False)["input_ids"]
    recall = passage_recall_items(tok, args.items, seed=0, distractor_texts=docs)
    probes = {"spans": repeated_span_items(tok, stream, args.items, seed=0, prefix_len=256, continuation_len=64, kind="text"),
              "cued": cued_recall_items(stream, args.items, seed=0)}  # fmt: skip
    refs = {}
    out = {"source": args.source, "target": args.target, "items": args.items, "recompute": args.recompute, "variants": {}}
    for v in args.variants:
        body, lags = parse_lags(v)
        mapper, num_exact = build(body, base, stats.get(lags))
        row = {}
        with torch.no_grad():
            r = passage_recall(source, target, mapper, recall, num_exact_layers=num_exact, progress=False,
                               num_recompute_tokens=args.recompute)  # fmt: skip
            c = {k: np.asarray(r["correct_per_item"][k], dtype=float) for k in ("own", "transfer", "no_context")}
            row["recall"] = retention_over_items(c["own"], c["transfer"], c["no_context"], higher_is_better=True)
            row["recall_own"] = float(c["own"].mean())
            for name, items in probes.items():
                r = repeated_span_retention(source, target, mapper, items, num_recompute_tokens=1, num_exact_layers=num_exact,
                                            progress=False, reference=refs.get(name))  # fmt: skip
                refs.setdefault(name, r)
                row[name] = {"retention": r["retention"], "retention_ci": r["retention_ci"], "context_gain": r["context_gain"]}
        out["variants"][v] = row
        print(v, {k: f"{row[k]['retention']:.3f} [{row[k]['retention_ci'][0]:.3f}, {row[k]['retention_ci'][1]:.3f}]"
                  for k in ("recall", "spans", "cued")}, f"cued gain {row['cued']['context_gain']['mean']:.2f}",
              f"{time.time() - started:.0f}s", flush=True)  # fmt: skip
    out["seconds"] = time.time() - started
    out["load_average_at_end"] = os.getloadavg()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
