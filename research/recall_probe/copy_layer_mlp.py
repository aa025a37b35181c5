"""A non-linear correction of the copy layer's keys: does an MLP on what the target already computed recover the
passage recall a residual-reading linear map loses?

The residual mapper (`residual_stats.solve_residual_mapper`, `residual_layer` J, J + 1 exact layers) maps the copy
layer's keys linearly from the source's RoPE-stripped K/V and the target's residual entering layer J. Here a
two-hidden-layer ReLU MLP adds a correction to that map's stripped keys, from the map's own keys and the residual
at lags 0 .. L-1: `k = map(x) + mlp([map(x), r_t, ..., r_{t-L+1}])`, trained (Adam, MSE, early stopping on held-out
calibration rows) to the target's own stripped keys. Passage recall (greedy first answer token, 32 recomputed
tokens as the cache's default) is scored with every mapped layer as `TransferredCache` computes it, then with the
copy layer's keys corrected, then with that layer's keys the target's own (the bound any key map can reach). One
thread.

    python research/recall_probe/copy_layer_mlp.py --source large --target small --residual-layer 1 --layer 3 --items 600 \\
        --hidden 64 256 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache

from hf_kvtransfer import TransferredCache, fit_mapper, prefill
from hf_kvtransfer.core.rope import build_rotary_embedding, rotary_cos_sin, rotate_half, strip_rope
from hf_kvtransfer.evaluation.metrics import retention_difference, retention_over_items
from hf_kvtransfer.evaluation.tasks import passage_recall_items
from hf_kvtransfer.evaluation.timing import time_to_first_token
from hf_kvtransfer.fitting.calibration_pass import calibration_pass
from hf_kvtransfer.fitting.residual_stats import ResidualStatistics, solve_residual_mapper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "content_at_speed"))
from content_at_speed import load_pair  # noqa: E402


def rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def lagged(h: torch.Tensor, lags: int) -> torch.Tensor:
    """[seq, hidden] -> [seq, lags * hidden]: the RMS-normalised rows at t, t-1, ... (zeros before the start)."""
    h = rms(h.float())
    out = h.new_zeros(h.shape[0], lags * h.shape[1])
    for lag in range(lags):
        out[lag:, lag * h.shape[1] : (lag + 1) * h.shape[1]] = h[: h.shape[0] - lag]
    return out


class Features:
    """Per prompt: the transfer's stripped keys of `layer`, the target's own, and the MLP's inputs."""

    def __init__(self, src, tgt, mapper, layer: int, residual_layer: int, lags: int):
        self.src, self.tgt, self.mapper, self.layer, self.j, self.lags = src, tgt, mapper, layer, residual_layer, lags
        self.rotary = build_rotary_embedding(tgt.config)

    def __call__(self, ids: torch.Tensor, held: int, recompute: int):
        transferred = TransferredCache(prefill(self.src, ids), self.mapper, num_recompute_tokens=recompute, model=self.tgt)
        logits = self.tgt(ids[:, -recompute:], cache=transferred).logits[0, -1]
        own = self.tgt(ids[:, :held], use_cache=True, output_hidden_states=True)
        cos, sin = rotary_cos_sin(self.rotary, torch.arange(held)[None], torch.device("cpu"))
        mapped = strip_rope(transferred.layers[self.layer].keys[:, :, :held], cos, sin)  # [1, h, held, d]
        exact = strip_rope(own.past_key_values.layers[self.layer].keys, cos, sin)
        flat = lambda k: k[0].transpose(0, 1).reshape(held, -1)  # noqa: E731
        inputs = torch.cat([flat(mapped), lagged(own.hidden_states[self.j][0], self.lags)], dim=-1)
        return transferred, own.past_key_values, logits, flat(mapped), flat(exact), inputs, (cos, sin)


class Correction(nn.Module):
    def __init__(self, width_in: int, width_out: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, width_out))
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)
        self.register_buffer("mean", torch.zeros(width_in))
        self.register_buffer("std", torch.ones(width_in))

    def forward(self, x):
        return self.net((x - self.mean) / self.std)


