"""Speed levers for content-keeping maps that read the target's residual stream (issue 24).

Standalone (transformers + torch only; no import of hf_kvtransfer). The target runs layers 0..J-1 fully on the
prompt, layer J's K/V exactly from the residual entering J (its own input_layernorm + k_proj + k_norm + RoPE,
v_proj), and every deeper layer's K/V is predicted by ridge (closed form, standardized features, float64) from a
per-layer choice of inputs: the source's RoPE-stripped K (for K) / V (for V) of chosen source layers, the target's
residual entering layer J (RMS-normed, no weight) at lags, or that residual seen through the layer's own
input_layernorm + k_proj / v_proj ("own"). Keys are predicted before the target's k_norm (the target's own k_norm
and RoPE are applied). Each variant reports repeated-span retention on [A|B|A] windows of heldout.txt with a 95%
bootstrap CI (paired against the first variant on the same windows), the maps' MACs per token as a fraction of one
target layer at the timed length, and the time to first token at --ttft-len tokens (own prefill vs exact pass +
maps + --recompute tokens, interleaved repeats, medians, same process).

Variant spec: NAME:key=val;key=val (keys below; defaults = every mapped layer reads src + residual t,t-1,t-2):
  J=1            layers 0..J-1 run fully, layer J exact from the residual (J=1 or 2)
  res=2,3|none   mapped layers that read the residual (default all mapped)
  lags=0,1,2     residual lags
  own=1          residual features through the layer's own norm + k_proj/v_proj (key/value space) at each lag
  rank=16        per-layer reduced-rank ridge on the residual block (K and V of a layer jointly: 2*head-dim outputs)
  srank=64       one reduced-rank factor of the residual block shared by all residual-reading layers (supervised)
  nosrc=2,3|res  mapped layers that do not read the source (residual alone); 'res' = all residual readers
  src=0,1,2,3    source layers read (default all)
  plain=2,3      layers whose K/V are the target's own projections of the residual entering J (no fit)
  zero=2,4       layers whose K/V are the calibration mean (no inputs, no MACs)

Example (from the repo root, about 30 seconds on one thread):
  OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python research/speed_levers/speed_levers.py \
      --source small --target large --n-cal 32 --n-win 50 --ttft-repeats 3 \
      --variant 'full:' --variant 'r23:res=2,3' --out /tmp/speed_demo.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default=str(Path(__file__).resolve().parents[2] / "examples" / "family"),
                   help="family directory (default: the repository's examples/family)")
    p.add_argument("--source", default="small")
    p.add_argument("--target", default="large")
    p.add_argument("--n-cal", type=int, default=128, help="calibration sequences of 256 tokens of calibration.txt")
    p.add_argument("--n-win", type=int, default=200, help="[A|B|A] windows of heldout.txt (A=48, B=96, seed 0)")
    p.add_argument("--lam", type=float, default=1e-2)
    p.add_argument("--ttft-len", type=int, default=1024)
    p.add_argument("--recompute", type=int, default=32, help="tokens the target recomputes in the TTFT")
    p.add_argument("--recompute-alt", type=int, default=1, help="also time with this many recomputed tokens (0 = no)")
    p.add_argument("--ttft-repeats", type=int, default=7, help="interleaved own/transfer repeats (0 = skip TTFT)")
    p.add_argument("--variant", action="append", required=True, help="NAME:key=val;... (see above)")
    p.add_argument("--out", required=True)
    return p.parse_args()


args = parse_args()
torch.set_num_threads(1)
FAM = args.family
tok = AutoTokenizer.from_pretrained(f"{FAM}/tokenizer")


def load(name):
    return AutoModelForCausalLM.from_pretrained(f"{FAM}/{name}", dtype=torch.float32).eval()


def tokens(fname):
    return torch.tensor(tok(open(f"{FAM}/{fname}").read()).input_ids)


src, tgt = load(args.source), load(args.target)
L, Ls = tgt.config.num_hidden_layers, src.config.num_hidden_layers
D = tgt.config.head_dim
KVD = tgt.config.num_key_value_heads * D  # per-layer K (and V) width
HID = tgt.config.hidden_size


# ------------------------------------------------------------------ capture
@torch.no_grad()
def capture(model, ids, want_h=(1, 2)):
    layers = model.model.layers
    K, V, Kp, H = {}, {}, {}, {}
    hooks = []
    for i, layer in enumerate(layers):
        a = layer.self_attn
        hooks.append(a.k_norm.register_forward_hook(lambda m, i_, o, i=i: K.__setitem__(i, o.flatten(-2))))
        hooks.append(a.k_proj.register_forward_hook(lambda m, i_, o, i=i: Kp.__setitem__(i, o)))
        hooks.append(a.v_proj.register_forward_hook(lambda m, i_, o, i=i: V.__setitem__(i, o)))
        if i in want_h:
            hooks.append(layer.register_forward_pre_hook(
                lambda m, a_, kw, i=i: H.__setitem__(i, a_[0] if a_ else kw["hidden_states"]), with_kwargs=True))
    try:
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    return dict(K=K, V=V, Kp=Kp, H=H)


def cap_batched(model, ids, bs=16):
    outs = [capture(model, ids[i: i + bs]) for i in range(0, len(ids), bs)]
    return {key: {l: torch.cat([o[key][l] for o in outs]) for l in outs[0][key]} for key in ("K", "V", "Kp", "H")}


def rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def shifted(x, lag):
    if lag == 0:
        return x
    z = torch.zeros_like(x)
    z[..., lag:, :] = x[..., :-lag, :]
    return z


t0 = time.time()
cal = tokens("calibration.txt")[: args.n_cal * 256].view(args.n_cal, 256)
cs, ct = cap_batched(src, cal), cap_batched(tgt, cal)
print(f"captured calibration {args.n_cal}x256 in {time.time() - t0:.0f}s", flush=True)

held = tokens("heldout.txt")
rng = np.random.default_rng(0)
A, Bn = 48, 96
starts = rng.choice(len(held) - 2 * A - Bn - 1, size=args.n_win, replace=False)
others = rng.choice(len(held) - A - 1, size=args.n_win, replace=False)
rows = torch.stack([torch.cat([held[s: s + A], held[s + A: s + A + Bn], held[s: s + A]]) for s in starts])
floors = torch.stack([torch.cat([held[o: o + A], held[s + A: s + A + Bn], held[s: s + A]]) for s, o in zip(starts, others)])
P = A + Bn  # cache covers positions 0..P-2; the target is fed [B[-1], A2] from P-1


def nll_on(logits, ids):
    lp = torch.log_softmax(logits[:, :-1].float(), -1)
    return -lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1).mean(-1)


cont = rows[:, P - 1:]
with torch.no_grad():
    own = torch.cat([nll_on(tgt(input_ids=rows[i:i + 50]).logits[:, P - 1:], cont[i:i + 50]) for i in range(0, len(rows), 50)]).numpy()
    floor = torch.cat([nll_on(tgt(input_ids=floors[i:i + 50]).logits[:, P - 1:], cont[i:i + 50]) for i in range(0, len(rows), 50)]).numpy()
es, et = cap_batched(src, rows[:, : P - 1]), cap_batched(tgt, rows[:, : P - 1])
pos = torch.arange(P - 1).expand(args.n_win, P - 1)
print(f"own {own.mean():.3f} floor {floor.mean():.3f} gain {floor.mean() - own.mean():.3f}", flush=True)
BOOT = np.random.default_rng(1).integers(0, args.n_win, size=(2000, args.n_win))


def ret_ci(tr):
    r = (floor.mean() - tr.mean()) / (floor.mean() - own.mean())
    bs = (floor[BOOT].mean(1) - tr[BOOT].mean(1)) / (floor[BOOT].mean(1) - own[BOOT].mean(1))
    return float(r), [float(np.percentile(bs, 2.5)), float(np.percentile(bs, 97.5))], bs


# ------------------------------------------------------------------ base features and their moments
# base columns: [srcK (Ls*KVs) | srcV (Ls*KVs) | res lag0 | res lag1 | res lag2 | res lag3]  (res = rms(H[J]))
KVS = src.config.num_key_value_heads * src.config.head_dim
MAXLAG = 4


def base_feats(c, d, J):
    """c: source capture, d: target capture (its residual entering layer J)."""
    sk = torch.cat([c["K"][l] for l in range(Ls)], -1)
    sv = torch.cat([c["V"][l] for l in range(Ls)], -1)
    r = rms(d["H"][J])
    return torch.cat([sk, sv] + [shifted(r, j) for j in range(MAXLAG)], -1)


OFF_SK, OFF_SV, OFF_R = 0, Ls * KVS, 2 * Ls * KVS
NB = OFF_R + MAXLAG * HID
MOM = {}


def moments(J):
    if J not in MOM:
        t = time.time()
        X = base_feats(cs, ct, J).reshape(-1, NB).double()
        Y = torch.cat([torch.cat([ct["Kp"][l], ct["V"][l]], -1) for l in range(L)], -1).reshape(-1, 2 * L * KVD).double()
        mu, ymu = X.mean(0), Y.mean(0)
        Xc = X - mu
        cov = Xc.T @ Xc / len(X)
        cxy = Xc.T @ (Y - ymu) / len(X)
        MOM[J] = dict(mu=mu, ymu=ymu, cov=cov, cxy=cxy)
        del X, Y, Xc
        print(f"moments J={J} in {time.time() - t:.0f}s", flush=True)
    return MOM[J]


def own_proj(l, kind):
    """(HID x KVD): rms(h) -> the layer's own input_layernorm + k_proj (pre k_norm) / v_proj."""
    lay = tgt.model.layers[l]
    W = (lay.self_attn.k_proj if kind == "K" else lay.self_attn.v_proj).weight.detach().double()  # (KVD, HID)
    return lay.input_layernorm.weight.detach().double()[:, None] * W.T


