#!/usr/bin/env python
"""Where each model of a family copies from its context: per-head copy and retrieval scores, by layer and by
fraction of depth.

- **copy score** (induction): on held-out text whose span of `--span` tokens occurs twice, the attention a head
  puts, from each token of the second occurrence, on the token that followed it in the first occurrence (the token
  to copy next); mean over the span's tokens and items. A head that copies puts its mass there; chance is about
  1 / position.
- **retrieval score**: on passage-recall items (`hf_kvtransfer.evaluation.tasks.passage_recall_items`), the
  attention a head puts, from the prompt's last position (the one that predicts the answer), on the answer's token
  in the passage; mean over items. The public figure this is set beside (retrieval heads, Wu et al. 2024, arXiv
  2404.15574) counts how often a head's top attention lands on the token it copies; the mass is its smooth version.

Depth is `(layer + 0.5) / num_layers`. For each model the JSON holds the full layer x head matrices and a summary:
the top heads, the median depth of the heads above `--threshold` (x the largest score), and the layer whose heads
score highest. The public reference: retrieval heads sit at a median 47-69% of depth in seven 32-40-layer models,
the earliest at layer 2-11, almost none in the first 3 layers.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python research/family_builder/copy_heads.py --family examples/family \\
        --models small,large --json research/family_builder/results/copy_heads_family.json

Any other model (a Hub id or a local folder; its own tokenizer), on a text file of your own, with the copy score
alone where its tokenizer cannot build the passage-recall items:

    python research/family_builder/copy_heads.py --model Qwen/Qwen3-8B --text heldout.txt --dtype bfloat16 \\
        --device-map auto --json qwen3_8b.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_kvtransfer.evaluation.tasks import passage_recall_items

EOS = "<|endoftext|>"


def repeat_items(stream: list[int], n: int, span: int, gap: int, seed: int) -> list[tuple[list[int], int, int]]:
    """`(ids, first, second)`: held-out text with the span at `first` written again at `second`."""
    rng, items = random.Random(f"copy_heads:{seed}"), []
    for _ in range(n):
        a = rng.randrange(len(stream) - (2 * span + gap + 8))
        ids = list(stream[a : a + 2 * span + gap + 8])
        first, second = 4, 4 + span + gap
        ids[second : second + span] = ids[first : first + span]
        items.append((ids, first, second))
    return items


@torch.no_grad()
def attentions(model, ids: list[int]) -> tuple[torch.Tensor, ...]:
    """Each layer's `[heads, query, key]` attention probabilities of one forward (eager attention), on the device its
    layer ran on (a large model's layers may sit on several)."""
    out = model(torch.tensor([ids]), output_attentions=True)
    return tuple(a[0] for a in out.attentions)


def copy_scores(model, items, span: int) -> torch.Tensor:
    total = None
    for ids, first, second in items:
        q = torch.arange(second, second + span - 1)  # each token of the repeat but the last
        k = q - second + first + 1  # the token that followed it the first time
        score = torch.stack([a[:, q, k].float().mean(-1).cpu() for a in attentions(model, ids)])
        total = score if total is None else total + score
    return total / len(items)


def retrieval_scores(model, items) -> tuple[torch.Tensor, int]:
    total, used = None, 0
    for it in items:
        answer = it.answer_ids[0]
        where = [j for j, t in enumerate(it.prompt_ids[:-1]) if t == answer]
        if len(it.answer_ids) != 1 or not where:
            continue
        # every place the answer's token appears (the passage line)
        score = torch.stack([a[:, -1, where].float().sum(-1).cpu() for a in attentions(model, it.prompt_ids)])
        total, used = (score if total is None else total + score), used + 1
    return total / max(used, 1), used


def summary(scores: torch.Tensor, threshold: float, top: int = 5) -> dict:
    layers, heads = scores.shape
    flat = [(float(scores[i, h]), i, h) for i in range(layers) for h in range(heads)]
    flat.sort(reverse=True)
    depth = lambda i: (i + 0.5) / layers  # noqa: E731
    strong = [depth(i) for s, i, _ in flat if s >= threshold * flat[0][0]]
    by_layer = scores.max(dim=1).values
    return {
        "top_heads": [{"layer": i, "head": h, "score": round(s, 4), "depth": round(depth(i), 3)} for s, i, h in flat[:top]],
        "strong_heads": len(strong),
        "strong_median_depth": round(sorted(strong)[len(strong) // 2], 3),
        "earliest_strong_layer": min(i for s, i, _ in flat if s >= threshold * flat[0][0]),
        "best_layer": int(by_layer.argmax()),
        "best_layer_depth": round(depth(int(by_layer.argmax())), 3),
    }


def documents(text: str) -> list[str]:
    """A held-out text's documents: split at the family's end-of-text marker, else at blank lines."""
    parts = text.split(f"\n{EOS}\n") if EOS in text else text.split("\n\n")
    return [d for d in parts if d.strip()]


def score_model(model, tok, docs: list[str], args) -> dict:
    """One model's copy (and, where its tokenizer can build the items, retrieval) scores and their summaries."""
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    stream = [t for d in docs for t in tok(d, add_special_tokens=False)["input_ids"] + eos]
    copy = copy_scores(model, repeat_items(stream, args.items, args.span, args.gap, args.seed), args.span)
    result = {"num_layers": copy.shape[0], "num_heads": copy.shape[1],
              "copy": {"summary": summary(copy, args.threshold), "scores": copy.round(decimals=4).tolist()}}  # fmt: skip
    try:
        recall = passage_recall_items(tok, args.items, seed=args.seed, distractor_texts=docs)
    except ValueError as exc:  # e.g. a tokenizer without single-token numbers: the copy score alone
        result["retrieval"], result["recall_items_scored"] = None, 0
        print(f"retrieval scores skipped: {exc}", file=sys.stderr)
        return result
    retrieval, used = retrieval_scores(model, recall)
    result["recall_items_scored"] = used
    result["retrieval"] = {"summary": summary(retrieval, args.threshold), "scores": retrieval.round(decimals=4).tolist()}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default=str(Path(__file__).resolve().parents[2] / "examples" / "family"),
                   help="family directory (default: the repository's examples/family)")
    p.add_argument("--models", default="small,large")
    p.add_argument("--model", action="append", default=[],
                   help="score this model instead (Hub id or folder, its own tokenizer; repeatable); with --text")
    p.add_argument("--text", type=Path, help="held-out text for --model (default: the family's heldout.txt)")
    p.add_argument("--dtype", default="float32", help="model dtype, e.g. bfloat16 for a large model (default: %(default)s)")
    p.add_argument("--device-map", help="accelerate device map for a large model, e.g. auto (default: CPU)")
    p.add_argument("--items", type=int, default=64, help="items per score (default: %(default)s)")
    p.add_argument("--span", type=int, default=24, help="repeated span length (default: %(default)s)")
    p.add_argument("--gap", type=int, default=200, help="tokens between the two occurrences (default: %(default)s)")
    p.add_argument("--threshold", type=float, default=0.5, help="strong = this x the largest score (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    fam = Path(args.family)
    args.text = args.text or fam / "heldout.txt"
    docs = documents(args.text.read_text(encoding="utf-8"))
    unused = {"family", "models"} if args.model else {"model"}  # the settings record only what was scored
    out = {"settings": {k: str(v) for k, v in vars(args).items() if k not in unused}, "models": {}}
    if args.model:
        todo = [(name, name, name) for name in args.model]  # (name, model, tokenizer)
    else:
        names = [m.strip() for m in args.models.split(",") if m.strip()]
        tok_dir = next((d for d in [fam / "tokenizer"] + [fam / m for m in names] if (d / "tokenizer.json").is_file()))
        todo = [(name, fam / name, tok_dir) for name in names]
    for name, path, tok_path in todo:
        tok = AutoTokenizer.from_pretrained(tok_path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype), attn_implementation="eager",
                                                     device_map=args.device_map).eval()  # fmt: skip
        out["models"][name] = score_model(model, tok, docs, args)
        for kind in ("copy", "retrieval"):
            if out["models"][name][kind] is None:
                continue
            s = out["models"][name][kind]["summary"]
            best = s["top_heads"][0]
            print(f"{name} {kind}: best head L{best['layer']}.H{best['head']} {best['score']:.3f} (depth {best['depth']:.0%}); "
                  f"{s['strong_heads']} strong heads, median depth {s['strong_median_depth']:.0%}, earliest layer "
                  f"{s['earliest_strong_layer']}", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
