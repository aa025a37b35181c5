#!/usr/bin/env python
"""Does each model of the bundled family read its context? Held-out content measures with bootstrap CIs.

For every model directory under ``--family`` (``small``, ``large`` and, if present, ``large_kv4``):

- context gain: NLL of held-out text continuations without vs. with the model's own prefix;
- repeated-span gain: NLL of a repeated span (random tokens, or a passage of held-out text) with the
  first occurrence in the prefix vs. with it replaced (``hf_kvtransfer.evaluation.tasks.repeated_span_items``);
- passage recall: answer-token accuracy (= greedy exact match: answers are one token) with vs. without
  the passage, against chance (1 / number of possible answers) and against "some value of the passage";
- hand-off: accuracy on question 1, and on question 2 after passage + question 1 + the model's own answer 1
  (its own prefill);
- harder recall (``--hard-items``): passage recall with 8 facts and a long distractor, and two-hop recall
  (``tasks.two_hop_items``: the question names an alias of the function whose fact answers it).

The content measures are ``hf_kvtransfer.evaluation.content``'s, run on one model (no source, no mapper): with a
source and a mapper the same functions add the transfer (``hf-kvtransfer eval --tasks repeat,recall,handoff``).

All items are built from held-out documents and the "eval" fact pool with fixed seeds.
Results go to ``<family>/context_results.json`` and a table is printed.

Example::

    OMP_WAIT_POLICY=PASSIVE python research/family_builder/family_context.py --family examples/family --threads 1
    OMP_WAIT_POLICY=PASSIVE python research/family_builder/family_context.py --family examples/family_deep \
        --models source,target --threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import torch
import torch.nn.functional as F

from hf_kvtransfer.evaluation.content import handoff, passage_recall, repeated_span_retention
from hf_kvtransfer.evaluation.metrics import mean_and_ci
from hf_kvtransfer.evaluation.tasks import (
    answer_values,
    handoff_items,
    passage_recall_items,
    repeated_span_items,
    two_hop_items,
)

EOS = "<|endoftext|>"
N_BOOT = 2000  # bootstrap resamples over items


def stat(summary: dict, n: int) -> dict:
    """A library `{"mean", "ci"}` summary as this script's JSON reports it."""
    return {"mean": round(summary["mean"], 4), "ci95": [round(c, 4) for c in summary["ci"]], "n": n}


def summarise(values: list[float]) -> dict:
    return stat(mean_and_ci(values, num_bootstrap=N_BOOT), len(values))


@torch.no_grad()
def token_nll(model, seqs: list[list[int]], batch_size: int = 16) -> list[torch.Tensor]:
    """Per-token NLL of each sequence (entry j scores token j+1), right-padded batches."""
    out = []
    for i in range(0, len(seqs), batch_size):
        chunk = seqs[i : i + batch_size]
        L = max(map(len, chunk))
        ids = torch.tensor([s + [0] * (L - len(s)) for s in chunk])
        logits = model(input_ids=ids, use_cache=False).logits.float()  # (B, L, V); padding is after, causal
        nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
        out += [nll[b, : len(s) - 1] for b, s in enumerate(chunk)]
    return out


def context_gain(model, stream: list[int], prefix: int, cont: int, stride: int, max_windows: int | None) -> dict:
    starts = list(range(0, len(stream) - prefix - cont, stride))[:max_windows]
    with_p = token_nll(model, [stream[s : s + prefix + cont] for s in starts])
    without = token_nll(model, [stream[s + prefix : s + prefix + cont] for s in starts])
    own = [w[prefix - 1 :].mean().item() for w in with_p]
    # without a prefix the first continuation token has no context at all: score tokens 2..cont on both sides
    own_paired = [w[prefix:].mean().item() for w in with_p]
    none = [w.mean().item() for w in without]
    return {
        "windows": len(starts), "prefix": prefix, "continuation": cont, "stride": stride,
        "own_prefix_nll": summarise(own),
        "no_prefix_nll": summarise(none),
        "context_gain_nats": summarise([n - o for n, o in zip(none, own_paired)]),
    }