def ycols(l, kind):
    o = l * 2 * KVD + (0 if kind == "K" else KVD)
    return slice(o, o + KVD)


def fit_map(J, l, kind, src_layers, lags, own, lam):
    """Ridge (standardized) for one (layer, K|V); returns W (NB x KVD) in base coordinates, bias, groups."""
    m = moments(J)
    T_blocks, groups = [], []
    eye = torch.eye(NB, dtype=torch.float64)
    if src_layers:
        off = OFF_SK if kind == "K" else OFF_SV
        cols = [off + s * KVS + i for s in src_layers for i in range(KVS)]
        T_blocks.append(eye[:, cols]); groups.append(("src", len(cols)))
    for j in lags:
        blk = eye[:, OFF_R + j * HID: OFF_R + (j + 1) * HID]
        T_blocks.append(blk @ own_proj(l, kind) if own else blk); groups.append(("res", j))
    T = torch.cat(T_blocks, 1)
    cov = T.T @ m["cov"] @ T
    sd = cov.diag().clamp_min(1e-16).sqrt()
    corr = cov / sd[:, None] / sd[None, :]
    c = (T.T @ m["cxy"][:, ycols(l, kind)]) / sd[:, None]
    Ws = torch.linalg.solve(corr + lam * torch.eye(len(corr), dtype=corr.dtype), c)
    Wb = T @ (Ws / sd[:, None])
    return Wb


