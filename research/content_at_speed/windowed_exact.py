"""A lever for the exact pass at long prompts: its layers attend only to a local window of the context.

At 4096 tokens most of an exact layer's FLOPs are its attention over the whole prompt (on the deep pair's target:
about 73% of a layer). The recomputed tokens at the end of the prompt (the question, in the content tasks) still
attend to every earlier token in every layer; only the exact pass over the context is windowed. Whether the content
survives is measured, not assumed: passage recall and hand-off through the transfer with the windowed exact pass,
paired item by item against the same transfer with the exact pass whole and against the target's own answers.

The window is the library's (`MapperConfig.exact_window`, `hf_kvtransfer/core/local_attention.py`); this script sets
it on a saved mapper (`fitting.exact_window.with_window`; 0 below: the whole prompt) whatever the mapper records, to
measure each window against the whole pass. The fit chooses a window by its own content gate.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python research/content_at_speed/windowed_exact.py \\
        --family examples/family_deep --source source --target target --mapper DIR --windows 64 256 \\
        --items 600 --lengths 1024 4096 --rounds 9 --output FILE
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

from content_at_speed import FAMILY, load_pair
from hf_kvtransfer import KVMapper, TransferredCache, prefill
from hf_kvtransfer.evaluation.content import handoff, passage_recall
from hf_kvtransfer.evaluation.evaluate import split_documents
from hf_kvtransfer.evaluation.tasks import handoff_items, passage_recall_items
from hf_kvtransfer.fitting.exact_window import with_window


def paired(a: list[float], b: list[float], seed: int = 0, resamples: int = 2000) -> dict:
    """Mean of b - a per item, with a percentile bootstrap 95% interval (in points)."""
    d = [100 * (y - x) for x, y in zip(a, b)]
    rng = random.Random(seed)
    boots = sorted(statistics.mean(rng.choices(d, k=len(d))) for _ in range(resamples))
    return {"mean": statistics.mean(d), "ci": [boots[int(0.025 * resamples)], boots[int(0.975 * resamples) - 1]]}


def content(pair, mapper, windows, items: int) -> dict:
    """Passage recall and hand-off (eval's items and scoring): the transfer with the exact pass whole and windowed,
    each paired against the target's own answers and the windowed ones against the whole exact pass."""
    docs = split_documents(pair.heldout, pair.tokenizer.eos_token)
    tasks = {"recall": (passage_recall, passage_recall_items), "handoff": (handoff, handoff_items)}
    out = {}
    for task, (score, make) in tasks.items():
        batch = make(pair.tokenizer, items, seed=0, distractor_texts=docs)
        base = score(pair.source, pair.target, with_window(mapper, None), batch, progress=False, seed=0)
        own, whole = base["correct_per_item"]["own"], base["correct_per_item"]["transfer"]
        rows = {"whole": {"accuracy": 100 * statistics.mean(whole), "minus_own": paired(own, whole)}}
        for w in windows:
            r = score(pair.source, pair.target, with_window(mapper, w), batch, progress=False, seed=0, reference=base)
            t = r["correct_per_item"]["transfer"]
            rows[f"window {w}"] = {"accuracy": 100 * statistics.mean(t), "minus_own": paired(own, t),
                                   "minus_whole": paired(whole, t)}  # fmt: skip
        out[task] = {"own_accuracy": 100 * statistics.mean(own), "items": len(batch), "rows": rows}
        print(task, {k: (round(v["accuracy"], 1), round(v["minus_own"]["mean"], 1)) for k, v in rows.items()},
              flush=True)  # fmt: skip
    return out


def speed(pair, mapper, windows, lengths, rounds: int) -> dict:
    """Time to the first token, own prefill vs the transfer with the exact pass whole and windowed (process CPU
    time, interleaved rounds, medians), and the exact pass alone."""
    stream = pair.tokenizer(pair.heldout, verbose=False)["input_ids"]
    out = {}
    for n in lengths:
        ids = torch.tensor(stream[:n]).unsqueeze(0)
        src = prefill(pair.source, ids)
        recompute = TransferredCache(src, mapper).num_recompute_tokens

        def own():
            pair.target(ids, use_cache=True, logits_to_keep=1)

        def transfer(w):
            cache = TransferredCache(src, mapper, exact_window=w, model=pair.target)
            start = time.process_time()
            cache.compute_exact_layers(pair.target)
            exact = time.process_time() - start
            pair.target(ids[:, -recompute:], use_cache=True, logits_to_keep=1, cache=cache)
            return exact

        calls = {"own": lambda: own(), "whole": lambda: transfer(0)}
        calls.update({f"window {w}": (lambda w=w: transfer(w)) for w in windows})
        times = {k: [] for k in calls}
        exact = {k: [] for k in calls if k != "own"}
        with torch.no_grad():
            for fn in calls.values():
                fn()
            for _ in range(rounds):
                for k, fn in calls.items():
                    start = time.process_time()
                    e = fn()
                    times[k].append(1e3 * (time.process_time() - start))
                    if k in exact:
                        exact[k].append(1e3 * e)
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"own_ms": med["own"], "recomputed_tokens": recompute,
               "transfer_ms": {k: v for k, v in med.items() if k != "own"},
               "exact_pass_ms": {k: statistics.median(v) for k, v in exact.items()},
               "speedup": {k: med["own"] / v for k, v in med.items() if k != "own"}}  # fmt: skip
        out[str(n)] = row
        print(n, {k: round(v, 2) for k, v in row["speedup"].items()},
              {k: round(v, 1) for k, v in row["exact_pass_ms"].items()}, flush=True)  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", type=Path, default=FAMILY)
    p.add_argument("--source", default="small")
    p.add_argument("--target", default="large")
    p.add_argument("--mapper", required=True, help="a saved mapper directory, used at its defaults but the window")
    p.add_argument("--windows", nargs="+", type=int, default=[64, 256], help="windows in tokens")
    p.add_argument("--items", type=int, default=600, help="items per content task (0: no content)")
    p.add_argument("--lengths", type=int, nargs="*", default=[1024, 4096], help="prompt lengths timed (none: no timing)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--output", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    pair = load_pair(args.source, args.target, args.family)
    mapper = KVMapper.from_pretrained(args.mapper)
    result = {"family": str(args.family), "mapper": args.mapper, "windows": args.windows, "threads": 1,
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "load_average_before": os.getloadavg(),
              "num_exact_layers": TransferredCache(prefill(pair.source, torch.tensor([[1, 2, 3, 4]])), mapper,
                                                   num_recompute_tokens=1).num_exact_layers}  # fmt: skip
    if args.items:
        result["content"] = content(pair, mapper, args.windows, args.items)
    if args.lengths:
        result["speed"] = speed(pair, mapper, args.windows, args.lengths, args.rounds)
    result["load_average_after"] = os.getloadavg()
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
