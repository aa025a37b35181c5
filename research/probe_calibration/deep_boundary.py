"""The deep pair's boundary candidate: does the content gate's probe predict what `eval` measures, with many items?

On the deep pair the default fit's gate rejected 2 exact layers with maps of the residual entering layer 1 (recall
-4.5 points [-7.4, -2.1] on 512 probe items for the residual-alone variant), while `eval` measured -1.5 [-3.8, +0.7]
on its 600 items for the same mapper. Either the probe's items are harder for the transfer than eval's (the gate
would then be unfaithful) or the two samples differ by chance. This study scores passage recall for one mapper on
many more items of each kind, paired against the target's own answers:

- `probe`: the gate's items (the `probe` split, distractors cut from the fit's held-out calibration rows), the first
  512 being the ones the fit saw;
- `eval`: `eval`'s items (the `eval` split, distractors from the family's held-out text), the first 600 being the
  ones `eval --items 600` scored;
- `probe_eval_text`: the probe split with eval's distractor text, which tells a split effect from a text effect.

One result file; each kind is written as soon as it is scored, and a rerun skips the kinds already in the file.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python research/probe_calibration/deep_boundary.py \\
        --mapper DIR_TOL8 --items 2000 --kinds eval probe \\
        --json research/probe_calibration/results/deep_boundary_tolerance_8.json
    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python research/probe_calibration/deep_boundary.py \\
        --mapper DIR --items 2000 --kinds eval probe \\
        --json research/probe_calibration/results/deep_boundary_default.json

DIR_TOL8 is the deep pair's fit at `--exact-layers-tolerance 0.08` (2 of 24 exact layers, the residual alone, rank
67): `hf-kvtransfer fit -v --source examples/family_deep/source --target examples/family_deep/target --dataset
examples/family_deep/calibration.txt --exact-layers-tolerance 0.08 --output DIR_TOL8`; DIR the same fit at its
defaults (3 of 24 exact). About 14 minutes per kind and mapper on one core.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_kvtransfer import KVMapper
from hf_kvtransfer.evaluation.content import passage_recall
from hf_kvtransfer.evaluation.evaluate import split_documents
from hf_kvtransfer.evaluation.metrics import gap_recovered_over_items, mean_and_ci, retention_over_items
from hf_kvtransfer.evaluation.tasks import passage_recall_items
from hf_kvtransfer.fitting import fit as fit_module
from hf_kvtransfer.fitting.config import FitConfig, heldout_count
from hf_kvtransfer.fitting.content_gate import PROBE_SPLIT, heldout_texts

FAMILY = Path(__file__).resolve().parents[2] / "examples" / "family_deep"
KINDS = ("probe", "eval", "probe_eval_text")


def distractor_texts(tok) -> dict[str, list[str]]:
    """The gate's distractor text (the default fit's held-out calibration rows) and eval's (the held-out documents)."""
    config = FitConfig(dataset=str(FAMILY / "calibration.txt"), progress=False)
    ids, _ = fit_module.calibration_sample(tok, config)
    calibration = heldout_texts(tok, ids[-heldout_count(ids.shape[0], config.heldout_fraction) :])
    heldout = split_documents((FAMILY / "heldout.txt").read_text(encoding="utf-8"), tok.eos_token)
    return {"calibration": calibration, "heldout": heldout}


def items_of(kind: str, tok, texts: dict[str, list[str]], n: int):
    split = "eval" if kind == "eval" else PROBE_SPLIT
    source = "calibration" if kind == "probe" else "heldout"
    return passage_recall_items(tok, n, seed=0, distractor_texts=texts[source], split=split)


def summary(correct: dict[str, np.ndarray], first: int) -> dict:
    """Accuracies, the paired difference (transfer - own), the floor-normalised retention and the gap recovered
    (over the source alone) with 95% bootstrap intervals, over all items, the first `first` (what the fit or `eval` scored) and the rest; the per-item scores."""
    out = {"num_items": int(correct["own"].size),
           "correct_per_item": {k: v.astype(int).tolist() for k, v in correct.items()}}  # fmt: skip
    for name, part in (("all", slice(None)), (f"first_{first}", slice(0, first)), (f"after_{first}", slice(first, None))):
        c = {k: v[part] for k, v in correct.items()}
        if not c["own"].size:
            continue
        diff = mean_and_ci(c["transfer"] - c["own"], 2000, 0)
        kept = retention_over_items(c["own"], c["transfer"], c["no_context"], num_bootstrap=2000, seed=0)
        gap = gap_recovered_over_items(c["own"], c["transfer"], c["source_alone"], num_bootstrap=2000, seed=0)
        out[name] = {"num_items": int(c["own"].size), **{f"{k}_accuracy": float(v.mean()) for k, v in c.items()},
                     "difference": diff["mean"], "difference_ci": diff["ci"], "retention": kept.get("retention"),
                     "retention_ci": kept.get("retention_ci"), "gap_recovered": gap.get("gap_recovered"),
                     "gap_recovered_ci": gap.get("gap_recovered_ci")}  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mapper", required=True)
    p.add_argument("--items", type=int, default=1200)
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(FAMILY / "target")
    source, target = (AutoModelForCausalLM.from_pretrained(FAMILY / name, dtype=torch.float32).eval()
                      for name in ("source", "target"))  # fmt: skip
    mapper = KVMapper.from_pretrained(args.mapper)
    texts = distractor_texts(tok)
    result = json.loads(args.json.read_text()) if args.json.exists() else {}
    result.update(mapper=args.mapper, num_exact_layers=mapper.config.num_exact_layers, task="passage recall",
                  load_average_before=os.getloadavg())  # fmt: skip
    seen = {"probe": 512, "eval": 600, "probe_eval_text": 512}  # what the fit's gate and `eval --items 600` scored
    for kind in args.kinds:
        if kind in result.get("kinds", {}):
            continue
        start = time.time()
        scored = passage_recall(source, target, mapper, items_of(kind, tok, texts, args.items), num_bootstrap=0)
        correct = {k: np.asarray(v, dtype=np.float64) for k, v in scored["correct_per_item"].items()}
        result.setdefault("kinds", {})[kind] = {**summary(correct, seen[kind]), "seconds": round(time.time() - start)}
        args.json.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        print(kind, json.dumps({k: v for k, v in result["kinds"][kind].items() if k != "correct_per_item"}), flush=True)


if __name__ == "__main__":
    main()