def parse_variant(spec):
    name, _, rest = spec.partition(":")
    kv = dict(x.split("=", 1) for x in rest.split(";") if x)
    J = int(kv.get("J", 1))
    mapped = list(range(J + 1, L))
    ints = lambda s: [] if s in ("", "none") else [int(x) for x in s.split(",")]
    res = mapped if kv.get("res", "all") == "all" else ints(kv["res"])
    plain = ints(kv.get("plain", ""))
    zero = ints(kv.get("zero", ""))
    nosrc = res if kv.get("nosrc") == "res" else ints(kv.get("nosrc", ""))
    cfg = dict(name=name, spec=spec, J=J, mapped=mapped, res=[l for l in res if l not in plain + zero], plain=plain, zero=zero,
               nosrc=nosrc, lags=ints(kv.get("lags", "0,1,2")), own=kv.get("own", "0") == "1",
               rank=int(kv.get("rank", 0)), srank=int(kv.get("srank", 0)),
               src_layers=list(range(Ls)) if kv.get("src", "all") == "all" else ints(kv["src"]))
    return cfg


def build(cfg):
    """Per mapped layer: W (NB x 2*KVD) base coordinates for [Kp | V], bias; plus the factored form for timing."""
    J, m = cfg["J"], moments(cfg["J"])
    maps, macs = {}, 0
    for l in cfg["mapped"]:
        if l in cfg["zero"]:
            maps[l] = dict(W=torch.zeros(NB, 2 * KVD, dtype=torch.float64), kind="zero")
            continue
        if l in cfg["plain"]:
            W = torch.zeros(NB, 2 * KVD, dtype=torch.float64)
            W[OFF_R: OFF_R + HID, :KVD] = own_proj(l, "K"); W[OFF_R: OFF_R + HID, KVD:] = own_proj(l, "V")
            maps[l] = dict(W=W, b=torch.zeros(2 * KVD, dtype=torch.float64), kind="plain")
            continue
        reads_res = l in cfg["res"]
        sl = [] if l in cfg["nosrc"] else cfg["src_layers"]
        lags = cfg["lags"] if reads_res else []
        Wk = fit_map(J, l, "K", sl, lags, cfg["own"], args.lam)
        Wv = fit_map(J, l, "V", sl, lags, cfg["own"], args.lam)
        maps[l] = dict(W=torch.cat([Wk, Wv], 1), kind="res" if reads_res else "src", src=sl, lags=lags)
    # reduced rank on the residual block: W_res <- W_res V_r V_r^T, V_r from the SVD of the fitted residual part
    rres = slice(OFF_R, NB)
    readers = [l for l in cfg["res"] if l in maps]
    if cfg["rank"]:
        for l in readers:
            Wr = maps[l]["W"][rres]
            S = Wr.T @ m["cov"][rres, rres] @ Wr
            ev, evec = torch.linalg.eigh(S)
            Vr = evec[:, -cfg["rank"]:]
            maps[l]["W"][rres] = Wr @ Vr @ Vr.T
    if cfg["srank"] and readers:
        Wr = torch.cat([maps[l]["W"][rres] for l in readers], 1)
        S = Wr.T @ m["cov"][rres, rres] @ Wr
        ev, evec = torch.linalg.eigh(S)
        Vr = evec[:, -cfg["srank"]:]
        Wr = Wr @ Vr @ Vr.T
        for i, l in enumerate(readers):
            maps[l]["W"][rres] = Wr[:, i * 2 * KVD: (i + 1) * 2 * KVD]
    for l in maps:
        W = maps[l]["W"]
        if maps[l]["kind"] not in ("plain",):
            maps[l]["b"] = m["ymu"][l * 2 * KVD: (l + 1) * 2 * KVD] - m["mu"] @ W
    # MACs per prompt token (factored form as timed)
    nl = len(cfg["lags"])
    for l in maps:
        k = maps[l]["kind"]
        if k == "plain":
            macs += HID * 2 * KVD
        elif k == "zero":
            pass
        else:
            macs += len(maps[l]["src"]) * KVS * KVD * 2
    if readers:
        if cfg["own"]:
            macs += len(readers) * (HID * 2 * KVD + nl * KVD * KVD * 2)
        elif cfg["srank"]:
            macs += nl * HID * cfg["srank"] + cfg["srank"] * 2 * KVD * len(readers)
        elif cfg["rank"]:
            macs += len(readers) * (nl * HID * cfg["rank"] + cfg["rank"] * 2 * KVD)
        else:
            macs += len(readers) * nl * HID * 2 * KVD
    return maps, macs