# The content measures are the library's (hf_kvtransfer.evaluation.content), run without a source and mapper: own
# context vs. no context for one model.
def repeat_gain(model, items) -> dict:
    r = repeated_span_retention(None, model, None, items, batch_size=16, num_bootstrap=N_BOOT, progress=False)
    n = r["num_items"]
    return {"items": n, "with_first_nll": stat(r["nll"]["own"], n), "without_first_nll": stat(r["nll"]["no_context"], n),
            "gain_nats": stat(r["context_gain"], n)}


def recall(model, items, n_values: int) -> dict:
    r = passage_recall(None, model, None, items, num_bootstrap=N_BOOT, progress=False)
    n = r["num_items"]
    return {"items": n, "accuracy_with_passage": stat(r["accuracy"]["own"], n),
            "accuracy_no_passage": stat(r["accuracy"]["no_context"], n),
            "predicts_some_passage_value": stat(r["passage_value_rate"]["own"], n), "chance": round(1 / n_values, 4),
            "one_of_passage_values_chance": round(r["passage_value_chance"], 4),
            "answer_nll_with_passage": stat(r["answer_nll"]["own"], n),
            "answer_nll_no_passage": stat(r["answer_nll"]["no_context"], n)}


def handoff_accuracy(model, items) -> dict:
    # The model answers question 1 itself; question 2 follows its own answer (as in a real conversation).
    r = handoff(None, model, None, items, num_bootstrap=N_BOOT, progress=False)
    n = r["num_items"]
    return {"items": n, "accuracy_q1": stat(r["q1_accuracy"], n), "accuracy_q2": stat(r["accuracy"]["own"], n),
            "accuracy_q2_no_context": stat(r["accuracy"]["no_context"], n)}


