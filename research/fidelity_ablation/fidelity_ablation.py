"""The fidelity ablation: what moves the transfer's fidelity on the bundled family, each row against the
defaults (`fit_mapper(...)` + `TransferredCache(src_cache, mapper)`), paired on the same held-out items.

    OMP_WAIT_POLICY=PASSIVE python research/fidelity_ablation/fidelity_ablation.py --json research/fidelity_ablation/results/fidelity_ablation.json
    python research/fidelity_ablation/fidelity_ablation.py --rows default,exact0 --items 60 --windows 60   # a quick look

Two measures per row and direction (small -> large, large -> small):

- passage recall (`tasks.passage_recall_items`, distractors from heldout.txt): greedy exact match of an answer
  that only the passage holds; retention = (transfer - no passage) / (own - no passage);
- prefix-conditioned perplexity (`evaluate.prefix_perplexity`, 2 x 128-token windows of heldout.txt):
  floor-normalized retention.

Both use the cache's defaults unless the row changes them: the mapper's exact layers (chosen by its fit's content
probe, `exact_layers.py`), 32 recomputed tokens (at most half of a shorter context). The cost column is
the target's time to first token on a `--ttft-len`-token prompt (median of 5, one thread as set by the caller):
cache construction, mapping, exact layers and recomputed tokens, next to the target's own prefill of that prompt.

The target's own and no-context scores do not depend on the row; each row changes only the mapper or the cache. "diff" is the row's retention minus the default's, bootstrapped over the same items/windows
(paired); a CI that contains 0 means the row is inside the noise of this many items.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_kvtransfer import fit_mapper, fit_mappers
from hf_kvtransfer.evaluation.content import passage_recall
from hf_kvtransfer.evaluation.evaluate import prefix_perplexity, split_documents
from hf_kvtransfer.fitting.config import FitConfig
from hf_kvtransfer.evaluation.tasks import passage_recall_items
from hf_kvtransfer.evaluation.timing import time_to_first_token

# name: (what it changes, fit_mapper overrides, TransferredCache / evaluation overrides)
ROWS = {
    "default": ("defaults: ridge, top_k=8, the exact layers the fit's content probe chose, 32 recomputed tokens", {}, {}),
    "exact0": ("no exact layer (layer 0 mapped too)", {}, {"num_exact_layers": 0}),
    "exact1": ("1 exact layer (the default before the content probe)", {}, {"num_exact_layers": 1}),
    "exact2": ("2 exact layers", {}, {"num_exact_layers": 2}),
    "exact3": ("3 exact layers", {}, {"num_exact_layers": 3}),
    "exact4": ("4 exact layers", {}, {"num_exact_layers": 4}),
    "exact6": ("6 exact layers", {}, {"num_exact_layers": 6}),
    "recompute1": ("1 recomputed token (the default before 32)", {}, {"num_recompute_tokens": 1}),
    "recompute8": ("8 recomputed tokens", {}, {"num_recompute_tokens": 8}),
    "recompute32": ("32 recomputed tokens", {}, {"num_recompute_tokens": 32}),
    "recompute64": ("64 recomputed tokens", {}, {"num_recompute_tokens": 64}),
    "top_k2": ("top_k=2 source layers", {"top_k": 2}, {}),
    "half_calibration": ("half the calibration tokens", {"num_sequences": "half"}, {}),
    "mlp": ("residual MLP mapper", {"mapper_type": "mlp"}, {}),
    "mlp_plain": ("plain (non-residual) MLP mapper", {"mapper_type": "mlp", "mlp_residual": False}, {}),
}

# Left out by default: an extra fit each (the MLP trains for many minutes on one CPU core for this calibration set).
SLOW_ROWS = ("half_calibration", "mlp", "mlp_plain")


def markdown_table(report: dict) -> str:
    """One row per ablation row, one column pair per direction: recall and perplexity retention (and their paired
    difference to the defaults), time to first token."""
    directions = list(report["directions"])
    names = list(dict.fromkeys(n for d in directions for n in report["directions"][d]["rows"]))
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}"  # noqa: E731
    ci = lambda c: f"[{pct(c[0])}, {pct(c[1])}]" if c else ""  # noqa: E731
    head = "| row |" + "".join(f" {d}: recall retention % | ppl retention % | TTFT ms (own prefill) |" for d in directions)
    lines = [head, "|---|" + "---|---|---:|" * len(directions)]
    for name in names:
        cells = []
        for d in directions:
            out = report["directions"][d]
            row = out["rows"].get(name)
            if row is None:
                cells += ["-", "-", "-"]
                continue
            if "recall_retention" not in row:  # --ttft-only
                cells += ["-", "-", f"{row['ttft_ms']:.0f} ({out['own_prefill_ms']:.0f})"]
                continue
            rec = f"{pct(row['recall_retention'])} {ci(row['recall_retention_ci'])}"
            ppl = f"{pct(row['ppl_retention'])} {ci(row['ppl_retention_ci'])}"
            if "recall_diff" in row:
                rec += f"; {float(pct(row['recall_diff'])):+.1f} {ci(row['recall_diff_ci'])}"
                ppl += f"; {float(pct(row['ppl_diff'])):+.1f} {ci(row['ppl_diff_ci'])}"
            cells += [rec, ppl, f"{row['ttft_ms']:.0f} ({out['own_prefill_ms']:.0f})"]
        lines.append(f"| {name}: {next(report['directions'][d]['rows'][name]['what'] for d in directions if name in report['directions'][d]['rows'])} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def retention(score, own, none, idx=None) -> float:
    idx = slice(None) if idx is None else idx
    gain = own[idx].mean() - none[idx].mean()
    return float((score[idx].mean() - none[idx].mean()) / gain) if gain != 0 else float("nan")


def paired_diff(row, base, own, none, num_bootstrap=1000, seed=0):
    rng = np.random.default_rng(seed)
    draws = [rng.integers(0, len(own), len(own)) for _ in range(num_bootstrap)]
    d = [retention(row, own, none, i) - retention(base, own, none, i) for i in draws]
    return retention(row, own, none) - retention(base, own, none), [float(np.nanpercentile(d, 2.5)), float(np.nanpercentile(d, 97.5))]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", type=Path, default=Path(__file__).resolve().parents[2] / "examples" / "family")
    p.add_argument("--rows", default=",".join(r for r in ROWS if r not in SLOW_ROWS),
                   help=f"comma-separated rows from {list(ROWS)} (default: all but {', '.join(SLOW_ROWS)})")
    p.add_argument("--directions", default="small-large,large-small",
                   help="source-target pairs of the family's model folders (e.g. large-small_kv4)")
    p.add_argument("--items", type=int, default=600, help="passage-recall items (default 600)")
    p.add_argument("--windows", type=int, default=660, help="perplexity windows (default 660)")
    p.add_argument("--prefix-len", type=int, default=128)
    p.add_argument("--num-sequences", type=int, default=None,
                   help="calibration sequences of 1024 tokens (default: fit_mapper's, i.e. all of calibration.txt)")
    p.add_argument("--exact-layers-items", type=int, default=None,
                   help="items per content probe of the fits (default: fit_mapper's, 64; fewer are faster)")
    p.add_argument("--ttft-len", type=int, default=1024,
                   help="prompt tokens of the time-to-first-token column (default 1024)")
    p.add_argument("--ttft-only", action="store_true",
                   help="only the time-to-first-token column (on an otherwise idle machine; the map's shapes, not its "
                        "quality, set the time, so a small --num-sequences is enough)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    if rows[0] != "default":
        rows.insert(0, "default")

    tok = AutoTokenizer.from_pretrained(args.family / "large")
    names = dict.fromkeys(n for direction in args.directions.split(",") for n in direction.split("-"))
    models = {n: AutoModelForCausalLM.from_pretrained(args.family / n, dtype=torch.float32).eval() for n in names}
    docs = split_documents((args.family / "heldout.txt").read_text(encoding="utf-8"), tok.eos_token)
    items = passage_recall_items(tok, args.items, seed=0, distractor_texts=docs)
    token_docs = [tok(d, add_special_tokens=False, verbose=False).input_ids for d in docs]
    window, step = 2 * args.prefix_len, args.prefix_len
    all_windows = [d[i : i + window] for d in token_docs for i in range(0, len(d) - window + 1, step)]
    keep = np.linspace(0, len(all_windows) - 1, min(args.windows, len(all_windows))).round().astype(int)
    windows = torch.tensor([all_windows[i] for i in keep])
    # TTFT prompt: the first `--ttft-len` tokens of the longest held-out document
    ttft_ids = torch.tensor([max(token_docs, key=len)[: args.ttft_len]])
    calibration = args.family / "calibration.txt"
    default_sequences = args.num_sequences or FitConfig().num_sequences
    fit_data = {"num_sequences": args.num_sequences} if args.num_sequences else {}
    if args.exact_layers_items:
        fit_data["exact_layers_items"] = args.exact_layers_items

    report = {"items": len(items), "windows": len(windows), "prefix_len": args.prefix_len,
              "ttft_len": int(ttft_ids.shape[1]), "threads": torch.get_num_threads(), "directions": {}}
    for direction in args.directions.split(","):
        src_name, tgt_name = direction.split("-")
        src, tgt = models[src_name], models[tgt_name]
        out = {"rows": {}}
        # default and the top_k rows come from one calibration pass (fit_mappers, in that order)
        ks = [8] + [ROWS[r][1]["top_k"] for r in rows if list(ROWS[r][1]) == ["top_k"]]
        t0 = time.perf_counter()
        fitted = list(fit_mappers(src, tgt, str(calibration), tokenizer=tok, progress=False, top_k=ks, **fit_data).values())
        shared_s = time.perf_counter() - t0
        mappers = {json.dumps({} if k == 8 else {"top_k": k}): (m, shared_s) for k, m in zip(ks, fitted)}
        base_recall = base_nll = None
        for name in rows:
            what, fit_over, cache_over = ROWS[name]
            if (cache_over.get("num_exact_layers") or 0) >= tgt.config.num_hidden_layers:
                print(f"{direction} {name}: skipped, the {tgt_name} target has only {tgt.config.num_hidden_layers} layers")
                continue
            key = json.dumps(fit_over, sort_keys=True)
            if key not in mappers:
                t0 = time.perf_counter()
                over = {**fit_data, **fit_over}
                if over.get("num_sequences") == "half":
                    over["num_sequences"] = default_sequences // 2
                mappers[key] = (fit_mapper(src, tgt, str(calibration), tokenizer=tok, progress=False, **over),
                                time.perf_counter() - t0)
            mapper, fit_s = mappers[key]
            exact = mapper.resolve_num_exact_layers(cache_over.get("num_exact_layers"))
            # None: TransferredCache's default (the last 32 context tokens, at most half the context)
            recompute = cache_over.get("num_recompute_tokens")
            timing = time_to_first_token(src, tgt, mapper, ttft_ids, num_recompute_tokens=recompute,
                                         num_exact_layers=exact, repeats=5)  # fmt: skip
            ttft = timing["transfer_ms"]
            out.setdefault("own_prefill_ms", timing["target_prefill_ms"])  # the first row's measurement
            if args.ttft_only:
                out["rows"][name] = {"what": what, "ttft_ms": round(ttft, 2)}
                print(f"{direction} {name}: TTFT {out['rows'][name]['ttft_ms']:.1f} ms (own prefill "
                      f"{out['own_prefill_ms']:.1f})", flush=True)
                continue
            res = passage_recall(src, tgt, mapper, items, num_recompute_tokens=recompute,
                                 num_exact_layers=exact, progress=False)
            per_item = {k: np.array(v) for k, v in res["correct_per_item"].items()}
            own, none, rec = per_item["own"], per_item["no_context"], per_item["transfer"]
            ppl = prefix_perplexity(src, tgt, mapper, windows, diagnostics=False, progress=False, num_bootstrap=1000,
                                    num_recompute_tokens=recompute, num_exact_layers=exact)
            nll = {k: np.array(v) for k, v in ppl["nll_per_window"].items()}
            if name == "default":
                base_recall, base_nll = rec, nll["transfer"]
                out["recall_own"], out["recall_no_context"] = float(own.mean()), float(none.mean())
            row = {
                "what": what,
                "num_exact_layers": exact,
                "fit_seconds": round(fit_s, 1),
                "recall_accuracy": float(rec.mean()),
                "recall_retention": res["retention"],
                "recall_retention_ci": res["retention_ci"],
                "ppl_retention": ppl["normalized_retention"],
                "ppl_retention_ci": ppl["normalized_retention_ci"],
                "ttft_ms": round(ttft, 2),
            }
            if name != "default":
                row["recall_diff"], row["recall_diff_ci"] = paired_diff(rec, base_recall, own, none)
                # perplexity retention in "higher is better" form: negated NLLs
                row["ppl_diff"], row["ppl_diff_ci"] = paired_diff(-nll["transfer"], -base_nll, -nll["target"], -nll["floor"])
            out["rows"][name] = row
            pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}"  # noqa: E731
            rci = row["recall_retention_ci"] or [None, None]
            diff = (f" | diff recall {pct(row['recall_diff'])} [{pct(row['recall_diff_ci'][0])}, {pct(row['recall_diff_ci'][1])}]"
                    f" ppl {pct(row['ppl_diff'])} [{pct(row['ppl_diff_ci'][0])}, {pct(row['ppl_diff_ci'][1])}]"
                    if name != "default" else "")
            print(f"{direction} {name}: recall acc {pct(row['recall_accuracy'])}% (own {pct(own.mean())}, none "
                  f"{pct(none.mean())}) retention {pct(row['recall_retention'])} [{pct(rci[0])}, {pct(rci[1])}] | "
                  f"ppl retention {pct(row['ppl_retention'])} [{pct(row['ppl_retention_ci'][0])}, "
                  f"{pct(row['ppl_retention_ci'][1])}]{diff} | TTFT {ttft:.1f} ms (own prefill {out['own_prefill_ms']:.1f}) "
                  f"| fit {fit_s:.0f}s", flush=True)
        report["directions"][direction] = out
    print(markdown_table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=float) + "\n")


if __name__ == "__main__":
    main()
