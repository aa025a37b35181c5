"""How often a mapper's quality gate fires (a row falls back to the target's own prefill) on held-out text and on
text unlike the calibration text: reversed held-out windows, shuffled tokens, random tokens.

    python research/quality_gate/fire_rates.py --mapper DIR [--prompts 32] [--tokens 256] --out results.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_kvtransfer import KVMapper
from hf_kvtransfer.fitting.quality_gate import gate_scores_on

FAMILY = Path(__file__).resolve().parents[2] / "examples" / "family"


def windows(tokenizer, n: int, length: int) -> torch.Tensor:
    ids = tokenizer((FAMILY / "heldout.txt").read_text(), return_tensors="pt").input_ids[0]
    rows = ids[: (ids.numel() // length) * length].view(-1, length)
    return rows[torch.linspace(0, rows.shape[0] - 1, min(n, rows.shape[0])).long()]


def variants(heldout: torch.Tensor, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shuffled = torch.stack([row[torch.randperm(row.numel(), generator=g)] for row in heldout])
    return {"heldout": heldout, "reversed": heldout.flip(-1), "shuffled": shuffled,
            "random": torch.randint(0, vocab, heldout.shape, generator=g)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mapper", required=True)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(FAMILY / "tokenizer")
    source = AutoModelForCausalLM.from_pretrained(FAMILY / "small").eval()
    target = AutoModelForCausalLM.from_pretrained(FAMILY / "large").eval()
    mapper = KVMapper.from_pretrained(args.mapper)
    gate = mapper.config.quality_gate
    results = {"mapper": args.mapper, "gate": gate.to_dict(), "prompts": args.prompts, "tokens": args.tokens, "kinds": {}}
    for kind, ids in variants(windows(tokenizer, args.prompts, args.tokens), target.config.vocab_size).items():
        scores = gate_scores_on(source, target, mapper, ids)
        results["kinds"][kind] = {"rows": int(ids.shape[0]), "fire_rate": float((scores < gate.threshold).float().mean()),
                                  "score_median": float(scores.median()), "score_min": float(scores.min())}  # fmt: skip
        print(kind, results["kinds"][kind])
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