# ------------------------------------------------------------------ retention
def rope(model, k, positions):
    B, T, _ = k.shape
    k = k.view(B, T, -1, D).transpose(1, 2)
    cos, sin = model.model.rotary_emb(k, positions)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = torch.cat((-k[..., D // 2:], k[..., : D // 2]), dim=-1)
    return k * cos + rot * sin


def heads(v):
    B, T, _ = v.shape
    return v.view(B, T, -1, D).transpose(1, 2)


@torch.no_grad()
def evaluate(cfg, maps):
    J = cfg["J"]
    Xe = base_feats(es, et, J).double()
    cache = DynamicCache(config=tgt.config)
    for l in range(L):
        if l < J + 1:
            k, v = et["K"][l], et["V"][l]
        else:
            y = (Xe @ maps[l]["W"] + maps[l]["b"]).float()
            kp, v = y[..., :KVD], y[..., KVD:]
            k = tgt.model.layers[l].self_attn.k_norm(kp.view(*kp.shape[:-1], -1, D)).flatten(-2)
        cache.update(rope(tgt, k, pos), heads(v), l)
    n = cont.shape[1]
    logits = tgt(input_ids=cont, past_key_values=cache, position_ids=torch.arange(P - 1, P - 1 + n).expand(len(cont), n)).logits
    return nll_on(logits, cont).numpy()


# ------------------------------------------------------------------ time to first token
def target_layer_macs(T):
    c = tgt.config
    lin = HID * (c.num_attention_heads * D) * 2 + HID * KVD * 2 + 3 * HID * c.intermediate_size
    att = 2 * c.num_attention_heads * D * (T + 1) / 2  # causal average context
    return lin + att


def factored(cfg, maps):
    """Weights for the timed path (float32): grouped matmuls, biases folded."""
    J = cfg["J"]
    mapped = cfg["mapped"]
    nout = 2 * KVD * len(mapped)
    bias = torch.cat([maps[l]["b"] for l in mapped]).float()
    f = dict(bias=bias, mapped=mapped, J=J, lags=cfg["lags"])
    # source K / V blocks: one matmul each over the union of source layers read
    sl = sorted({s for l in mapped for s in maps[l].get("src", [])})
    f["src_layers"] = sl
    for kind, off, o2 in (("K", OFF_SK, 0), ("V", OFF_SV, KVD)):
        cols = [off + s * KVS + i for s in sl for i in range(KVS)]
        outs = [(i, l) for i, l in enumerate(mapped) if maps[l].get("src")]
        if cols and outs:
            Wm = torch.cat([maps[l]["W"][cols, o2: o2 + KVD] for _, l in outs], 1).float()
            f[f"src{kind}"] = (Wm, [i * 2 * KVD + o2 for i, _ in outs])
            # zero rows for source layers a map does not read are kept (same MACs as the union, counted honestly)
    readers = [(i, l) for i, l in enumerate(mapped) if maps[l]["kind"] == "res"]
    plains = [(i, l) for i, l in enumerate(mapped) if maps[l]["kind"] == "plain"]
    f["plain"] = (torch.cat([maps[l]["W"][OFF_R:OFF_R + HID] for _, l in plains], 1).float(), [i for i, _ in plains]) if plains else None
    f["res"] = None
    if readers:
        lags = cfg["lags"]
        Wr = {l: maps[l]["W"] for _, l in readers}
        if cfg["own"]:
            # own projection per reader (HID -> 2 KVD), then per-lag small maps: recover them from base coordinates
            Pm = torch.cat([torch.cat([own_proj(l, "K"), own_proj(l, "V")], 1) for _, l in readers], 1)
            small = []
            for _, l in readers:
                blocks = []
                for j in lags:
                    Wj = Wr[l][OFF_R + j * HID: OFF_R + (j + 1) * HID]
                    mk = torch.linalg.lstsq(own_proj(l, "K"), Wj[:, :KVD]).solution
                    mv = torch.linalg.lstsq(own_proj(l, "V"), Wj[:, KVD:]).solution
                    blocks.append((mk.float(), mv.float()))
                small.append(blocks)
            f["res"] = ("own", Pm.float(), small, [i for i, _ in readers])
        elif cfg["srank"] or cfg["rank"]:
            r = cfg["srank"] or cfg["rank"]
            if cfg["srank"]:
                Wall = torch.cat([Wr[l][OFF_R: OFF_R + MAXLAG * HID] for _, l in readers], 1)
                U, s_, Vh = torch.linalg.svd(Wall, full_matrices=False)
                Aw, Bw = (U[:, :r] * s_[:r]), Vh[:r]
                A_lag = torch.cat([Aw[j * HID:(j + 1) * HID] for j in lags], 1).float()
                f["res"] = ("srank", A_lag, Bw.float(), r, [i for i, _ in readers])
            else:
                per = []
                for _, l in readers:
                    Wl = Wr[l][OFF_R: OFF_R + MAXLAG * HID]
                    U, s_, Vh = torch.linalg.svd(Wl, full_matrices=False)
                    per.append(((U[:, :r] * s_[:r]), Vh[:r]))
                A_all = torch.cat([torch.cat([a[j * HID:(j + 1) * HID] for j in lags], 1) for a, _ in per], 1).float()
                f["res"] = ("rank", A_all, [b.float() for _, b in per], r, [i for i, _ in readers])
        else:
            Wm = torch.cat([torch.cat([Wr[l][OFF_R + j * HID: OFF_R + (j + 1) * HID] for j in lags], 1) for _, l in readers], 1).float()
            f["res"] = ("full", Wm, [i for i, _ in readers])
    f["nout"] = nout
    return f


def unrope(model, k, positions):
    """rotated keys (B,H,T,D) -> pre-RoPE (B,T,H*D)."""
    cos, sin = model.model.rotary_emb(k, positions)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    Dh = k.shape[-1]
    rot = torch.cat((-k[..., Dh // 2:], k[..., : Dh // 2]), dim=-1)
    x = k * cos - rot * sin
    return x.transpose(1, 2).flatten(-2)


STAGES = []
LAST = {}


@torch.no_grad()
def transfer_ttft(f, ids, src_cache, R):
    Tn = ids.shape[1]
    Pn = Tn - R
    posn = torch.arange(Pn).unsqueeze(0)
    J = f["J"]
    cache = DynamicCache(config=tgt.config)
    h = tgt.model.embed_tokens(ids[:, :Pn])
    pe = tgt.model.rotary_emb(h, posn)
    for l in range(J):
        out = tgt.model.layers[l](h, attention_mask=None, position_ids=posn, past_key_values=cache, use_cache=True,
                                  cache_position=torch.arange(Pn), position_embeddings=pe)
        h = out[0] if isinstance(out, tuple) else out
    lay = tgt.model.layers[J]
    x = lay.input_layernorm(h)
    k = lay.self_attn.k_norm(lay.self_attn.k_proj(x).view(1, Pn, -1, D)).transpose(1, 2)
    cos, sin = pe[0].unsqueeze(1), pe[1].unsqueeze(1)
    k = k * cos + torch.cat((-k[..., D // 2:], k[..., : D // 2]), -1) * sin
    cache.update(k, lay.self_attn.v_proj(x).view(1, Pn, -1, D).transpose(1, 2), J)
    STAGES.append(("exact", time.perf_counter()))
    r = rms(h)[0]
    out = f["bias"].expand(Pn, -1).clone()
    if f.get("srcK") or f.get("srcV"):
        sl = f["src_layers"]
        for kind in ("K", "V"):
            if f.get(f"src{kind}") is None:
                continue
            if kind == "K":
                X = torch.cat([unrope(src, src_cache.layers[s].keys[:, :, :Pn], posn)[0] for s in sl], -1)
            else:
                X = torch.cat([src_cache.layers[s].values[0, :, :Pn].transpose(0, 1).flatten(-2) for s in sl], -1)
            Wm, offs = f[f"src{kind}"]
            Y = X @ Wm
            for n_, o in enumerate(offs):
                out[:, o: o + KVD] += Y[:, n_ * KVD: (n_ + 1) * KVD]
    if f["plain"] is not None:
        Wm, idx = f["plain"]
        Y = r @ Wm
        for n_, i in enumerate(idx):
            out[:, i * 2 * KVD: (i + 1) * 2 * KVD] += Y[:, n_ * 2 * KVD: (n_ + 1) * 2 * KVD]
    lags = f["lags"]

    def add_lagged(dst, Y, width):  # Y (Pn, len(lags)*width) -> dst += sum_j shift_j(Y_j)
        for jn, j in enumerate(lags):
            if j == 0:
                dst += Y[:, jn * width:(jn + 1) * width]
            else:
                dst[j:] += Y[:-j, jn * width:(jn + 1) * width]

    res = f["res"]
    if res is not None:
        if res[0] == "full":
            _, Wm, idx = res
            Y = r @ Wm
            w = len(lags) * 2 * KVD
            for n_, i in enumerate(idx):
                add_lagged(out[:, i * 2 * KVD:(i + 1) * 2 * KVD], Y[:, n_ * w:(n_ + 1) * w], 2 * KVD)
        elif res[0] == "rank":
            _, A_all, Bs, rk, idx = res
            Z = r @ A_all
            w = len(lags) * rk
            for n_, i in enumerate(idx):
                z = torch.zeros(Pn, rk)
                add_lagged(z, Z[:, n_ * w:(n_ + 1) * w], rk)
                out[:, i * 2 * KVD:(i + 1) * 2 * KVD] += z @ Bs[n_]
        elif res[0] == "srank":
            _, A_lag, Bw, rk, idx = res
            z = torch.zeros(Pn, rk)
            add_lagged(z, r @ A_lag, rk)
            Y = z @ Bw
            for n_, i in enumerate(idx):
                out[:, i * 2 * KVD:(i + 1) * 2 * KVD] += Y[:, n_ * 2 * KVD:(n_ + 1) * 2 * KVD]
        else:
            _, Pm, small, idx = res
            Y = r @ Pm
            for n_, i in enumerate(idx):
                ok, ov = Y[:, n_ * 2 * KVD: n_ * 2 * KVD + KVD], Y[:, n_ * 2 * KVD + KVD:(n_ + 1) * 2 * KVD]
                dk = out[:, i * 2 * KVD: i * 2 * KVD + KVD]
                dv = out[:, i * 2 * KVD + KVD:(i + 1) * 2 * KVD]
                mk = torch.cat([b[0] for b in small[n_]], 1); mv = torch.cat([b[1] for b in small[n_]], 1)
                add_lagged(dk, ok @ mk, KVD); add_lagged(dv, ov @ mv, KVD)
    for i, l in enumerate(f["mapped"]):
        y = out[:, i * 2 * KVD:(i + 1) * 2 * KVD]
        k = tgt.model.layers[l].self_attn.k_norm(y[:, :KVD].reshape(1, Pn, -1, D)).transpose(1, 2)
        k = k * cos + torch.cat((-k[..., D // 2:], k[..., : D // 2]), -1) * sin
        cache.update(k, y[:, KVD:].reshape(1, Pn, -1, D).transpose(1, 2), l)
    STAGES.append(("maps", time.perf_counter()))
    LAST["out"] = out
    return tgt(input_ids=ids[:, Pn:], past_key_values=cache, position_ids=torch.arange(Pn, Tn).unsqueeze(0),
               use_cache=True, logits_to_keep=1).logits


def own_ttft(ids):
    with torch.no_grad():
        return tgt(input_ids=ids, use_cache=True, logits_to_keep=1).logits


# ------------------------------------------------------------------ main loop
long_ids = held[: args.ttft_len].unsqueeze(0)
with torch.no_grad():
    src_cache = src(input_ids=long_ids, use_cache=True).past_key_values
    ref_logits = own_ttft(long_ids)
tl = target_layer_macs(args.ttft_len)
res = dict(pair=f"{args.source}->{args.target}", args=vars(args), own_nll=float(own.mean()), floor_nll=float(floor.mean()),
           target_layer_macs_per_token=tl, target_layers=L, date=time.strftime("%Y-%m-%d %H:%M:%S"),
           uptime_start=subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), rows=[])
ref_bs, ref_tr = None, None
for spec in args.variant:
    t = time.time()
    cfg = parse_variant(spec)
    maps, macs = build(cfg)
    tr = evaluate(cfg, maps)
    r, ci, bs = ret_ci(tr)
    row = dict(name=cfg["name"], spec=spec, J=cfg["J"], readers=cfg["res"], retention=r, ci=ci,
               map_macs_per_token=macs, map_macs_in_target_layers=macs / tl,
               exact_pass_in_target_layers=cfg["J"] + 2 * HID * KVD / tl)
    if ref_bs is None:
        ref_bs, ref_tr = bs, tr
    else:
        d = bs - ref_bs
        row["paired_diff_vs_first"] = [float(r - res["rows"][0]["retention"]), float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5))]
    if args.ttft_repeats:
        f = factored(cfg, maps)
        lg = transfer_ttft(f, long_ids, src_cache, args.recompute)  # warm-up + sanity: finite logits
        assert torch.isfinite(lg).all()
        # the timed path must compute what the evaluated maps compute: compare on the TTFT prompt
        Pn = args.ttft_len - args.recompute
        Xc = base_feats(capture(src, long_ids[:, :Pn]), capture(tgt, long_ids[:, :Pn]), cfg["J"]).double()[0]
        refy = torch.cat([Xc @ maps[l]["W"] + maps[l]["b"] for l in cfg["mapped"]], -1).float()
        row["timed_path_max_rel_err"] = float((LAST["out"] - refy).abs().max() / refy.abs().max())
        assert row["timed_path_max_rel_err"] < 1e-3, row["timed_path_max_rel_err"]
        own_ttft(long_ids)
        to, tt, te, tm, ta, co, ct_, ca = [], [], [], [], [], [], [], []
        for _ in range(args.ttft_repeats):
            c = time.process_time(); s = time.perf_counter(); own_ttft(long_ids)
            to.append(time.perf_counter() - s); co.append(time.process_time() - c)
            STAGES.clear()
            c = time.process_time(); s = time.perf_counter(); transfer_ttft(f, long_ids, src_cache, args.recompute)
            tt.append(time.perf_counter() - s); ct_.append(time.process_time() - c)
            te.append(STAGES[0][1] - s); tm.append(STAGES[1][1] - STAGES[0][1])
            if args.recompute_alt:
                c = time.process_time(); s = time.perf_counter(); transfer_ttft(f, long_ids, src_cache, args.recompute_alt)
                ta.append(time.perf_counter() - s); ca.append(time.process_time() - c)
        row.update(ttft_own_ms=1e3 * float(np.median(to)), ttft_transfer_ms=1e3 * float(np.median(tt)),
                   speedup=float(np.median(to) / np.median(tt)),
                   ttft_transfer_alt_ms=1e3 * float(np.median(ta)) if ta else None,
                   speedup_alt=float(np.median(to) / np.median(ta)) if ta else None,
                   cpu_own_ms=1e3 * float(np.median(co)), cpu_transfer_ms=1e3 * float(np.median(ct_)),
                   cpu_speedup=float(np.median(co) / np.median(ct_)),
                   cpu_speedup_alt=float(np.median(co) / np.median(ca)) if ca else None,
                   exact_pass_ms=1e3 * float(np.median(te)), maps_ms=1e3 * float(np.median(tm)),
                   recompute_ms=1e3 * float(np.median(tt) - np.median(te) - np.median(tm)),
                   ttft_own_all_ms=[1e3 * x for x in to], ttft_transfer_all_ms=[1e3 * x for x in tt])
    row["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip().split("load average:")[-1].strip()
    res["rows"].append(row)
    pd = row.get("paired_diff_vs_first")
    print(f"{cfg['name']:28s} ret {r:6.3f} [{ci[0]:.3f},{ci[1]:.3f}]"
          + (f" d {pd[0]:+.3f} [{pd[1]:+.3f},{pd[2]:+.3f}]" if pd else "")
          + f" maps {macs / tl:.3f} L"
          + (f" ttft {row['ttft_own_ms']:.1f}/{row['ttft_transfer_ms']:.1f} = {row['speedup']:.2f}x"
             + (f" R{args.recompute_alt} {row['speedup_alt']:.2f}x" if ta else "")
             + f" cpu {row['cpu_own_ms']:.0f}/{row['cpu_transfer_ms']:.0f} = {row['cpu_speedup']:.2f}x" +
             f" (exact {row['exact_pass_ms']:.0f} maps {row['maps_ms']:.0f} rec {row['recompute_ms']:.0f})" if args.ttft_repeats else "")
          + f" err {row.get('timed_path_max_rel_err', 0):.1e} load {row['uptime']} ({time.time() - t:.0f}s)", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    json.dump(res, open(args.out, "w"), indent=1)
print(f"total {time.time() - t0:.0f}s")