def train(x, y, xv, yv, hidden: int, epochs: int, lr: float):
    model = Correction(x.shape[1], y.shape[1], hidden)
    model.mean.copy_(x.mean(0))
    model.std.copy_(x.std(0).clamp_min(1e-4))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs)
    best, best_state, log = float(yv.pow(2).mean()), {k: v.clone() for k, v in model.state_dict().items()}, []
    for epoch in range(epochs):
        perm = torch.randperm(len(x))
        for i in range(0, len(x), 512):
            b = perm[i : i + 512]
            loss = (model(x[b]) - y[b]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        sched.step()
        with torch.no_grad():
            val = float((model(xv) - yv).pow(2).mean())
        log.append(val)
        if val < best:
            best, best_state = val, {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(best_state)
    return model, float(yv.pow(2).mean()), best, log


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="large")
    p.add_argument("--target", default="small")
    p.add_argument("--residual-layer", type=int, default=1)
    p.add_argument("--layer", type=int, default=3, help="the copy layer whose keys get the MLP correction")
    p.add_argument("--lags", type=int, default=8, help="residual positions t .. t-L+1 the MLP reads")
    p.add_argument("--hidden", type=int, nargs="+", default=[1024], help="MLP widths to try (one model each)")
    p.add_argument("--features-cache", type=Path, help="keep the calibration features here (reused when present)")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-rows", type=int, default=448, help="calibration rows of 256 tokens for the MLP")
    p.add_argument("--items", type=int, default=600)
    p.add_argument("--output", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    pair = load_pair(args.source, args.target)
    tok, src, tgt, cal_ids = pair.tokenizer, pair.source, pair.target, pair.calibration_ids
    rows = min(args.train_rows, len(cal_ids) // 256)
    cal = cal_ids[: rows * 256].reshape(-1, 256)
    base = fit_mapper(src, tgt, cal[:64], top_k=4, num_exact_layers=1, residual_inputs="off", progress=False)
    stats = ResidualStatistics.for_models(src, tgt, [args.residual_layer])
    calibration_pass(src, tgt, cal[:128], consumers=[stats], progress=False)
    mapper = solve_residual_mapper(base, stats, args.residual_layer)
    feats = Features(src, tgt, mapper, args.layer, args.residual_layer, args.lags)

    t0 = time.perf_counter()
    if args.features_cache and args.features_cache.exists():
        xs, ys = torch.load(args.features_cache)
    else:
        xs, ys = [], []
        with torch.no_grad():
            for row in cal:
                _, _, _, mapped, exact, inputs, _ = feats(row[None], 255, 1)
                xs.append(inputs)
                ys.append(exact - mapped)
        if args.features_cache:
            torch.save((xs, ys), args.features_cache)
    n_val = max(1, len(xs) // 8)
    x, y = torch.cat(xs[n_val:]), torch.cat(ys[n_val:])
    xv, yv = torch.cat(xs[:n_val]), torch.cat(ys[:n_val])
    print(f"features {time.perf_counter() - t0:.0f} s; rows {len(cal)} ({len(x)} train tokens)", flush=True)
    models, result = {}, {"args": {k: str(v) for k, v in vars(args).items()}, "mlp": {}, "accuracy": {}, "retention": {}}
    for hidden in args.hidden:
        t0 = time.perf_counter()
        model, mse_map, mse_mlp, log = train(x, y, xv, yv, hidden, args.epochs, args.lr)
        models[f"transfer + MLP keys ({hidden})"] = model.eval()
        # Its cost next to what it saves, on 1024 tokens: the correction, the transfer it corrects and the target's
        # own prefill (both as `generate` runs them), timed in interleaved rounds.
        probe = torch.randint(0, tgt.config.vocab_size, (1, 1024))
        inputs = torch.randn(1023 - 32, x.shape[1])
        mlp_ms, transfer_ms, prefill_ms = [], [], []
        with torch.no_grad():
            for _ in range(7):
                a = time.perf_counter()
                model(inputs)
                mlp_ms.append(1e3 * (time.perf_counter() - a))
                t = time_to_first_token(src, tgt, mapper, probe, num_exact_layers=args.residual_layer + 1, repeats=1)
                transfer_ms.append(t["transfer_ms"])
                prefill_ms.append(t["target_prefill_ms"])
        mlp_ms, transfer_ms, prefill_ms = (statistics.median(v) for v in (mlp_ms, transfer_ms, prefill_ms))
        result["mlp"][hidden] = {"heldout_mse_map": mse_map, "heldout_mse_map_mlp": mse_mlp, "val_log": log,
                                 "parameters": sum(q.numel() for q in model.net.parameters()),
                                 "train_s": time.perf_counter() - t0, "mlp_ms_1024": mlp_ms,
                                 "transfer_ms_1024": transfer_ms, "target_prefill_ms_1024": prefill_ms}
        print(f"MLP {hidden}: held-out MSE map {mse_map:.4f} -> map + MLP {mse_mlp:.4f}; "
              f"{result['mlp'][hidden]['parameters']:,} parameters; at 1024 tokens the correction takes {mlp_ms:.1f} ms, "
              f"the transfer {transfer_ms:.1f} ms, the target's prefill {prefill_ms:.1f} ms: {prefill_ms / transfer_ms:.2f}x "
              f"-> {prefill_ms / (transfer_ms + mlp_ms):.2f}x with the correction (medians of 7 interleaved)", flush=True)

    docs = pair.documents
    items = passage_recall_items(tok, args.items, seed=0, distractor_texts=docs)
    r = 32
    names = ("own", "transfer", *models, "transfer, own keys", "floor")
    scores: dict[str, list[int]] = {n: [] for n in names}
    with torch.no_grad():
        for it in items:
            ids = torch.tensor([it.prompt_ids])
            held = ids.shape[1] - r
            transferred, own, logits, mapped, _, inputs, (cos, sin) = feats(ids, held, r)
            answer = it.answer_ids[0]
            scores["own"].append(int(tgt(ids[:, -r:], cache=own).logits[0, -1].argmax() == answer))
            scores["transfer"].append(int(logits.argmax() == answer))
            shape = transferred.layers[args.layer].keys.shape
            variants = {"transfer, own keys": own.layers[args.layer].keys[:, :, :held]}
            for name, model in models.items():
                corrected = (mapped + model(inputs)).reshape(held, shape[1], shape[3]).transpose(0, 1)[None]
                variants[name] = corrected * cos + rotate_half(corrected) * sin
            for name, keys in variants.items():
                cache = DynamicCache()
                for t in range(tgt.config.num_hidden_layers):
                    k, v = transferred.layers[t].keys[:, :, :held], transferred.layers[t].values[:, :, :held]
                    cache.update((keys if t == args.layer else k).clone(), v.clone(), t)
                scores[name].append(int(tgt(ids[:, -r:], cache=cache).logits[0, -1].argmax() == answer))
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


if __name__ == "__main__":
    main()
