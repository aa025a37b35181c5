#!/usr/bin/env python
"""Does each model of the bundled family read its context? Held-out content measures with bootstrap CIs.

For every model directory under ``--family`` (``small``, ``large`` and, if present, ``large_kv4``):

- context gain: NLL of held-out text continuations without vs. with the model's own prefix;
- repeated-span gain: NLL of a repeated span (random tokens, or a passage of held-out text) with the
  first occurrence in the prefix vs. with it replaced (``hf_kvtransfer.tasks.repeated_span_items``);
- passage recall: answer-token accuracy (= greedy exact match: answers are one token) with vs. without
  the passage, against chance (1 / number of possible answers) and against "some value of the passage";
- hand-off: accuracy on question 2 after passage + question 1 + answer 1 (the model's own prefill).

All items are built from held-out documents and the "eval" fact pool with fixed seeds.
Results go to ``<family>/context_results.json`` and a table is printed.

Example::

    OMP_WAIT_POLICY=PASSIVE python examples/family_context.py --family examples/family --threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch
import torch.nn.functional as F

from hf_kvtransfer.tasks import answer_values, handoff_items, passage_recall_items, repeated_span_items

EOS = "<|endoftext|>"


def bootstrap_ci(values: list[float], n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Mean and percentile 95% CI over items."""
    x = torch.tensor(values, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(values), (n_boot, len(values)), generator=g)
    means = x[idx].mean(1)
    return x.mean().item(), means.quantile(0.025).item(), means.quantile(0.975).item()


def stat(values: list[float]) -> dict:
    m, lo, hi = bootstrap_ci(values)
    return {"mean": round(m, 4), "ci95": [round(lo, 4), round(hi, 4)], "n": len(values)}


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


@torch.no_grad()
def last_logits(model, seqs: list[list[int]], batch_size: int = 16) -> torch.Tensor:
    out = []
    for i in range(0, len(seqs), batch_size):
        chunk = seqs[i : i + batch_size]
        L = max(map(len, chunk))
        ids = torch.tensor([s + [0] * (L - len(s)) for s in chunk])
        logits = model(input_ids=ids, use_cache=False).logits.float()
        out.append(torch.stack([logits[b, len(s) - 1] for b, s in enumerate(chunk)]))
    return torch.cat(out)


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
        "own_prefix_nll": stat(own),
        "no_prefix_nll": stat(none),
        "context_gain_nats": stat([n - o for n, o in zip(none, own_paired)]),
    }


def repeat_gain(model, items) -> dict:
    P = len(items[0].prefix_ids)
    own = token_nll(model, [it.prefix_ids + it.continuation_ids for it in items])
    ctl = token_nll(model, [it.control_prefix_ids + it.continuation_ids for it in items])
    o, c = [], []
    for it, a, b in zip(items, own, ctl):
        m = torch.tensor(it.repeat_mask)
        o.append(a[P - 1 :][m].mean().item())
        c.append(b[P - 1 :][m].mean().item())
    return {"items": len(items), "with_first_nll": stat(o), "without_first_nll": stat(c),
            "gain_nats": stat([y - x for x, y in zip(o, c)])}


def recall(model, items, n_values: int) -> dict:
    lg = last_logits(model, [it.prompt_ids for it in items])
    lg0 = last_logits(model, [it.no_passage_prompt_ids for it in items])
    pred, pred0 = lg.argmax(-1).tolist(), lg0.argmax(-1).tolist()
    hit = [float(p == it.answer_ids[0]) for p, it in zip(pred, items)]
    hit0 = [float(p == it.answer_ids[0]) for p, it in zip(pred0, items)]
    anyv = [float(p in [v[0] for v in it.passage_values]) for p, it in zip(pred, items)]
    return {"items": len(items), "accuracy_with_passage": stat(hit), "accuracy_no_passage": stat(hit0),
            "predicts_some_passage_value": stat(anyv), "chance": round(1 / n_values, 4),
            "one_of_passage_values_chance": round(1 / items[0].meta["n_facts"], 4),
            "answer_nll_with_passage": stat(F.cross_entropy(lg, torch.tensor([it.answer_ids[0] for it in items]),
                                                            reduction="none").tolist()),
            "answer_nll_no_passage": stat(F.cross_entropy(lg0, torch.tensor([it.answer_ids[0] for it in items]),
                                                          reduction="none").tolist())}


@torch.no_grad()
def handoff(model, items, batch_size: int = 16) -> dict:
    # one forward of the whole dialogue: answer 1 is predicted at the end of the prompt, answer 2 at the end
    p1, p2 = [], []
    for i in range(0, len(items), batch_size):
        chunk = [it.prompt_ids + it.answer1_ids + it.followup_ids for it in items[i : i + batch_size]]
        L = max(map(len, chunk))
        logits = model(input_ids=torch.tensor([s + [0] * (L - len(s)) for s in chunk]), use_cache=False).logits
        for b, it in enumerate(items[i : i + batch_size]):
            p1.append(logits[b, len(it.prompt_ids) - 1].argmax().item())
            p2.append(logits[b, len(chunk[b]) - 1].argmax().item())
    a1 = [float(p == it.answer1_ids[0]) for p, it in zip(p1, items)]
    a2 = [float(p == it.answer2_ids[0]) for p, it in zip(p2, items)]
    return {"items": len(items), "accuracy_q1": stat(a1), "accuracy_q2": stat(a2)}


def fmt(s: dict, pct: bool = False) -> str:
    k = 100 if pct else 1
    d = 1 if pct else 3
    return f"{s['mean'] * k:.{d}f} [{s['ci95'][0] * k:.{d}f}, {s['ci95'][1] * k:.{d}f}]"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="example:\n  OMP_WAIT_POLICY=PASSIVE python examples/family_context.py --family examples/family\n")
    p.add_argument("--family", default="examples/family", help="family directory (default: %(default)s)")
    p.add_argument("--models", default="small,large,large_kv4", help="model subdirectories; missing ones are skipped")
    p.add_argument("--items", type=int, default=600,
                   help="items for random-span repeats and passage recall (default: %(default)s)")
    p.add_argument("--extra-items", type=int, default=300,
                   help="items for text-span repeats and hand-off (default: %(default)s)")
    p.add_argument("--windows", type=int, default=None,
                   help="cap on context-gain windows (default: all, 659 on heldout.txt)")
    p.add_argument("--seed", type=int, default=0, help="item seed (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    p.add_argument("--output", default=None, help="JSON output (default: <family>/context_results.json)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fam = Path(args.family)
    tok = AutoTokenizer.from_pretrained(fam / "tokenizer")
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
            r["handoff"] = handoff(model, hand)
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
          f"{args.extra_items}, context windows "
          f"{results['models'][names[0]]['context']['windows'] if names else 0}; threads {args.threads}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
