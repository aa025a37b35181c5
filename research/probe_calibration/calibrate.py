"""Does the fit's content gate predict what `eval` measures? Every candidate of both bundled directions, scored
by the gate (probe-split items) and by eval's own recall and hand-off code on eval's items (heldout.txt).

The candidates are exactly the fit's: a default `fit` of the pair runs up to its choice, which is intercepted
(`fitting.fit.choose_configuration` replaced by a recorder), so the source-only mapper and every residual-input
variant the fit would try are what is scored: source-only with 1 .. L-1 exact layers, each residual variant with
J + 1. Each candidate is written to the result file as soon as it is done; a rerun skips those already there.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python research/probe_calibration/calibrate.py \
        --directions large-small,small-large --eval-items 300 --probe-items 150 \
        --json research/probe_calibration/results/calibration.json
    python research/probe_calibration/plot.py research/probe_calibration/results/calibration.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_kvtransfer.fitting.fit as fit_module
from hf_kvtransfer.evaluation.content import handoff, passage_recall
from hf_kvtransfer.evaluation.evaluate import split_documents
from hf_kvtransfer.evaluation.metrics import mean_and_ci
from hf_kvtransfer.evaluation.tasks import handoff_items, passage_recall_items
from hf_kvtransfer.fitting.config import FitConfig, heldout_count
from hf_kvtransfer.fitting.content_gate import ContentGate, heldout_texts
from hf_kvtransfer.core.map_inputs import maps_read

FAMILY = Path(__file__).resolve().parents[2] / "examples" / "family"
NAMES = {"small": "small", "large": "large"}


def residual_layer(mapper) -> int | None:
    """The target layer whose input the maps read (`MapperConfig.map_inputs["residual"].layer`), None without."""
    residual = mapper.config.map_inputs.get("residual")
    return None if residual is None else residual.layer


def candidates_of(source, target, tok):
    """The fit's candidates at its defaults: `[(label, mapper, num_exact_layers)]`, and the held-out texts."""
    captured = {}

    def record(src, tgt, mapper, stream, *, candidates=None, **kwargs):
        captured.update(mapper=mapper, residual=list(candidates or []))
        return mapper, {"tried": [], "reason": "recorded for the calibration study"}

    fit_module.choose_configuration = record
    config = FitConfig(dataset=str(FAMILY / "calibration.txt"), progress=False)
    ids, _ = fit_module.calibration_sample(tok, config)
    fit_module.fit_mappers(source, target, ids, config)
    num_heldout = heldout_count(ids.shape[0], config.heldout_fraction)
    texts = heldout_texts(tok, ids[-num_heldout:])
    mapper, layers = captured["mapper"], target.config.num_hidden_layers
    out = [(f"{k} exact, {maps_read(mapper.config)}", mapper, k) for k in range(1, layers)]
    out += [(f"{residual_layer(m) + 1} exact, {maps_read(m.config)}", m, residual_layer(m) + 1)
            for m in captured["residual"]]  # fmt: skip
    return out, texts


def _cached_candidates(source, target, tok, cache: Path):
    """`candidates_of`, kept under `cache` (the mappers and the held-out texts) so that a resumed run skips the pass."""
    from hf_kvtransfer import KVMapper

    index = cache / "candidates.json"
    if index.exists():
        saved = json.loads(index.read_text())
        return [(label, KVMapper.from_pretrained(str(cache / str(i))), k) for i, (label, k) in enumerate(saved["candidates"])], saved["texts"]
    cands, texts = candidates_of(source, target, tok)
    for i, (_, mapper, _) in enumerate(cands):
        mapper.save_pretrained(str(cache / str(i)))
    index.write_text(json.dumps({"candidates": [(label, k) for label, _, k in cands], "texts": texts}))
    return cands, texts


