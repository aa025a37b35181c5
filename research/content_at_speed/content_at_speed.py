"""Content at speed: what maps that read the target's residual stream keep, and at what time to the first token.

Question, command and answer: README.md next to this file. One run = one direction (source -> target) of the bundled
family: a source-only ridge mapper fit like the demo's, the residual-input statistics of the same calibration
sequences (one pass), then every variant scored on the same held-out items (passage recall, hand-off, repeated
spans), paired bootstrap CIs of each variant's retention minus the reference variant's (today's default), and the
time to the first token own vs transfer at several prompt lengths (one thread).

    python research/content_at_speed/content_at_speed.py --source small --target large \\
        --variants kv:4 kv:2 res:1 res:0 --reference kv:4 --output research/content_at_speed/results/s2l.json

A variant is `dir:PATH` (a saved mapper at its own defaults: exact layers, recomputed tokens), `kv:E` (source K/V maps, E exact layers) or `res:J[:R][:readers][:src]` (maps also reading the
target's residual entering layer J, J + 1 exact layers, optional shared residual rank R, `-` for full, the target
layers that read it, comma-separated, `-` for all after J, and the source layers the mapped layers read: `-` the
fit's top-k, `last` the last source layer only, `none` no source K/V).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_kvtransfer import KVMapper, TransferredCache, fit_mapper, prefill
from hf_kvtransfer.evaluation.content import handoff, passage_recall, repeated_span_retention
from hf_kvtransfer.evaluation.tasks import handoff_items, passage_recall_items, repeated_span_items
from hf_kvtransfer.evaluation.timing import median_ms, time_call
from hf_kvtransfer.fitting.calibration_pass import calibration_pass
from hf_kvtransfer.fitting.residual_stats import ResidualStatistics, solve_residual_mapper

FAMILY = Path(__file__).resolve().parents[2] / "examples" / "family"


def split_documents(text: str, eos: str) -> list[str]:
    docs = [d.strip() for d in text.replace(eos, "\n\n").split("\n\n")]
    return [d for d in docs if len(d) > 200]


@dataclass
class FamilyPair:
    """A pair of the bundled family (float32, eval), its tokenizer, the calibration token stream and held-out text."""

    tokenizer: Any
    source: Any
    target: Any
    calibration_ids: torch.Tensor  # the whole of calibration.txt, one stream
    heldout: str
    documents: list[str]  # heldout.txt split into documents (`split_documents`)

    def calibration_rows(self, num_rows: int, seq_len: int = 256) -> torch.Tensor:
        return self.calibration_ids[: num_rows * seq_len].reshape(-1, seq_len)


def load_pair(source: str, target: str, family: Path = FAMILY) -> FamilyPair:
    """Two models of a bundled family directory (`examples/family` by default), its calibration and held-out text."""
    family = Path(family)
    tok = AutoTokenizer.from_pretrained(family / "tokenizer" if (family / "tokenizer").is_dir() else family / target)
    src, tgt = (AutoModelForCausalLM.from_pretrained(family / name, dtype=torch.float32).eval() for name in (source, target))
    calibration = tok((family / "calibration.txt").read_text(encoding="utf-8"), return_tensors="pt").input_ids[0]
    heldout = (family / "heldout.txt").read_text(encoding="utf-8")
    return FamilyPair(tok, src, tgt, calibration, heldout, split_documents(heldout, tok.eos_token or "<|endoftext|>"))


def _tables_plugin() -> None:
    """Register research/token_tables's map inputs (token tables, the first-layer table), which the library no longer
    holds, so that mappers saved with them load."""
    import sys

    folder = str(Path(__file__).resolve().parents[1] / "token_tables")
    if folder not in sys.path:
        sys.path.append(folder)
    import token_tables_plugin  # noqa: F401


def build(variant: str, base, stats):
    if variant.startswith("dir:"):  # a saved mapper at its own defaults (what `hf-kvtransfer fit` chose)
        _tables_plugin()  # a mapper with token tables (research/token_tables's plug-in) loads too
        mapper = KVMapper.from_pretrained(variant[4:])
        return mapper, mapper.num_exact_layers
    kind, *rest = variant.split(":")
    if kind == "kv":
        return base, int(rest[0])
    layer = int(rest[0])
    rank = int(rest[1]) if len(rest) > 1 and rest[1] != "-" else None
    readers = [int(t) for t in rest[2].split(",")] if len(rest) > 2 and rest[2] != "-" else None
    mapped = range(layer + 1, len(base.config.selected_layers))
    num_source = base.source_layout.num_layers
    inputs = rest[3] if len(rest) > 3 else "-"
    sources = {"-": {}, "last": {t: [num_source - 1] for t in mapped}, "none": {t: [] for t in mapped}}[inputs]
    return solve_residual_mapper(base, stats, layer, residual_rank=rank, readers=readers, sources=sources), layer + 1


def paired(per_item: dict[str, np.ndarray], ref: dict[str, np.ndarray], higher_is_better: bool, n_boot=2000, seed=0):
    """Retention of a variant and its paired difference to the reference variant, bootstrap over items."""
    own, none_, tr, tr_ref = (np.asarray(x, dtype=float) for x in (per_item["own"], per_item["no_context"],
                                                                  per_item["transfer"], ref["transfer"]))  # fmt: skip

    def ret(idx, t):
        gap = own[idx].mean() - none_[idx].mean()
        return (t[idx].mean() - none_[idx].mean()) / gap if higher_is_better else (none_[idx].mean() - t[idx].mean()) / (none_[idx].mean() - own[idx].mean())

    rng = np.random.default_rng(seed)
    all_idx = np.arange(len(own))
    boots = rng.integers(0, len(own), size=(n_boot, len(own)))
    r = [ret(b, tr) for b in boots]
    d = [ret(b, tr) - ret(b, tr_ref) for b in boots]
    return {"retention": float(ret(all_idx, tr)), "retention_ci": [float(np.percentile(r, 2.5)), float(np.percentile(r, 97.5))],
            "minus_reference": float(ret(all_idx, tr) - ret(all_idx, tr_ref)),
            "minus_reference_ci": [float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5))]}  # fmt: skip


def ttft(source, target, mapper, ids, num_exact, repeats):
    src_cache = prefill(source, ids)

    def transfer():
        cache = TransferredCache(src_cache, mapper, num_exact_layers=num_exact, model=target)
        target(ids[:, -cache.num_recompute_tokens:], use_cache=True, logits_to_keep=1, cache=cache)

    with torch.no_grad():
        t_wall, t_cpu = time_call(transfer, "cpu", repeats)
        o_wall, o_cpu = time_call(lambda: target(ids, use_cache=True, logits_to_keep=1), "cpu", repeats)
    return {"transfer_ms": median_ms(t_wall), "own_ms": median_ms(o_wall), "speedup": median_ms(o_wall) / median_ms(t_wall),
            "transfer_cpu_ms": median_ms(t_cpu), "own_cpu_ms": median_ms(o_cpu), "speedup_cpu": median_ms(o_cpu) / median_ms(t_cpu)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="small")
    p.add_argument("--target", default="large")
    p.add_argument("--variants", nargs="+", default=["kv:4", "kv:2", "res:1"])
    p.add_argument("--reference", default="kv:4", help="the variant the paired differences are taken against")
    p.add_argument("--base-sequences", type=int, default=64, help="calibration x 256 tokens of the source-only fit (stride 4)")
    p.add_argument("--residual-sequences", type=int, default=128, help="calibration x 256 tokens of the residual statistics")
    p.add_argument("--residual-stride", type=int, default=1)
    p.add_argument("--recall-items", type=int, default=600)
    p.add_argument("--handoff-items", type=int, default=600)
    p.add_argument("--span-items", type=int, default=660)
    p.add_argument("--ttft-lengths", type=int, nargs="*", default=[512, 1024, 4096])
    p.add_argument("--ttft-repeats", type=int, default=5)
    p.add_argument("--output", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    started = time.time()
    pair = load_pair(args.source, args.target)
    tok, source, target, cal = pair.tokenizer, pair.source, pair.target, pair.calibration_ids
    ids = cal[: max(args.base_sequences, args.residual_sequences) * 256].reshape(-1, 256)
    base = fit_mapper(source, target, ids[: args.base_sequences], top_k=4, num_exact_layers=1, progress=False)
    layers = sorted({int(v.split(":")[1]) for v in args.variants + [args.reference] if v.startswith("res")})
    stats = ResidualStatistics.for_models(source, target, layers, stride=args.residual_stride)
    if layers:
        calibration_pass(source, target, ids[: args.residual_sequences], consumers=[stats], progress=False)
    heldout, docs = pair.heldout, pair.documents
    stream = tok(heldout, verbose=False)["input_ids"]
    recall = passage_recall_items(tok, args.recall_items, seed=0, distractor_texts=docs) if args.recall_items else []
    hand = handoff_items(tok, args.handoff_items, seed=0, distractor_texts=docs) if args.handoff_items else []
    spans = repeated_span_items(tok, stream, args.span_items, seed=0, prefix_len=256, continuation_len=64, kind="text") if args.span_items else []
    variants = list(dict.fromkeys([args.reference, *args.variants]))
    raw: dict[str, dict] = {}
    span_ref = None
    for v in variants:
        mapper, num_exact = build(v, base, stats)
        res = mapper.config.map_inputs.get("residual")
        row = {"num_exact_layers": num_exact, "residual_layer": getattr(res, "layer", None),
               "num_recompute_tokens": mapper.config.num_recompute_tokens,
               "selected_layers": mapper.config.selected_layers,
               "residual_readers": getattr(res, "readers", None), "residual_rank": getattr(res, "rank", None)}  # fmt: skip
        with torch.no_grad():
            if recall:
                r = passage_recall(source, target, mapper, recall, num_exact_layers=num_exact, progress=False)
                row["recall"] = {k: np.asarray(r["correct_per_item"][k], dtype=float) for k in ("own", "transfer", "no_context")}
            if hand:
                r = handoff(source, target, mapper, hand, num_exact_layers=num_exact, progress=False)
                row["handoff"] = {k: np.asarray(r["correct_per_item"][k], dtype=float) for k in ("own", "transfer", "no_context")}
            if spans:
                r = repeated_span_retention(source, target, mapper, spans, num_recompute_tokens=1, num_exact_layers=num_exact,
                                            progress=False, reference=span_ref)  # fmt: skip
                span_ref = span_ref or r
                row["spans"] = {k: np.asarray(r["nll_per_item"][k], dtype=float) for k in ("own", "transfer", "no_context")}
        row["ttft"] = {}
        for n in args.ttft_lengths:
            long_ids = torch.tensor(stream[:n]).unsqueeze(0)
            row["ttft"][str(n)] = ttft(source, target, mapper, long_ids, num_exact, args.ttft_repeats)
        raw[v] = row
        print(v, {k: (f"{row['ttft'][k]['speedup']:.2f}x") for k in row["ttft"]}, f"{time.time() - started:.0f}s", flush=True)
    results = {"source": args.source, "target": args.target, "reference": args.reference, "threads": 1,
               "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "load_average_at_end": None, "variants": {}}  # fmt: skip
    for v, row in raw.items():
        out = {k: row[k] for k in ("num_exact_layers", "num_recompute_tokens", "residual_layer", "residual_readers",
                                   "residual_rank", "selected_layers", "ttft")}
        for task, higher in (("recall", True), ("handoff", True), ("spans", False)):
            if task in row:
                out[task] = paired(row[task], raw[args.reference][task], higher)
                out[task]["own"], out[task]["no_context"] = float(row[task]["own"].mean()), float(row[task]["no_context"].mean())
                out[task]["transfer"] = float(row[task]["transfer"].mean())
                out[task]["num_items"] = len(row[task]["own"])
        results["variants"][v] = out
        print(v, {t: f"{out[t]['retention']:.3f} [{out[t]['retention_ci'][0]:.3f}, {out[t]['retention_ci'][1]:.3f}]"
                  for t in ("recall", "handoff", "spans") if t in out})  # fmt: skip
    results["load_average_at_end"] = os.getloadavg()
    results["seconds"] = time.time() - started
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