def fmt(s: dict, pct: bool = False) -> str:
    k = 100 if pct else 1
    d = 1 if pct else 3
    return f"{s['mean'] * k:.{d}f} [{s['ci95'][0] * k:.{d}f}, {s['ci95'][1] * k:.{d}f}]"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="example:\n  OMP_WAIT_POLICY=PASSIVE python research/family_builder/family_context.py --family examples/family\n")
    p.add_argument("--family", default=str(Path(__file__).resolve().parents[2] / "examples" / "family"),
                   help="family directory (default: the repository's examples/family)")
    p.add_argument("--models", default="small,large,large_kv4", help="model subdirectories; missing ones are skipped")
    p.add_argument("--items", type=int, default=600,
                   help="items for random-span repeats and passage recall (default: %(default)s)")
    p.add_argument("--extra-items", type=int, default=300,
                   help="items for text-span repeats and hand-off (default: %(default)s)")
    p.add_argument("--hard-items", type=int, default=300,
                   help="items for hard recall (8 facts, long distractor) and two-hop recall, 0 = skip "
                        "(default: %(default)s)")
    p.add_argument("--windows", type=int, default=None,
                   help="cap on context-gain windows (default: all, 659 on heldout.txt)")
    p.add_argument("--seed", type=int, default=0, help="item seed (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    p.add_argument("--output", default=None, help="JSON output (default: <family>/context_results.json)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fam = Path(args.family)
    # the family's shared tokenizer folder, or (examples/family_deep) the first model folder's copy
    tok_dirs = [fam / "tokenizer"] + [fam / m.strip() for m in args.models.split(",") if m.strip()]
    tok = AutoTokenizer.from_pretrained(next((d for d in tok_dirs if (d / "tokenizer.json").is_file()), tok_dirs[0]))
    docs = [d for d in (fam / "heldout.txt").read_text(encoding="utf-8").split(f"\n{EOS}\n") if d.strip()]
    stream: list[int] = []
    for d in docs:
        stream += tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    n = args.items
    t0 = time.time()
    rep_rand = repeated_span_items(tok, stream, n, seed=args.seed, kind="random", prefix_len=256, continuation_len=64, span_len=24)
    rep_text = repeated_span_items(tok, stream, args.extra_items, seed=args.seed, kind="text", prefix_len=256,
                                   continuation_len=64, span_len=24) if args.extra_items else []
    rec = passage_recall_items(tok, n, seed=args.seed, distractor_texts=docs)
    hand = handoff_items(tok, args.extra_items, seed=args.seed, distractor_texts=docs) if args.extra_items else []
    hard = passage_recall_items(tok, args.hard_items, seed=args.seed, n_facts=8, distractor_texts=docs,
                                distractor_chars=(900, 1800)) if args.hard_items else []
    two_hop = two_hop_items(tok, args.hard_items, seed=args.seed, distractor_texts=docs) if args.hard_items else []
    n_values = len(answer_values(tok))
    lens = [len(it.prompt_ids) for it in rec]
    print(f"items built in {time.time() - t0:.1f}s: held-out stream {len(stream):,} tokens; recall prompts "
          f"{min(lens)}-{max(lens)} tokens (mean {sum(lens) / len(lens):.0f}); {n_values} possible answers")

    results = {"settings": {**vars(args), "heldout_tokens": len(stream), "answer_values": n_values,
                            "recall_prompt_tokens": [min(lens), max(lens)], "torch": torch.__version__}, "models": {}}
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        d = fam / name
        if not (d / "model.safetensors").is_file():
            print(f"skip {name}: no {d / 'model.safetensors'}")
            continue
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        t = time.time()
        r = {
            "context": context_gain(model, stream, prefix=256, cont=64, stride=128, max_windows=args.windows),
            "repeat_random": repeat_gain(model, rep_rand),
            "recall": recall(model, rec, n_values),
        }
        if args.extra_items:  # secondary measures; 0 skips them
            r["repeat_text"] = repeat_gain(model, rep_text)
            r["handoff"] = handoff_accuracy(model, hand)
        if args.hard_items:
            r["hard_recall"] = recall(model, hard, n_values)
            r["two_hop"] = recall(model, two_hop, n_values)
        r["wall_s"] = round(time.time() - t, 1)
        results["models"][name] = r
        print(f"{name}: done in {r['wall_s']:.0f}s")
    out = Path(args.output) if args.output else fam / "context_results.json"
    out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")

    print(f"\nheld-out, bootstrap 95% CIs over items; uniform NLL = ln({len(tok)}) = {math.log(len(tok)):.2f}")
    rows = [
        ("text NLL, own prefix (256 ctx)", lambda r: fmt(r["context"]["own_prefix_nll"])),
        ("text NLL, no prefix", lambda r: fmt(r["context"]["no_prefix_nll"])),
        ("context gain (nats/token)", lambda r: fmt(r["context"]["context_gain_nats"])),
        ("random span repeat NLL, 1st occ. in ctx", lambda r: fmt(r["repeat_random"]["with_first_nll"])),
        ("random span repeat NLL, without", lambda r: fmt(r["repeat_random"]["without_first_nll"])),
        ("random span repeat gain", lambda r: fmt(r["repeat_random"]["gain_nats"])),
        ("text span repeat gain", lambda r: fmt(r["repeat_text"]["gain_nats"])),
        ("recall acc % with passage", lambda r: fmt(r["recall"]["accuracy_with_passage"], True)),
        ("recall acc % no passage", lambda r: fmt(r["recall"]["accuracy_no_passage"], True)),
        ("recall: predicts a passage value %", lambda r: fmt(r["recall"]["predicts_some_passage_value"], True)),
        ("hand-off acc % Q1", lambda r: fmt(r["handoff"]["accuracy_q1"], True)),
        ("hand-off acc % Q2", lambda r: fmt(r["handoff"]["accuracy_q2"], True)),
        ("hard recall acc % (8 facts) with passage", lambda r: fmt(r["hard_recall"]["accuracy_with_passage"], True)),
        ("two-hop recall acc % with passage", lambda r: fmt(r["two_hop"]["accuracy_with_passage"], True)),
        ("two-hop: predicts a passage value %", lambda r: fmt(r["two_hop"]["predicts_some_passage_value"], True)),
    ]
    names = list(results["models"])
    print("| measure | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for label, f in rows:
        cells = []
        for m in names:
            try:
                cells.append(f(results["models"][m]))
            except KeyError:  # a skipped secondary measure
                cells.append("-")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(f"chance: recall {100 / n_values:.1f}% (1/{n_values} answers), one of the passage's values "
          f"{100 / rec[0].meta['n_facts']:.0f}%; items: random repeats / recall {n}, text repeats / hand-off "
          f"{args.extra_items}, hard / two-hop recall {args.hard_items}, context windows "
          f"{results['models'][names[0]]['context']['windows'] if names else 0}; threads {args.threads}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
