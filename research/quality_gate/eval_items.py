"""The quality gate's score on the prompts `hf-kvtransfer eval` scores (passage recall and hand-off, seed 0,
distractors from the held-out text) against a mapper's threshold: the share of them the gate would send to the
target's own prefill.

    python research/quality_gate/eval_items.py --mapper DIR --items 40 --out results/gate_on_eval_items.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_kvtransfer import KVMapper
from hf_kvtransfer.evaluation.evaluate import split_documents
from hf_kvtransfer.evaluation.tasks import handoff_items, passage_recall_items
from hf_kvtransfer.fitting.quality_gate import gate_scores_on

FAMILY = Path(__file__).resolve().parents[2] / "examples" / "family"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mapper", required=True, help="a small -> large mapper fit with --quality-gate-quantile")
    parser.add_argument("--items", type=int, default=40)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(FAMILY / "large")
    source = AutoModelForCausalLM.from_pretrained(FAMILY / "small").eval()
    target = AutoModelForCausalLM.from_pretrained(FAMILY / "large").eval()
    mapper = KVMapper.from_pretrained(args.mapper)
    threshold = mapper.config.quality_gate.threshold
    docs = split_documents((FAMILY / "heldout.txt").read_text(encoding="utf-8"), tokenizer.eos_token)
    results = {"mapper": args.mapper, "threshold": threshold, "tasks": {}}
    for task, make in (("recall", passage_recall_items), ("handoff", handoff_items)):
        items = make(tokenizer, args.items, seed=0, distractor_texts=docs)
        scores = torch.cat([gate_scores_on(source, target, mapper, torch.tensor([item.prompt_ids])) for item in items])
        results["tasks"][task] = {"items": len(items), "fire_rate": float((scores < threshold).float().mean()),
                                  "score_median": float(scores.median()), "score_min": float(scores.min()),
                                  "score_max": float(scores.max())}  # fmt: skip
        print(task, results["tasks"][task])
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
