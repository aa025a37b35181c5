"""Time-boxed experiment: does a map of the copy layer from source features at t AND t-1 (..t-w+1) keep copying?
Direction large -> small, target layer 3 (small's copy layer; the library's ridge map keeps 6% of copying there).
Cache: target layers 0-2 exact (own prefill), layer 3 mapped by a closed-form ridge on [source K|V of all layers at
t, t-1, ..., t-w+1]; scored as repeated_span_retention does (own / transfer / first occurrence replaced), 64 held-out text spans.

A one-off record (not a tested example): `python copy_layer_windows.py 3 128` (target layer, calibration sequences
of 256 tokens) wrote copy_layer_windows_T3.json in ~2 min on one core. Measured: window 1 (t only, what the
library's ridge map reads) 7.7% of the copying kept, key R^2 0.70 (in-sample); window 2 (t, t-1) 21.6%, R^2 0.85;
window 4 22.3%, R^2 0.89. Neighbouring positions raise the fit but do not rescue the copy layer.
"""
import sys, json, time
import numpy as np, torch, torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from hf_kvtransfer import capture_kv, prefill
from hf_kvtransfer.calibration import build_calibration
from hf_kvtransfer.rope import apply_rope, rotary_cos_sin
from hf_kvtransfer.tasks import repeated_span_items
torch.set_num_threads(1)
fam = '/work/main/examples/family'
tok = AutoTokenizer.from_pretrained(fam + '/large')
src = AutoModelForCausalLM.from_pretrained(fam + '/large', dtype=torch.float32).eval()
tgt = AutoModelForCausalLM.from_pretrained(fam + '/small', dtype=torch.float32).eval()
T = int(sys.argv[1]) if len(sys.argv) > 1 else 3          # target layer mapped
NSEQ = int(sys.argv[2]) if len(sys.argv) > 2 else 128
ids, _ = build_calibration(tok, fam + '/calibration.txt', num_sequences=NSEQ, seq_len=256)

def feats(keys, values, w):
    # [B, H, S, D] per layer -> [B, S, F] at t, then shifted copies for t-1.. (zeros before the start)
    x = torch.cat([torch.cat([k, v], 1).permute(0, 2, 1, 3).flatten(2) for k, v in zip(keys, values)], -1)
    out = [x]
    for s in range(1, w):
        out.append(F.pad(x, (0, 0, s, 0))[:, : x.shape[1]])
    return torch.cat(out, -1)

t0 = time.time()
with torch.no_grad():
    X, Yk, Yv = [], [], []
    for b in range(0, NSEQ, 16):
        sk, sv = capture_kv(src, ids[b:b+16]); tk, tv = capture_kv(tgt, ids[b:b+16])
        X.append(feats(sk, sv, 4)); Yk.append(tk[T].permute(0, 2, 1, 3).flatten(2)); Yv.append(tv[T].permute(0, 2, 1, 3).flatten(2))
X = torch.cat(X).flatten(0, 1).double(); Yk = torch.cat(Yk).flatten(0, 1).double(); Yv = torch.cat(Yv).flatten(0, 1).double()
print('captured', X.shape, time.time() - t0, flush=True)
base = 1024  # features per position (8 layers x (K 64 + V 64))

def solve(w, lam=0.01):
    x = X[:, : base * w]; mx = x.mean(0); xc = x - mx
    G = xc.T @ xc; G += lam * torch.eye(G.shape[0], dtype=G.dtype)
    out = {}
    for name, y in (('k', Yk), ('v', Yv)):
        my = y.mean(0); W = torch.linalg.solve(G, xc.T @ (y - my))
        r2 = 1 - ((xc @ W - (y - my)) ** 2).sum() / ((y - my) ** 2).sum()
        out[name] = (W.float(), mx.float(), my.float(), float(r2))
    return out

text = open(fam + '/heldout.txt').read()
stream = tok(text, verbose=False)['input_ids']
items = repeated_span_items(tok, stream, 64, seed=1, prefix_len=256, kind='text')
rot = tgt.model.rotary_emb
H, D = tgt.config.num_key_value_heads, tgt.config.head_dim

def score(maps, w):
    nll = {'own': [], 'none': [], 'transfer': []}
    with torch.no_grad():
        for it in items:
            prefix = torch.tensor([it.prefix_ids]); control = torch.tensor([it.control_prefix_ids]); cont = torch.tensor([it.continuation_ids])
            mask = torch.tensor(it.repeat_mask)[1:]
            held = prefix.shape[1] - 1
            def run(cache, ctx):
                feed = torch.cat([ctx[:, held:], cont[:, :-1]], 1)
                lg = tgt(feed, cache=cache, use_cache=True).logits[0, 1:]  # predicts cont[1:]
                tn = F.cross_entropy(lg, cont[0, 1:], reduction='none')
                return float((tn * mask).sum() / mask.sum())
            nll['own'].append(run(prefill(tgt, prefix[:, :held]), prefix))
            nll['none'].append(run(prefill(tgt, control[:, :held]), control))
            own = prefill(tgt, prefix[:, :held])
            sk, sv = capture_kv(src, prefix[:, :held])
            x = feats(sk, sv, w)[0]
            cache = DynamicCache()
            for l in range(tgt.config.num_hidden_layers):
                k, v = own.layers[l].keys, own.layers[l].values
                if l == T:
                    kk = ((x - maps['k'][1]) @ maps['k'][0] + maps['k'][2]).view(1, held, H, D).transpose(1, 2)
                    vv = ((x - maps['v'][1]) @ maps['v'][0] + maps['v'][2]).view(1, held, H, D).transpose(1, 2)
                    cos, sin = rotary_cos_sin(rot, torch.arange(held).unsqueeze(0), kk.device)
                    k, v = apply_rope(kk, cos, sin), vv
                cache.update(k, v, l)
            nll['transfer'].append(run(cache, prefix))
    o, n, t = (np.mean(nll[k]) for k in ('own', 'none', 'transfer'))
    return (n - t) / (n - o), o, n, t

res = {}
for w in (1, 2, 4):
    t0 = time.time(); maps = solve(w)
    r = score(maps, w)
    res[w] = dict(retention=r[0], own=r[1], none=r[2], transfer=r[3], r2_k=maps['k'][3], r2_v=maps['v'][3])
    print('window', w, res[w], round(time.time() - t0, 1), flush=True)
json.dump(res, open(f'copy_layer_windows_T{T}.json', 'w'), indent=1)
