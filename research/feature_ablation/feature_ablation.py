"""Feature ablation of the ridge KV mapper: which extra mapper inputs or layer-selection rules
improve the transfer over the library's plain ridge mapper, fit on the same calibration tokens and scored on the
same held-out windows.

Variants (one row each; `--variants` picks them, the baseline always runs):

  baseline     the library's ridge mapper: per target layer, the top-k source layers by single-source R^2, their
               RoPE-stripped keys (values) side by side -> the target layer's stripped keys (values)
  embed        + the target's input embedding of the token (after its layer-0 input RMSNorm by default,
               `--embedding raw` for the bare embedding), appended to the features of every target layer
  prev         + the same source features at position t-1 (zeros at t=0), appended to those at t
  embed+prev   both
  attn-select  the baseline's features, but the k source layers of each mapped target layer are the best of the
               R^2 top-2k candidates by held-out attention-output fidelity: a single-layer map (fit on the fit
               shard) is scored by the cosine between the target's attention output (its own queries, the mapped
               K/V, its own softmax / GQA / o_proj, run through its attention module) and the output with its own
               K/V, over held-out calibration sequences
  attn-greedy  the same candidates and score, forward selection: add the candidate whose k'-layer map (with the
               layers already chosen) gives the best cosine, k times

Every variant is a closed-form ridge solve (float64 normal equations, same lambda, same held-out shard, weights
refit on all sequences, as `fit_mapper` does) from ONE pass that accumulates the sums of z z^T and z y^T for
z = [all source layers' stripped K (or V) | the same at t-1 | target embedding], so a variant is a choice of rows.
Scoring builds the target's cache directly: source prefill -> strip -> map -> re-apply the target's RoPE -> a
`DynamicCache` filled with `update`, the target's own exact first layer(s) in front (`TransferredCache`'s default
`num_exact_layers=1`), and scores the second half of each window exactly like `evaluate.prefix_perplexity`:
floor-normalized retention (floor - transfer) / (floor - own) with a 95% bootstrap CI over windows, and the
difference to the baseline bootstrapped on the same windows (paired).

Self-tests (the run exits with status 1 when one fails; `--skip-library-check` skips the ones that need the library
runs): the harness's baseline selection, weights and held-out R^2 equal `fit_mapper`'s (weights to rtol 1e-5); the
baseline row's per-window NLLs (own, transfer, floor) equal `prefix_perplexity(..., num_recompute_tokens=0, num_exact_layers=1)`'s within
1e-4 and its KL to the own prefill equals that run's `logit_kl` within 1e-5; the attention scorer reproduces the
target's own attention output from its own stripped K/V re-roped.

Besides retention, each row reports KL(own prefill || transfer) of the next-token distributions and the raw NLL, both
paired against the baseline: they compare variants even where the context is worth little to the target.

Example (the bundled family, both directions; ~1.5 min each on one core with 64 windows):

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python research/feature_ablation/feature_ablation.py \\
        --source examples/family/small --target examples/family/large \\
        --calibration-text examples/family/calibration.txt --heldout-text examples/family/heldout.txt \\
        --prefix-len 128 --windows 64 --json ablation-small-to-large.json
    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python research/feature_ablation/feature_ablation.py \\
        --source examples/family/large --target examples/family/small --prefix-len 128 --windows 64

Windows are `evaluate.text_windows` (non-overlapping, 2 x prefix-len tokens, evenly spaced when there are more than
`--windows`); `--window-step S` cuts windows starting every S tokens instead (S = prefix-len still scores every
token at most once) for more windows from a short text. The models must use their prefix: where the target's own
prefix does not lower its loss (e.g. windows longer than the sequences it was trained on: the bundled checkpoints
saw 256 tokens, so use --prefix-len 128 with them), retention is undefined and the table says so; the NLL column
still compares the variants.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from huggingface_hub.utils import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from hf_kvtransfer import capture_kv, fit_mapper, prefill
from hf_kvtransfer.fitting.calibration import build_calibration
from hf_kvtransfer.fitting.calibration_pass import calibration_pass
from hf_kvtransfer.evaluation.evaluate import prefix_perplexity, split_documents, text_windows
from hf_kvtransfer.fitting.config import RIDGE_LAMBDA_CANDIDATES, heldout_count
from hf_kvtransfer.evaluation.metrics import bootstrap_ci
from hf_kvtransfer.core.rope import rotary_cos_sin, strip_rope
from hf_kvtransfer.core.stats import KVLayout


def apply_rope(key_states, cos, sin):
    """RoPE as the attention modules apply it (`k*cos + rotate_half(k)*sin` on the rotary dims)."""
    rotary_dim, half = cos.shape[-1], cos.shape[-1] // 2
    k_rot, k_pass = key_states[..., :rotary_dim], key_states[..., rotary_dim:]
    rotated = k_rot * cos + torch.cat((-k_rot[..., half:], k_rot[..., :half]), dim=-1) * sin
    return torch.cat((rotated, k_pass), dim=-1) if k_pass.shape[-1] else rotated


KINDS = ("key", "value")
VARIANTS = ("baseline", "embed", "prev", "embed+prev", "attn-select", "attn-greedy")
FAMILY = Path(__file__).resolve().parents[2] / "examples" / "family"


@dataclass(frozen=True)
class Variant:
    name: str
    prev: bool = False  # + source features at t-1
    embed: bool = False  # + target input embedding
    selection: str = "r2"  # "r2" (library), "attention" (single-layer scores) or "attention-greedy"


VARIANT_SPECS = {
    "baseline": Variant("baseline"),
    "embed": Variant("embed", embed=True),
    "prev": Variant("prev", prev=True),
    "embed+prev": Variant("embed+prev", prev=True, embed=True),
    "attn-select": Variant("attn-select", selection="attention"),
    "attn-greedy": Variant("attn-greedy", selection="attention-greedy"),
}


# -- features ---------------------------------------------------------------------------------------------------


def per_token(states: list[torch.Tensor]) -> torch.Tensor:
    """`[B, H, T, D]` per layer -> `[B, T, L*H*D]`, layers side by side (the library's feature order)."""
    return torch.cat([s.transpose(1, 2).reshape(s.shape[0], s.shape[2], -1) for s in states], dim=-1).float()


def shifted(x: torch.Tensor) -> torch.Tensor:
    """Features at t-1 for every t of `[B, T, D]`, zeros at t=0."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


class TokenEmbedding:
    """The target's input embedding of the ids `[B, T] -> [B, T, hidden]`, optionally through layer 0's input norm."""

    def __init__(self, target, mode: str):
        self.embed = target.get_input_embeddings()
        self.norm = None
        if mode == "layer0":
            layer0 = getattr(target, "base_model", target).layers[0]
            self.norm = getattr(layer0, "input_layernorm", None)
            if self.norm is None:
                raise ValueError(f"{type(layer0).__name__} has no input_layernorm; use --embedding raw")
        self.dim = self.embed.embedding_dim

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.embed(ids.to(self.embed.weight.device))
        return (self.norm(e) if self.norm is not None else e).float()


def features(x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    """z = [x | x at t-1 | embedding] per token: `[B, T, 2 * L_s * F_s + hidden]`."""
    return torch.cat([x, shifted(x), emb], dim=-1)


def feature_index(variant: Variant, selected: list[int], src: KVLayout, embed_dim: int) -> torch.Tensor:
    """Rows of z a variant reads for one target layer: the selected layers (ascending), then their t-1 copies,
    then the embedding."""
    f, offset = src.layer_dim, src.total_dim
    parts = [torch.arange(s * f, (s + 1) * f) for s in selected]
    if variant.prev:
        parts += [torch.arange(offset + s * f, offset + (s + 1) * f) for s in selected]
    if variant.embed:
        parts.append(torch.arange(2 * offset, 2 * offset + embed_dim))
    return torch.cat(parts)


# -- statistics -------------------------------------------------------------------------------------------------


class Sums:
    """float64 sums over tokens for keys and values: N, sum z, sum y, z^T z, z^T y, sum y^2 (per dim)."""

    def __init__(self, dim_z: int, dim_y: int):
        self.count = 0
        self.t = {
            kind: {
                "sum_z": torch.zeros(dim_z, dtype=torch.float64),
                "sum_y": torch.zeros(dim_y, dtype=torch.float64),
                "gram": torch.zeros(dim_z, dim_z, dtype=torch.float64),
                "cross": torch.zeros(dim_z, dim_y, dtype=torch.float64),
                "sq_y": torch.zeros(dim_y, dtype=torch.float64),
            }
            for kind in KINDS
        }
        self._centered: dict = {}

    def add(self, kind: str, z: torch.Tensor, y: torch.Tensor) -> None:
        z, y = z.double(), y.double()
        t = self.t[kind]
        t["sum_z"] += z.sum(0)
        t["sum_y"] += y.sum(0)
        t["gram"].addmm_(z.T, z)
        t["cross"].addmm_(z.T, y)
        t["sq_y"] += (y * y).sum(0)
        self._centered.clear()

    def __add__(self, other: "Sums") -> "Sums":
        new = Sums(0, 0)
        new.count = self.count + other.count
        new.t = {kind: {name: v + other.t[kind][name] for name, v in part.items()} for kind, part in self.t.items()}
        return new

    def centered(self, kind: str) -> dict[str, torch.Tensor]:
        if kind not in self._centered:
            n, t = float(self.count), self.t[kind]
            mean_z, mean_y = t["sum_z"] / n, t["sum_y"] / n
            self._centered[kind] = {
                "gram": t["gram"] - torch.outer(t["sum_z"], mean_z),
                "cross": t["cross"] - torch.outer(t["sum_z"], mean_y),
                "var_y": t["sq_y"] - t["sum_y"] * mean_y,
                "mean_z": mean_z,
                "mean_y": mean_y,
            }
        return self._centered[kind]


def ridge_solve(gram: torch.Tensor, rhs: torch.Tensor, lam: float) -> torch.Tensor:
    """`(gram + lam I)^-1 rhs` by Cholesky in float64; the smallest jitter that factors if it does not."""
    eye = torch.eye(gram.shape[0], dtype=torch.float64)
    scale, jitter = float(gram.diagonal().abs().mean()) or 1.0, 0.0
    for _ in range(8):
        factor, info = torch.linalg.cholesky_ex(gram + (lam + jitter) * eye)
        if int(info) == 0:
            return torch.cholesky_solve(rhs, factor)
        jitter = scale * 1e-12 if jitter == 0.0 else jitter * 100
    raise ValueError("ridge system is not positive definite even with jitter; use a larger --ridge-lambda")


def head_r2(sse: torch.Tensor, var_y: torch.Tensor, num_heads: int) -> torch.Tensor:
    """R^2 per head from per-dim SSE and variance `[..., heads * head_dim]`."""
    sse = sse.reshape(*sse.shape[:-1], num_heads, -1).sum(-1)
    sst = var_y.reshape(*var_y.shape[:-1], num_heads, -1).sum(-1)
    return torch.where(sst > 0, 1 - sse / sst.clamp_min(1e-30), torch.ones_like(sst))


def single_source_scores(stats: Sums, lam: float, src: KVLayout, tgt: KVLayout) -> torch.Tensor:
    """`[L_s, L_t]` head-averaged in-sample R^2 of each target layer from each single source layer, mean of K and V
    (the paper's and the library's ranking)."""
    total = torch.zeros(src.num_layers, tgt.num_layers, dtype=torch.float64)
    for kind in KINDS:
        c = stats.centered(kind)
        var_y = c["var_y"]
        for s in range(src.num_layers):
            sl = slice(s * src.layer_dim, (s + 1) * src.layer_dim)
            gram, cross = c["gram"][sl, sl], c["cross"][sl]
            w = ridge_solve(gram, cross, lam)
            sse = var_y - 2 * (w * cross).sum(0) + (w * (gram @ w)).sum(0)
            r2 = head_r2(sse.reshape(tgt.num_layers, -1), var_y.reshape(tgt.num_layers, -1), tgt.num_kv_heads)
            total[s] += r2.mean(-1)
    return total / 2


def top_k(scores: torch.Tensor, k: int) -> list[list[int]]:
    """Per target layer (column), the k best source layers (ties -> lower index) in ascending order."""
    order = torch.argsort(-scores, dim=0, stable=True)[:k]
    return [sorted(order[:, t].tolist()) for t in range(scores.shape[1])]


def solve(stats: Sums, kind: str, idx: torch.Tensor, t: int, tgt: KVLayout, lam: float):
    """Ridge map of one target layer from the rows `idx` of z: `(W [n_in, F_t], b [F_t], in-sample R^2)`."""
    c = stats.centered(kind)
    tl = slice(t * tgt.layer_dim, (t + 1) * tgt.layer_dim)
    gram, cross = c["gram"][idx][:, idx], c["cross"][idx, tl]
    w = ridge_solve(gram, cross, lam)
    b = c["mean_y"][tl] - c["mean_z"][idx] @ w
    sse = c["var_y"][tl] - 2 * (w * cross).sum(0) + (w * (gram @ w)).sum(0)
    return w, b, float(head_r2(sse, c["var_y"][tl], tgt.num_kv_heads).mean())


def heldout_r2(held: Sums, kind: str, idx: torch.Tensor, t: int, tgt: KVLayout, w: torch.Tensor, b: torch.Tensor) -> float:
    """Head-averaged R^2 of `y = z[idx] W + b` on held-out sums (error around the held-out means plus the offset)."""
    c = held.centered(kind)
    tl = slice(t * tgt.layer_dim, (t + 1) * tgt.layer_dim)
    gram, cross, var_y = c["gram"][idx][:, idx], c["cross"][idx, tl], c["var_y"][tl]
    offset = c["mean_y"][tl] - c["mean_z"][idx] @ w - b
    sse = var_y - 2 * (w * cross).sum(0) + (w * (gram @ w)).sum(0) + held.count * offset**2
    return float(head_r2(sse, var_y, tgt.num_kv_heads).mean())


# -- the calibration pass: sums + held-out attention probe ---------------------------------------------------


class _ReplaceKV:
    """Stands in for the cache inside one attention call: hands the attention the K/V given instead of its own."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        return self.keys.to(key_states.dtype), self.values.to(value_states.dtype)


class AttentionProbe:
    """The target's attention inputs and outputs on held-out calibration sequences (hooks on `layers[i].self_attn`),
    to score mapped K/V by the attention output they give with the target's own queries."""

    def __init__(self, target, max_sequences: int):
        body = getattr(target, "base_model", target)
        self.modules = [layer.self_attn for layer in body.layers]
        self.max_sequences = max_sequences
        self.rotary = body.rotary_emb
        self.num_sequences = 0
        self._last_in: list = [None] * len(self.modules)
        self._last_out: list = [None] * len(self.modules)
        self.calls: list[list[tuple[dict, str, torch.Tensor]]] = [[] for _ in self.modules]  # per layer, per batch
        self.z: dict[str, list[torch.Tensor]] = {kind: [] for kind in KINDS}  # per batch [B, T, D_z]
        self.own: dict[str, list[list[torch.Tensor]]] = {kind: [] for kind in KINDS}  # first batch: stripped states
        self._handles = []
        for i, module in enumerate(self.modules):
            self._handles.append(module.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(i)))

    def _pre(self, i):
        def hook(module, args, kwargs):
            kw = dict(kwargs)
            if args:
                kw["hidden_states"] = args[0]
            self._last_in[i] = kw

        return hook

    def _post(self, i):
        def hook(module, args, output):
            self._last_out[i] = (output[0] if isinstance(output, tuple) else output).detach().float()

        return hook

    @property
    def full(self) -> bool:
        return self.num_sequences >= self.max_sequences

    def keep(self, z: dict[str, torch.Tensor], target_keys, target_values) -> None:
        """Keep the target's last forward (the held-out batch just captured, whole) with its features z."""
        for i in range(len(self.modules)):
            kw = dict(self._last_in[i])
            name = "past_key_values" if "past_key_values" in kw else "cache"
            kw.pop(name, None)
            self.calls[i].append((kw, name, self._last_out[i]))
        for kind in KINDS:
            self.z[kind].append(z[kind])
        if not self.own["key"]:
            self.own["key"], self.own["value"] = list(target_keys), list(target_values)
        self.num_sequences += z["key"].shape[0]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @torch.no_grad()
    def cosine(self, t: int, maps: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], tgt: KVLayout) -> float:
        """Mean per-token cosine of layer t's attention output with mapped K/V vs. its own output, over the kept
        sequences; `maps[kind] = (idx into z, W, b)`."""
        total, count = 0.0, 0
        for b, (_, _, own_out) in enumerate(self.calls[t]):
            mapped = {}
            for kind, (idx, w, bias) in maps.items():
                z = self.z[kind][b]
                y = z[..., idx] @ w.float() + bias.float()  # (B, T, F_t)
                mapped[kind] = y.view(*y.shape[:2], tgt.num_kv_heads, tgt.head_dim).transpose(1, 2)
            out = self.attend(t, b, mapped["key"], mapped["value"])
            total += float(F.cosine_similarity(out, own_out, dim=-1).sum())
            count += own_out.shape[0] * own_out.shape[1]
        return total / count

    @torch.no_grad()
    def attend(self, t: int, b: int, stripped_keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Layer t's attention output on kept batch b with the given stripped keys (re-roped here) and values."""
        kw, cache_name, _ = self.calls[t][b]
        batch, _, seq, _ = stripped_keys.shape
        positions = torch.arange(seq).unsqueeze(0).expand(batch, -1)
        cos, sin = rotary_cos_sin(self.rotary, positions, stripped_keys.device)
        out = self.modules[t](**kw, **{cache_name: _ReplaceKV(apply_rope(stripped_keys, cos, sin), values)})
        return (out[0] if isinstance(out, tuple) else out).float()

    @torch.no_grad()
    def self_check(self) -> float:
        """Largest |own output - output recomputed from the own stripped K/V re-roped| over layers (batch 0)."""
        worst = 0.0
        for t in range(len(self.modules)):
            out = self.attend(t, 0, self.own["key"][t].float(), self.own["value"][t].float())
            worst = max(worst, float((out - self.calls[t][0][2]).abs().max()))
        return worst


class FeatureSums:
    """`calibration_pass` consumer: the sums of the fit and held-out shards over every `stride`-th token (the
    library's tokens), and the held-out sequences the attention probe keeps."""

    name = "feature_ablation"
    checkpointable = False

    def __init__(self, input_ids, embedding: TokenEmbedding, src: KVLayout, tgt: KVLayout, stride: int, probe: AttentionProbe | None):
        self.input_ids, self.embedding, self.stride, self.probe = input_ids, embedding, stride, probe
        dim_z = 2 * src.total_dim + embedding.dim
        self.train, self.heldout = Sums(dim_z, tgt.total_dim), Sums(dim_z, tgt.total_dim)

    @torch.no_grad()
    def update(self, batch) -> None:
        if batch.attention_mask is not None:
            raise ValueError("feature_ablation expects unpadded calibration sequences")
        sums = self.train if batch.part == "train" else self.heldout
        emb = self.embedding(self.input_ids[batch.rows])
        zs = {}
        for kind in KINDS:
            xs, ys = batch.states(kind)
            z = features(per_token(xs), emb)
            y = per_token(ys)
            zs[kind] = z
            sums.add(kind, z[:, :: self.stride].reshape(-1, z.shape[-1]), y[:, :: self.stride].reshape(-1, y.shape[-1]))
        sums.count += len(batch.rows) * len(range(0, zs["key"].shape[1], self.stride))
        if batch.part == "heldout" and self.probe is not None and not self.probe.full:
            self.probe.keep(zs, batch.target_keys, batch.target_values)


# -- fitting the variants ---------------------------------------------------------------------------------------


@dataclass
class Fit:
    variant: Variant
    ridge_lambda: float
    selected: list[list[int]]  # final (refit on all sequences)
    weights: dict[str, list[tuple[torch.Tensor, torch.Tensor]]]  # final, per kind and target layer (W, b)
    index: list[torch.Tensor]  # rows of z per target layer (final selection)
    heldout_r2: dict[str, list[float]]  # fit shard -> held-out shard, per kind and target layer
    heldout_selected: list[list[int]]
    params: int
    seconds: float = 0.0
    attention_cosine: list[float] | None = None  # fit-shard maps on the probe, per target layer
    notes: list[str] = field(default_factory=list)
    selection_scores: dict | None = None


class Fitter:
    def __init__(self, train: Sums, heldout: Sums, src: KVLayout, tgt: KVLayout, embed_dim: int, k: int,
                 probe: AttentionProbe | None, num_exact_layers: int = 1):  # fmt: skip
        self.train, self.heldout, self.all = train, heldout, train + heldout
        self.num_exact_layers = num_exact_layers
        self.src, self.tgt, self.embed_dim, self.k, self.probe = src, tgt, embed_dim, k, probe
        self._scores: dict = {}

    def scores(self, which: str, lam: float) -> torch.Tensor:
        if (which, lam) not in self._scores:
            self._scores[which, lam] = single_source_scores(getattr(self, which), lam, self.src, self.tgt)
        return self._scores[which, lam]

    def index(self, variant: Variant, selected: list[int]) -> torch.Tensor:
        return feature_index(variant, selected, self.src, self.embed_dim)

    def _attention_cosine(self, t: int, selected: list[int], lam: float) -> float:
        """Held-out attention cosine of target layer t with K and V mapped from `selected` (maps fit on the fit shard)."""
        idx = self.index(VARIANT_SPECS["baseline"], sorted(selected))
        maps = {kind: (idx, *solve(self.train, kind, idx, t, self.tgt, lam)[:2]) for kind in KINDS}
        return self.probe.cosine(t, maps, self.tgt)

    def attention_selection(self, lam: float, greedy: bool) -> tuple[list[list[int]], dict]:
        """Per target layer, k of the R^2 top-2k candidates (ranked on the fit shard) by held-out attention cosine:
        the k best single-layer maps, or (greedy) forward selection, adding the candidate whose multi-layer map gives
        the best cosine with the layers already chosen. Layers the target computes exactly keep the R^2 top-k."""
        order = torch.argsort(-self.scores("train", lam), dim=0, stable=True)[: min(2 * self.k, self.src.num_layers)]
        fallback = top_k(self.scores("all", lam), self.k)
        chosen, table = [], {}
        for t in range(self.tgt.num_layers):
            candidates = order[:, t].tolist()
            if self.k >= self.src.num_layers or t < self.num_exact_layers:
                chosen.append(fallback[t])
                continue
            if not greedy:
                cos = {s: self._attention_cosine(t, [s], lam) for s in candidates}
                best = sorted(candidates, key=lambda s: -cos[s])[: self.k]  # stable: ties keep the R^2 order
                chosen.append(sorted(best))
                table[t] = {str(s): cos[s] for s in candidates}
                continue
            picked, steps = [], []
            for _ in range(self.k):
                scored = [(self._attention_cosine(t, picked + [s], lam), s) for s in candidates if s not in picked]
                best_cos, best_s = max(scored, key=lambda item: item[0])  # first maximum: ties keep the R^2 order
                picked.append(best_s)
                steps.append({"add": best_s, "cosine": best_cos})
            chosen.append(sorted(picked))
            table[t] = steps
        return chosen, table

    def fit(self, variant: Variant, lam: float) -> Fit:
        tgt = self.tgt
        notes, table = [], None
        if variant.selection.startswith("attention"):
            if self.k >= self.src.num_layers:
                notes.append(f"k={self.k} covers every source layer: the same layers as the baseline")
            held_sel, table = self.attention_selection(lam, greedy=variant.selection == "attention-greedy")
            final_sel = held_sel  # chosen on held-out sequences once; the refit keeps it
        else:
            held_sel = top_k(self.scores("train", lam), self.k)  # what fit_mapper scores held-out R^2 with
            final_sel = top_k(self.scores("all", lam), self.k)  # what it refits with (all sequences)
        r2 = {kind: [] for kind in KINDS}
        train_maps = {}
        for t in range(tgt.num_layers):
            idx = self.index(variant, held_sel[t])
            for kind in KINDS:
                w, b, _ = solve(self.train, kind, idx, t, tgt, lam)
                r2[kind].append(heldout_r2(self.heldout, kind, idx, t, tgt, w, b))
                train_maps[kind, t] = (idx, w, b)
        weights = {kind: [] for kind in KINDS}
        index = []
        for t in range(tgt.num_layers):
            idx = self.index(variant, final_sel[t])
            index.append(idx)
            for kind in KINDS:
                w, b, _ = solve(self.all, kind, idx, t, tgt, lam)
                weights[kind].append((w, b))
        params = sum(w.numel() + b.numel() for kind in KINDS for w, b in weights[kind])
        fit = Fit(variant, lam, final_sel, weights, index, r2, held_sel, params, notes=notes, selection_scores=table)
        if self.probe is not None:
            fit.attention_cosine = [
                self.probe.cosine(t, {kind: train_maps[kind, t] for kind in KINDS}, tgt) for t in range(tgt.num_layers)
            ]
        return fit


def mean_r2(r2: dict[str, list[float]], first: int = 0) -> float:
    """Mean held-out R^2 over kinds and target layers (from `first`)."""
    values = [v for kind in KINDS for v in r2[kind][first:]]
    return sum(values) / len(values) if values else float("nan")


def fit_variant(fitter: Fitter, variant: Variant, lambdas: list[float]) -> Fit:
    """Fit at each lambda; with several, keep the best held-out R^2 (all layers, K and V; ties -> the first, as
    the library's 'auto' does)."""
    started = time.perf_counter()
    best = None
    for lam in lambdas:
        fit = fitter.fit(variant, lam)
        if best is None or mean_r2(fit.heldout_r2) > mean_r2(best.heldout_r2):
            best = fit
    best.seconds = time.perf_counter() - started
    return best


# -- scoring ----------------------------------------------------------------------------------------------------


def windows_from(token_docs, prefix_len: int, max_windows: int, step: int | None) -> torch.Tensor:
    """`evaluate.text_windows` (non-overlapping); with `step`, windows starting every `step` tokens of each document
    instead, in text order, then evenly spaced down to `max_windows` the same way."""
    window = 2 * prefix_len
    if not step or step == window:
        return text_windows(token_docs, window, max_windows)
    rows = [doc[i : i + window] for doc in token_docs for i in range(0, len(doc) - window + 1, step)]
    if not rows:
        return text_windows(token_docs, window, max_windows)  # raises its error message
    if max_windows is not None and len(rows) > max_windows:
        rows = [rows[i] for i in np.linspace(0, len(rows) - 1, max_windows).round().astype(int)]
    return torch.tensor(rows, dtype=torch.long)


@torch.no_grad()
def score_windows(source, target, fits: list[Fit], windows: torch.Tensor, prefix_len: int, embedding: TokenEmbedding,
                  src: KVLayout, tgt: KVLayout, num_exact_layers: int, batch_size: int, progress: bool) -> dict:  # fmt: skip
    """Per-window NLL of the second half of each window: own prefill, no prefix (floor), and each fit's transfer
    cache built by hand; per-window KL(own || transfer) of the next-token distributions; per-layer K/V R^2 of each
    fit on the prefix tokens."""
    body = getattr(target, "base_model", target)
    rotary = body.rotary_emb
    t_len = prefix_len
    nll = {"target": [], "floor": [], **{f.variant.name: [] for f in fits}}
    kl = {f.variant.name: [] for f in fits}
    r2_acc = {f.variant.name: {kind: torch.zeros(tgt.num_layers, tgt.layer_dim, dtype=torch.float64) for kind in KINDS} for f in fits}
    sy = {kind: torch.zeros(tgt.num_layers, tgt.layer_dim, dtype=torch.float64) for kind in KINDS}
    syy = {kind: torch.zeros(tgt.num_layers, tgt.layer_dim, dtype=torch.float64) for kind in KINDS}
    count = 0
    weights32 = {f.variant.name: {kind: [(w.float(), b.float()) for w, b in f.weights[kind]] for kind in KINDS} for f in fits}

    def token_nll(logits, labels):
        return F.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none").mean(-1).double().cpu()

    bar = tqdm(total=windows.shape[0], desc="scoring windows", unit="window", disable=not progress)
    for start in range(0, windows.shape[0], batch_size):
        ids = windows[start : start + batch_size]
        feed, labels = ids[:, t_len:], ids[:, t_len + 1 :]
        own_cache = prefill(target, ids[:, :t_len])
        own = [(layer.keys.clone(), layer.values.clone()) for layer in own_cache.layers]
        own_logits = target(feed, cache=own_cache, use_cache=True).logits[:, :-1].float()
        nll["target"].append(token_nll(own_logits, labels))
        own_logp = own_logits.log_softmax(-1)
        nll["floor"].append(token_nll(target(feed, use_cache=False).logits[:, :-1], labels))

        batch = ids.shape[0]
        positions = torch.arange(t_len).unsqueeze(0).expand(batch, -1)
        cos, sin = rotary_cos_sin(rotary, positions, own[0][0].device)
        own_stripped = {"key": [strip_rope(k, cos, sin) for k, _ in own], "value": [v.float() for _, v in own]}
        truth = {kind: [s.transpose(1, 2).reshape(batch * t_len, -1).double() for s in own_stripped[kind]] for kind in KINDS}
        for kind in KINDS:
            for t in range(tgt.num_layers):
                sy[kind][t] += truth[kind][t].sum(0)
                syy[kind][t] += (truth[kind][t] ** 2).sum(0)
        count += batch * t_len

        src_k, src_v = capture_kv(source, ids[:, :t_len])
        emb = embedding(ids[:, :t_len])
        z = {"key": features(per_token(src_k), emb), "value": features(per_token(src_v), emb)}
        for fit in fits:
            name, cache = fit.variant.name, DynamicCache()
            for t in range(tgt.num_layers):
                mapped = {}
                for kind in KINDS:
                    w, b = weights32[name][kind][t]
                    y = z[kind][..., fit.index[t]] @ w + b  # (B, T, F_t)
                    r2_acc[name][kind][t] += ((y.reshape(-1, y.shape[-1]).double() - truth[kind][t]) ** 2).sum(0)
                    mapped[kind] = y.view(batch, t_len, tgt.num_kv_heads, tgt.head_dim).transpose(1, 2)
                if t < num_exact_layers:
                    keys, values = own[t]  # the target's own exact layer, as TransferredCache computes it
                else:
                    keys = apply_rope(mapped["key"], cos, sin).to(own[t][0].dtype)
                    values = mapped["value"].to(own[t][1].dtype)
                cache.update(keys.contiguous(), values.contiguous(), t)
            logits = target(feed, cache=cache, use_cache=True).logits[:, :-1].float()
            nll[name].append(token_nll(logits, labels))
            # KL(own || transfer) per token, averaged per window: how far the transfer moves the target's predictions
            kl[name].append((own_logp.exp() * (own_logp - logits.log_softmax(-1))).sum(-1).mean(-1).double().cpu())
        bar.update(batch)
    bar.close()
    out = {
        "nll_per_window": {name: torch.cat(v).numpy() for name, v in nll.items()},
        "kl_per_window": {name: torch.cat(v).numpy() for name, v in kl.items()},
        "eval_r2": {},
    }
    for fit in fits:
        name = fit.variant.name
        out["eval_r2"][name] = {}
        for kind in KINDS:
            sst = (syy[kind] - sy[kind] ** 2 / count).reshape(tgt.num_layers, tgt.num_kv_heads, -1).sum(-1)
            sse = r2_acc[name][kind].reshape(tgt.num_layers, tgt.num_kv_heads, -1).sum(-1)
            out["eval_r2"][name][kind] = torch.where(sst > 0, 1 - sse / sst.clamp_min(1e-30), torch.ones_like(sst)).mean(-1).tolist()
    return out


def retention(nll: dict[str, np.ndarray], name: str, idx) -> float:
    floor, own, trans = nll["floor"][idx].mean(), nll["target"][idx].mean(), nll[name][idx].mean()
    gain = floor - own
    return float((floor - trans) / gain) if gain != 0 else float("nan")


# -- the run ----------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", type=Path, default=FAMILY / "small", help="source model directory (default: family/small)")
    p.add_argument("--target", type=Path, default=FAMILY / "large", help="target model directory (default: family/large)")
    p.add_argument("--calibration-text", type=Path, default=FAMILY / "calibration.txt", help="text to fit on")
    p.add_argument("--heldout-text", type=Path, default=FAMILY / "heldout.txt", help="text the windows are cut from")
    p.add_argument("--windows", type=int, default=660, help="evaluation windows, at most (default 660)")
    p.add_argument("--prefix-len", type=int, default=256, help="prefix T; windows are 2T tokens (default 256)")
    p.add_argument("--window-step", type=int, default=None,
                   help="start windows every this many tokens (default: 2 x prefix-len, text_windows)")
    p.add_argument("--top-k", default="8", help="source layers per target layer, or 'all' (default 8)")
    p.add_argument("--ridge-lambda", default="0.01",
                   help="ridge penalty on the centered sum Gram matrix, or 'auto' (per variant, by held-out R^2 over "
                        "the library's grid 1e-3 ... 1e3) (default 0.01)")  # fmt: skip
    p.add_argument("--num-sequences", type=int, default=400, help="calibration sequences (default 400)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per calibration sequence (default 256)")
    p.add_argument("--stride", type=int, default=4, help="every n-th calibration token enters the sums (default 4)")
    p.add_argument("--heldout-fraction", type=float, default=0.1,
                   help="share of calibration sequences held out (the last ones; default 0.1, as fit_mapper)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--embedding", choices=["layer0", "raw"], default="layer0",
                   help="embedding feature after the target's layer-0 input RMSNorm (default) or raw")
    p.add_argument("--attention-sequences", type=int, default=16,
                   help="held-out calibration sequences the attention scorer uses (default 16)")
    p.add_argument("--num-exact-layers", type=int, default=1, help="target layers computed exactly (default 1)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences / windows per forward (default 8)")
    p.add_argument("--num-bootstrap", type=int, default=1000, help="bootstrap resamples (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    p.add_argument("--skip-library-check", action="store_true",
                   help="skip the fit_mapper / prefix_perplexity reference runs (faster; no self-test)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--json", type=Path, help="write the full results here")
    args = p.parse_args(argv)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANT_SPECS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    args.variants = ["baseline"] + [v for v in dict.fromkeys(names) if v != "baseline"]
    return args


def library_check(args, source, target, calib_ids, windows, fitter: Fitter, base: Fit, scored: dict, lam_arg,
                  progress: bool) -> dict:  # fmt: skip
    """The harness's baseline against the library's own fit and evaluation on the same data and windows."""
    started = time.perf_counter()
    mapper = fit_mapper(
        source, target, calib_ids, top_k=args.top_k, ridge_lambda=lam_arg, heldout_fraction=args.heldout_fraction,
        stride=args.stride, batch_size=args.batch_size, two_stage=False, progress=progress,
    )  # fmt: skip
    fit_seconds = time.perf_counter() - started
    state = mapper.state_dict()
    weight_err, bias_err, close = 0.0, 0.0, True
    for t in range(fitter.tgt.num_layers):
        for kind in KINDS:
            lw, lb = state[f"layers.{t}.{kind}.weight"].double(), state[f"layers.{t}.{kind}.bias"].double()
            hw, hb = base.weights[kind][t]
            if lw.shape != hw.T.shape:
                close = False
                continue
            scale_w, scale_b = float(lw.abs().max()) or 1.0, float(lb.abs().max()) or 1.0
            weight_err = max(weight_err, float((lw - hw.T).abs().max()) / scale_w)
            bias_err = max(bias_err, float((lb - hb).abs().max()) / scale_b)
            close &= torch.allclose(lw, hw.T, rtol=1e-5, atol=1e-5 * scale_w) and torch.allclose(lb, hb, rtol=1e-5, atol=1e-5 * scale_b)
    lib_r2 = {"key": list(mapper.config.heldout_r2_key or []), "value": list(mapper.config.heldout_r2_value or [])}
    r2_err = max(abs(a - b) for kind in KINDS for a, b in zip(lib_r2[kind], base.heldout_r2[kind]))
    started = time.perf_counter()
    lib = prefix_perplexity(
        source, target, mapper, windows, args.prefix_len, num_recompute_tokens=0, batch_size=args.batch_size, diagnostics=True,
        num_bootstrap=args.num_bootstrap, seed=args.seed, progress=progress, num_exact_layers=args.num_exact_layers,
    )  # fmt: skip
    eval_seconds = time.perf_counter() - started
    nll = scored["nll_per_window"]
    nll_err = {
        name: float(np.abs(np.asarray(lib["nll_per_window"][name]) - nll["baseline" if name == "transfer" else name]).max())
        for name in ("target", "transfer", "floor")
    }
    kl_err = abs(lib["logit_kl"] - float(scored["kl_per_window"]["baseline"].mean()))
    checks = {
        "selected_layers_equal": [list(s) for s in mapper.config.selected_layers] == base.selected,
        "ridge_lambda_equal": math.isclose(float(mapper.config.ridge_lambda), base.ridge_lambda),
        "weights_close_rtol_1e-5": bool(close),
        "weights_max_rel_error": weight_err,
        "bias_max_rel_error": bias_err,
        "heldout_r2_max_abs_error": r2_err,
        "heldout_r2_close": r2_err < 1e-6,
        "nll_max_abs_error": nll_err,
        "nll_within_1e-4": all(v <= 1e-4 for v in nll_err.values()),
        "kl_abs_error": kl_err,
        "kl_within_1e-5": kl_err <= 1e-5,
        "library_normalized_retention": lib["normalized_retention"],
        "library_normalized_retention_ci": lib["normalized_retention_ci"],
        "library_fit_seconds": fit_seconds,
        "library_eval_seconds": eval_seconds,
    }
    checks["passed"] = all(checks[k] for k in ("selected_layers_equal", "ridge_lambda_equal", "weights_close_rtol_1e-5",
                                                "heldout_r2_close", "nll_within_1e-4", "kl_within_1e-5"))  # fmt: skip
    return checks


def pct(x: float) -> str:
    return "nan" if x is None or not math.isfinite(x) else f"{100 * x:.1f}"


def markdown(report: dict) -> str:
    first = report["config"]["num_exact_layers"]
    lines = [
        f"{Path(report['config']['source']).name} -> {Path(report['config']['target']).name}: {report['windows']} windows of 2 x "
        f"{report['config']['prefix_len']} tokens, k={report['config']['top_k']}, "
        f"{report['calibration']['fit_tokens']} fit + {report['calibration']['heldout_tokens']} held-out calibration "
        f"tokens; context gain {report['context_gain_nats']:.4f} nats; ppl own {report['perplexity']['target']:.3f}, "
        f"floor {report['perplexity']['floor']:.3f}",
        "",
        "| variant | lambda | params | fit s | held-out R^2 K | held-out R^2 V | attn cos | ppl | retention % [95% CI] "
        "| diff vs baseline pp [95% CI, paired] | NLL - baseline, mnats [95% CI] | KL to own, mnats "
        "| KL - baseline, mnats [95% CI] | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|---:|---|---|",
    ]
    defined = report["context_gain_nats"] > 0
    if not defined:
        lines[1:1] = ["", f"WARNING: the target's own prefix does not lower its loss here (context gain "
                          f"{report['context_gain_nats']:+.4f} nats): floor-normalized retention and its differences are "
                          "undefined; compare the NLL column, or use windows the models were trained for "
                          "(e.g. a shorter --prefix-len)."]  # fmt: skip
    for name, row in report["variants"].items():
        r = row["normalized_retention"]
        ci = row["normalized_retention_ci"]
        if name == "baseline":
            diff = dnll = dkl = "-"
        else:
            d, lo, hi = row["diff_vs_baseline"], *row["diff_vs_baseline_ci"]
            verdict = "inside the noise" if lo <= 0 <= hi else ("better" if lo > 0 else "worse")
            diff = f"{100 * d:+.2f} [{100 * lo:+.2f}, {100 * hi:+.2f}] " + (verdict if defined else "(undefined)")
            d, lo, hi = row["nll_minus_baseline"], *row["nll_minus_baseline_ci"]
            verdict = "inside the noise" if lo <= 0 <= hi else ("lower" if hi < 0 else "higher")
            dnll = f"{1000 * d:+.2f} [{1000 * lo:+.2f}, {1000 * hi:+.2f}] {verdict}"
            d, lo, hi = row["kl_minus_baseline"], *row["kl_minus_baseline_ci"]
            verdict = "inside the noise" if lo <= 0 <= hi else ("lower" if hi < 0 else "higher")
            dkl = f"{1000 * d:+.2f} [{1000 * lo:+.2f}, {1000 * hi:+.2f}] {verdict}"
        cos = row["attention_cosine_mean"]
        lines.append(
            f"| {name} | {row['ridge_lambda']:g} | {row['params']:,} | {row['fit_seconds']:.2f} "
            f"| {row['heldout_r2_key_mean']:.4f} | {row['heldout_r2_value_mean']:.4f} "
            f"| {'-' if cos is None else f'{cos:.4f}'} | {row['perplexity']:.3f} "
            f"| {pct(r)} [{pct(ci[0])}, {pct(ci[1])}] | {diff} | {dnll} | {1000 * row['kl_to_own']:.2f} | {dkl} "
            f"| {'; '.join(row['notes'])} |"
        )
    lines.append("")
    lines.append(f"R^2 and attention cosine (attn cos): means over target layers {first}.. (layers < {first} are computed "
                 "exactly), maps fit on the calibration fit shard, scored on its held-out shard. fit s: selection + "
                 "solves from the sums (the single-source R^2 ranking is computed once, by the first variant that "
                 "needs it). Retention: floor-normalized, (floor - transfer) / (floor - own) of the mean NLL. KL to own: "
                 "KL(own-prefill || transfer) of the next-token distributions on the scored tokens (0 = the target "
                 "predicts exactly as with its own prefill). Differences: paired bootstrap over the same windows; "
                 "'inside the noise' = the 95% CI contains 0.")  # fmt: skip
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    """The whole ablation for parsed arguments: the result dict (also what `--json` writes)."""
    progress = not args.no_progress
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    source = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    src, tgt = KVLayout.from_config(source.config), KVLayout.from_config(target.config)
    k = src.num_layers if args.top_k == "all" else min(int(args.top_k), src.num_layers)
    lam_arg = args.ridge_lambda if args.ridge_lambda == "auto" else float(args.ridge_lambda)
    lambdas = list(RIDGE_LAMBDA_CANDIDATES) if lam_arg == "auto" else [lam_arg]
    if not 0 <= args.num_exact_layers <= tgt.num_layers:
        raise SystemExit(f"--num-exact-layers must be in [0, {tgt.num_layers}]")

    calib_ids, _ = build_calibration(tokenizer, str(args.calibration_text), None, num_sequences=args.num_sequences,
                                     seq_len=args.seq_len)  # fmt: skip
    num_heldout = heldout_count(calib_ids.shape[0], args.heldout_fraction)
    if num_heldout == 0:
        raise SystemExit("the ablation needs a held-out shard: --heldout-fraction > 0")
    documents = split_documents(args.heldout_text.read_text(), getattr(tokenizer, "eos_token", None))
    docs = [tokenizer(d, add_special_tokens=False, verbose=False)["input_ids"] for d in documents]
    windows = windows_from(docs, args.prefix_len, args.windows, args.window_step)
    if windows.shape[0] < args.windows:
        print(f"note: {args.heldout_text} gives {windows.shape[0]} windows of {2 * args.prefix_len} tokens "
              f"(asked for up to {args.windows}); see --window-step", flush=True)  # fmt: skip

    embedding = TokenEmbedding(target, args.embedding)
    wants_probe = True  # the attention cosine column; attn-select needs it
    probe = AttentionProbe(target, args.attention_sequences) if wants_probe else None
    consumer = FeatureSums(calib_ids, embedding, src, tgt, args.stride, probe)
    dim_z = 2 * src.total_dim + embedding.dim
    print(f"sums: 2 kinds x 2 shards x ({dim_z}^2 + {dim_z}x{tgt.total_dim}) float64 = "
          f"{4 * (dim_z * dim_z + dim_z * tgt.total_dim) * 8 / 2**20:,.1f} MiB", flush=True)  # fmt: skip
    started = time.perf_counter()
    try:
        calibration_pass(source, target, calib_ids, None, [consumer], stride=args.stride, batch_size=args.batch_size,
                         num_heldout=num_heldout, progress=progress)  # fmt: skip
    finally:
        if probe is not None:
            probe.remove()
    pass_seconds = time.perf_counter() - started

    checks: dict = {}
    if probe is not None:
        checks["attention_probe_max_abs_error"] = probe.self_check()
        checks["attention_probe_ok"] = checks["attention_probe_max_abs_error"] < 1e-4
    fitter = Fitter(consumer.train, consumer.heldout, src, tgt, embedding.dim, k, probe, args.num_exact_layers)
    fits = []
    for name in tqdm(args.variants, desc="fitting variants", disable=not progress):
        fits.append(fit_variant(fitter, VARIANT_SPECS[name], lambdas))

    started = time.perf_counter()
    scored = score_windows(source, target, fits, windows, args.prefix_len, embedding, src, tgt, args.num_exact_layers,
                           args.batch_size, progress)  # fmt: skip
    eval_seconds = time.perf_counter() - started
    nll, kls = scored["nll_per_window"], scored["kl_per_window"]
    n = windows.shape[0]
    report = {
        "config": {**{k_: (str(v) if isinstance(v, Path) else v) for k_, v in vars(args).items()}, "top_k": k,
                   "lambdas": lambdas},
        "windows": int(n),
        "calibration": {"sequences": int(calib_ids.shape[0]), "seq_len": args.seq_len, "heldout_sequences": num_heldout,
                        "fit_tokens": consumer.train.count, "heldout_tokens": consumer.heldout.count,
                        "attention_sequences": probe.num_sequences if probe else 0},
        "seconds": {"calibration_pass": pass_seconds, "scoring": eval_seconds},
        "context_gain_nats": float(nll["floor"].mean() - nll["target"].mean()),
        "perplexity": {name: float(np.exp(nll[name].mean())) for name in ("target", "floor")},
        "variants": {},
    }  # fmt: skip
    first = args.num_exact_layers
    for fit in fits:
        name = fit.variant.name
        row = {
            "ridge_lambda": fit.ridge_lambda,
            "selected_layers": fit.selected,
            "heldout_selected_layers": fit.heldout_selected,
            "params": fit.params,
            "fit_seconds": fit.seconds,
            "heldout_r2_key": fit.heldout_r2["key"],
            "heldout_r2_value": fit.heldout_r2["value"],
            "heldout_r2_key_mean": float(np.mean(fit.heldout_r2["key"][first:] or [float("nan")])),
            "heldout_r2_value_mean": float(np.mean(fit.heldout_r2["value"][first:] or [float("nan")])),
            "eval_r2_key": scored["eval_r2"][name]["key"],
            "eval_r2_value": scored["eval_r2"][name]["value"],
            "attention_cosine": fit.attention_cosine,
            "attention_cosine_mean": float(np.mean(fit.attention_cosine[first:])) if fit.attention_cosine and fit.attention_cosine[first:] else None,
            "nll": float(nll[name].mean()),
            "perplexity": float(np.exp(nll[name].mean())),
            "normalized_retention": retention(nll, name, np.arange(n)),
            "normalized_retention_ci": bootstrap_ci(lambda i, name=name: retention(nll, name, i), n, args.num_bootstrap, args.seed),
            "kl_to_own": float(kls[name].mean()),
            "nll_per_window": nll[name].tolist(),
            "kl_per_window": kls[name].tolist(),
            "notes": fit.notes,
        }  # fmt: skip
        if fit.selection_scores:
            row["attention_selection_scores"] = fit.selection_scores
        if name != "baseline":
            row["diff_vs_baseline"] = row["normalized_retention"] - report["variants"]["baseline"]["normalized_retention"]
            row["diff_vs_baseline_ci"] = bootstrap_ci(
                lambda i, name=name: retention(nll, name, i) - retention(nll, "baseline", i), n, args.num_bootstrap, args.seed
            )
            # the same comparison in raw NLL (meaningful even where the context gain, the denominator, is not)
            delta = nll[name] - nll["baseline"]
            row["nll_minus_baseline"] = float(delta.mean())
            row["nll_minus_baseline_ci"] = bootstrap_ci(lambda i, d=delta: float(d[i].mean()), n, args.num_bootstrap, args.seed)
            delta = kls[name] - kls["baseline"]
            row["kl_minus_baseline"] = float(delta.mean())
            row["kl_minus_baseline_ci"] = bootstrap_ci(lambda i, d=delta: float(d[i].mean()), n, args.num_bootstrap, args.seed)
            row["same_layers_as_baseline"] = fit.selected == fits[0].selected
            if fit.variant.selection != "r2" and not fit.notes:
                changed = sum(a != b for a, b in list(zip(fit.selected, fits[0].selected))[first:])
                row["notes"] = [f"other layers than the baseline for {changed} of {tgt.num_layers - first} mapped target layers"
                                if changed else "the same layers as the baseline"]  # fmt: skip
        report["variants"][name] = row
    report["nll_per_window"] = {name: nll[name].tolist() for name in ("target", "floor")}
    if not args.skip_library_check:
        checks.update(library_check(args, source, target, calib_ids, windows, fitter, fits[0], scored, lam_arg, progress))
    report["checks"] = checks
    report["markdown"] = markdown(report)
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    report = run(args)
    print(report["markdown"])
    checks = report["checks"]
    failed = [name for name in ("attention_probe_ok", "passed") if name in checks and not checks[name]]
    print("\nself-tests: " + ", ".join(
        f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in checks.items()
        if k.endswith(("_ok", "_equal", "error", "passed", "rtol_1e-5", "within_1e-4", "within_1e-5", "close"))
    ))  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=float) + "\n")
    if failed:
        print(f"SELF-TEST FAILED: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
