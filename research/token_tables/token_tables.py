"""Token tables: do per-token lookups of the prompt ids give the copy layers what linear maps miss?

A mapped layer's stripped keys and values get a correction `sum_a T_a[ids[t - a]]` over lags a (one table of
`vocab x (kv_heads * head_dim)` per lag, kind and layer), fit to what the map misses (the target's own stripped K/V
minus the map's; for the keys of a map that predicts them before the target's k_norm, before it) by ridge on one-hot
features, solved by backfitting (each lag's table is the shrunk per-token mean of what the other lags leave; a
standalone prototype of what `token_tables_plugin/fit.py` in this folder does). At transfer time that is a gather and an add: no multiply-add. Passage recall (greedy
first answer token, the cache's 32 recomputed tokens) is scored with the library's map, with the tables added on
the chosen layers, and with the target's own K/V of those layers (the bound). One thread.

    python research/token_tables/token_tables.py --source small --target large --exact 1 --items 200
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_kvtransfer import TransferredCache, fit_mapper, prefill
from hf_kvtransfer.core.rope import build_rotary_embedding, rotary_cos_sin, rotate_half, strip_rope
from hf_kvtransfer.evaluation.metrics import retention_difference, retention_over_items
from hf_kvtransfer.evaluation.tasks import passage_recall_items
from hf_kvtransfer.fitting.calibration_pass import calibration_pass
from hf_kvtransfer.core.residual import residual_readers
from hf_kvtransfer.fitting.residual_stats import ResidualStatistics, solve_residual_mapper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "content_at_speed"))
from content_at_speed import load_pair  # noqa: E402


def flat(x: torch.Tensor) -> torch.Tensor:
    """[1, heads, seq, d] -> [seq, heads * d]."""
    return x[0].transpose(0, 1).reshape(x.shape[2], -1)


def unflat(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.reshape(x.shape[0], heads, -1).transpose(0, 1)[None]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="small")
    p.add_argument("--target", default="large")
    p.add_argument("--exact", type=int, default=1, help="exact layers of the source-only map (no residual)")
    p.add_argument("--residual-layer", type=int, default=None, help="maps also read the residual entering this layer")
    p.add_argument("--layers", default="all", help="mapped layers that get tables: 'all' or comma-separated")
    p.add_argument("--lags", default="0,1,2,3")
    p.add_argument("--lam", type=float, nargs="+", default=[1.0, 3.0], help="pseudo-counts to try (held-out MSE picks)")
    p.add_argument("--after-norm", action="store_true",
                   help="fit and add the residual readers' key tables after the target's k_norm (default: before)")
    p.add_argument("--train-rows", type=int, default=1024)
    p.add_argument("--items", type=int, default=200)
    p.add_argument("--output", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    lags = [int(a) for a in args.lags.split(",")]
    pair = load_pair(args.source, args.target)
    tok, src, tgt = pair.tokenizer, pair.source, pair.target
    vocab, L = tgt.config.vocab_size, tgt.config.num_hidden_layers
    rows = min(args.train_rows, len(pair.calibration_ids) // 256)
    cal = pair.calibration_rows(rows)
    mapper = fit_mapper(src, tgt, cal[:64], top_k=4, num_exact_layers=args.exact, residual_inputs="off", progress=False)
    if args.residual_layer is not None:
        stats = ResidualStatistics.for_models(src, tgt, [args.residual_layer])
        calibration_pass(src, tgt, cal[:128], consumers=[stats], progress=False)
        mapper = solve_residual_mapper(mapper, stats, args.residual_layer)
    exact = mapper.num_exact_layers
    layers = list(range(exact, L)) if args.layers == "all" else [int(t) for t in args.layers.split(",")]
    rotary = build_rotary_embedding(tgt.config)
    heads = tgt.config.num_key_value_heads
    # Keys before the target's k_norm: what a residual reader's map predicts (the cache applies the norm), and the
    # target's own. Captured from the norm's input where the sequence is the transferred part.
    prenorm = set(residual_readers(mapper.config)) if "key_norm" in mapper.config.map_inputs and not args.after_norm else set()
    captured: dict[int, torch.Tensor] = {}
    norms = {t: tgt.model.layers[t].self_attn.k_norm for t in prenorm}

    def hook(t):
        def pre(module, args):
            if args[0].shape[1] == captured.get("want", -1):
                captured[t] = args[0].detach().reshape(args[0].shape[1], -1).clone()  # (T, H * D)
        return pre

    for t in prenorm:
        norms[t].register_forward_pre_hook(hook(t))

    def caches(ids, held, r):
        captured.clear()
        captured["want"] = held
        transferred = TransferredCache(prefill(src, ids), mapper, num_recompute_tokens=r, model=tgt)
        logits = tgt(ids[:, -r:], cache=transferred).logits[0, -1]
        mapped_pre = {t: captured[t] for t in prenorm}
        captured.clear()
        captured["want"] = held
        own = tgt(ids[:, :held], use_cache=True).past_key_values
        own_pre = {t: captured[t] for t in prenorm}
        cos, sin = rotary_cos_sin(rotary, torch.arange(held)[None], torch.device("cpu"))
        return transferred, own, logits, (cos, sin), mapped_pre, own_pre

    t0 = time.perf_counter()
    all_ids, resid = [], {(t, k): [] for t in layers for k in "kv"}
    with torch.no_grad():
        for row in cal:
            ids = row[None]
            transferred, own, _, (cos, sin), mapped_pre, own_pre = caches(ids, 255, 1)
            all_ids.append(row[:255])
            for t in layers:
                if t in prenorm:
                    resid[t, "k"].append(own_pre[t] - mapped_pre[t])
                else:
                    mk = strip_rope(transferred.layers[t].keys[:, :, :255], cos, sin)
                    ok = strip_rope(own.layers[t].keys, cos, sin)
                    resid[t, "k"].append(flat(ok) - flat(mk))
                resid[t, "v"].append(flat(own.layers[t].values) - flat(transferred.layers[t].values[:, :, :255]))
    print(f"features {time.perf_counter() - t0:.0f} s over {rows} rows; exact layers {exact}; tables on {layers}", flush=True)
    n_val = max(1, rows // 8)
    ids_tr, ids_va = torch.cat(all_ids[n_val:]), torch.cat(all_ids[:n_val])
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "mse": {}, "accuracy": {}, "retention": {}}
    best = {}
    for key, chunks in resid.items():
        tr, va = torch.cat(chunks[n_val:]), torch.cat(chunks[:n_val])
        scores = {}
        for lam in args.lam:
            tables = fit_rowwise(ids_tr, tr, lags, vocab, lam, 255)
            pred = apply_rowwise(tables, ids_va, lags, vocab, 255)
            scores[lam] = (float((va - pred).pow(2).mean()), tables)
        lam = min(scores, key=lambda k: scores[k][0])
        best[key] = scores[lam][1]
        result["mse"][f"{key[0]}{key[1]}"] = {"map": float(va.pow(2).mean()), **{str(k): v[0] for k, v in scores.items()}, "lambda": lam}
        print(f"layer {key[0]} {key[1]}: held-out MSE map {va.pow(2).mean():.4f} -> +tables "
              + ", ".join(f"lam {k:g}: {v[0]:.4f}" for k, v in scores.items()), flush=True)

    items = passage_recall_items(tok, args.items, seed=0, distractor_texts=pair.documents)
    r = 32
    names = ("own", "transfer", "transfer + tables (K)", "transfer + tables (K, V)", "transfer, own K/V of those layers", "floor")
    scores = {n: [] for n in names}
    with torch.no_grad():
        for it in items:
            ids = torch.tensor([it.prompt_ids])
            held = ids.shape[1] - r
            transferred, own, logits, (cos, sin), mapped_pre, _ = caches(ids, held, r)
            answer = it.answer_ids[0]
            scores["own"].append(int(tgt(ids[:, -r:], cache=own).logits[0, -1].argmax() == answer))
            scores["transfer"].append(int(logits.argmax() == answer))
            pid = ids[0, :held]
            for name, use_v in (("transfer + tables (K)", False), ("transfer + tables (K, V)", True), ("own", None)):
                cache = DynamicCache()
                for t in range(L):
                    k, v = transferred.layers[t].keys[:, :, :held], transferred.layers[t].values[:, :, :held]
                    if t in layers and use_v is None:
                        k, v = own.layers[t].keys[:, :, :held], own.layers[t].values[:, :, :held]
                    elif t in layers:
                        delta = apply_rowwise(best[t, "k"], pid, lags, vocab, None)
                        if t in prenorm:  # the target's own k_norm on the corrected pre-norm keys
                            sk = norms[t](unflat(mapped_pre[t] + delta, heads).transpose(1, 2)).transpose(1, 2)
                        else:
                            sk = unflat(flat(strip_rope(k, cos, sin)) + delta, heads)
                        k = sk * cos + rotate_half(sk) * sin
                        if use_v:
                            v = unflat(flat(v) + apply_rowwise(best[t, "v"], pid, lags, vocab, None), heads)
                    cache.update(k.clone(), v.clone(), t)
                out = int(tgt(ids[:, -r:], cache=cache).logits[0, -1].argmax() == answer)
                scores["transfer, own K/V of those layers" if use_v is None else name].append(out)
            scores["floor"].append(int(tgt(torch.tensor([it.no_passage_prompt_ids])).logits[0, -1].argmax() == answer))
    result["accuracy"] = {n: sum(s) / len(s) for n, s in scores.items()}
    for name in names[1:-1]:
        ret = retention_over_items(scores["own"], scores[name], scores["floor"])
        diff = retention_difference(scores["own"], scores["floor"], scores[name], scores["transfer"])
        result["retention"][name] = {"retention": ret["retention"], "ci": ret["retention_ci"], "minus_transfer": diff}
        print(f"{name}: accuracy {result['accuracy'][name]:.3f}, recall retention {ret['retention']:.3f} "
              f"{[round(c, 3) for c in ret['retention_ci']]}, minus the transfer's {diff['difference']:+.3f} "
              f"{[round(c, 3) for c in diff['difference_ci']]}", flush=True)
    print(f"own accuracy {result['accuracy']['own']:.3f}, floor {result['accuracy']['floor']:.3f}")
    if args.output:
        args.output.write_text(json.dumps(result, indent=1))


def row_lagged(ids: torch.Tensor, lag: int, pad: int, row_len: int | None) -> torch.Tensor:
    """Lagged ids within rows of `row_len` (None: one row)."""
    out = torch.full_like(ids, pad)
    out[lag:] = ids[: len(ids) - lag]
    if row_len is not None and lag:
        pos = torch.arange(len(ids)) % row_len
        out[pos < lag] = pad
    return out


def fit_rowwise(ids, resid, lags, vocab, lam, row_len, sweeps: int = 6):
    tables = resid.new_zeros(len(lags), vocab + 1, resid.shape[1])
    idx = [row_lagged(ids, a, vocab, row_len) for a in lags]
    counts = [torch.bincount(i, minlength=vocab + 1).to(resid.dtype)[:, None] for i in idx]
    fitted = resid.new_zeros(resid.shape)
    for _ in range(sweeps):
        for j, i in enumerate(idx):
            fitted -= tables[j][i]
            tables[j] = torch.zeros_like(tables[j]).index_add_(0, i, resid - fitted) / (counts[j] + lam)
            fitted += tables[j][i]
    return tables


def apply_rowwise(tables, ids, lags, vocab, row_len):
    return sum(tables[j][row_lagged(ids, a, vocab, row_len)] for j, a in enumerate(lags))


if __name__ == "__main__":
    main()