def measured(source, target, mapper, k, items, own):
    """Eval's own recall and hand-off code on eval's items (`eval --tasks recall,handoff --items N`, seed 0)."""
    out = {}
    for task, fn in (("recall", passage_recall), ("handoff", handoff)):
        r = fn(source, target, mapper, items[task], num_exact_layers=k, progress=False, reference=own.get(task))
        own.setdefault(task, r)
        c = {name: torch.tensor(r["correct_per_item"][name], dtype=torch.float64) for name in ("own", "transfer")}
        diff = mean_and_ci((c["transfer"] - c["own"]).numpy())
        out[task] = {"num_items": r["num_items"], "own_accuracy": r["accuracy"]["own"]["mean"],
                     "transfer_accuracy": r["accuracy"]["transfer"]["mean"],
                     "no_context_accuracy": r["accuracy"]["no_context"]["mean"], "retention": r.get("retention"),
                     "retention_ci": r.get("retention_ci"), "difference": diff["mean"], "difference_ci": diff["ci"]}  # fmt: skip
    return out


def run_direction(direction: str, args, results: dict, path: Path) -> None:
    src_name, tgt_name = direction.split("-")
    tok = AutoTokenizer.from_pretrained(FAMILY / "large")
    source = AutoModelForCausalLM.from_pretrained(FAMILY / src_name, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(FAMILY / tgt_name, dtype=torch.float32).eval()
    started = time.perf_counter()
    with torch.no_grad():
        cands, texts = _cached_candidates(source, target, tok, path.parent / "cache" / direction)
    order = [int(k) for k in args.exact_first.split(",") if k] if args.exact_first else []
    cands.sort(key=lambda c: order.index(c[2]) if c[2] in order else len(order))  # stable: the fit's order after
    print(f"{direction}: {len(cands)} candidates from the fit's pass ({time.perf_counter() - started:.0f} s)", flush=True)
    docs = split_documents((FAMILY / "heldout.txt").read_text(encoding="utf-8"), tok.eos_token)
    items = {"recall": passage_recall_items(tok, args.eval_items, seed=0, distractor_texts=docs),
             "handoff": handoff_items(tok, args.eval_items, seed=0, distractor_texts=docs)}  # fmt: skip
    gate = ContentGate(source, target, tok, texts, tolerance=args.tolerance, num_items=args.probe_items,
                       max_items=args.probe_items)  # fmt: skip
    own: dict = {}
    rows = results.setdefault(direction, {})
    for label, mapper, k in cands:
        if label in rows:
            continue
        t0 = time.perf_counter()
        with torch.no_grad():
            verdict = gate.judge(mapper, k, every_task=True)
            eval_scores = measured(source, target, mapper, k, items, own)
        rows[label] = {"num_exact_layers": k, "residual_layer": residual_layer(mapper), "probe": verdict,
                       "eval": eval_scores, "seconds": time.perf_counter() - t0}  # fmt: skip
        path.write_text(json.dumps(results, indent=2, sort_keys=True))
        p, e = verdict["tasks"]["recall"], eval_scores["recall"]
        print(f"{direction} {label}: recall probe {100 * p['difference']:+.1f} eval {100 * e['difference']:+.1f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--directions", default="large-small,small-large")
    p.add_argument("--eval-items", type=int, default=300)
    p.add_argument("--probe-items", type=int, default=150)
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--exact-first", default="", help="score candidates with these exact-layer counts first (e.g. 3,2)")
    p.add_argument("--json", default=str(Path(__file__).parent / "results" / "calibration.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    path = Path(args.json)
    results = json.loads(path.read_text()) if path.exists() else {}
    results["settings"] = {"eval_items": args.eval_items, "probe_items": args.probe_items, "tolerance": args.tolerance,
                           "eval": "passage recall and hand-off of heldout.txt, seed 0 (eval's items)",
                           "probe": "the fit's content gate: probe-split items, distractors from the held-out "
                                    "calibration rows"}  # fmt: skip
    for direction in args.directions.split(","):
        run_direction(direction, args, results, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
