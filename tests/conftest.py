"""Tiny models built from configs (no downloads), and an exactly linear model pair (a target storing an invertible per-head transform of the source's KV)."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# OpenMP busy-waiting makes small ops cost milliseconds on a loaded 2-core machine (set before torch loads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# The mappers `demo` fits and keeps (`commands/demo_mapper.py`) go to a folder of this run, not the user's cache.
os.environ["HF_KVTRANSFER_CACHE"] = tempfile.mkdtemp(prefix="hf-kvtransfer-tests-")
atexit.register(shutil.rmtree, os.environ["HF_KVTRANSFER_CACHE"], ignore_errors=True)

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Ministral3Config,
    Ministral3ForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

# The local Hub-compatible server (tests/hub_server.py) and its `hub_server` / `unreachable_hub` fixtures.
pytest_plugins = ["hub_fixtures"]

# Timeouts of subprocesses and queues in tests are hang guards, never performance checks: far above any run's time
# on a loaded machine (a 300 s limit failed a correct change when CI shared its machine: issue 39), so only a
# process that never ends trips one.
HANG_GUARD_S = 3600

VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    # The default 0.02 makes random models emit one repeated token; 0.2 gives varied, sharp outputs.
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

ARCHITECTURES = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=16)),
    "llama3-scaling": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            head_dim=16,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "yarn": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(
            head_dim=16,
            max_position_embeddings=128,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
        ),
    ),
    "mistral": (MistralConfig, MistralForCausalLM, dict(head_dim=16, sliding_window=None)),
    "phi3-partial": (Phi3Config, Phi3ForCausalLM, dict(partial_rotary_factor=0.5)),
    "ministral3-yarn": (
        Ministral3Config,
        Ministral3ForCausalLM,
        dict(
            head_dim=16,
            sliding_window=None,
            max_position_embeddings=128,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "llama_4_scaling_beta": 0.1,
            },
        ),
    ),
}


# The token tables and the first-layer table: map inputs defined outside the library, in research/token_tables/ as a
# plug-in that registers them when imported (issue 36: inputs the default fit never chooses live beside their study).
TABLES_PLUGIN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "research", "token_tables")


def tables_plugin():
    """The research plug-in `token_tables_plugin`, imported (its inputs registered, for the rest of the session)."""
    import importlib
    import sys

    if TABLES_PLUGIN_DIR not in sys.path:
        sys.path.append(TABLES_PLUGIN_DIR)
    return importlib.import_module("token_tables_plugin")


def tiny_model(arch: str = "qwen3", num_hidden_layers: int = 2, seed: int = 0, **overrides) -> torch.nn.Module:
    config_cls, model_cls, extra = ARCHITECTURES[arch]
    kwargs = {**COMMON, **extra, "num_hidden_layers": num_hidden_layers, **overrides}
    torch.manual_seed(seed)
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    return model_cls(config).eval()


def random_ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seq), generator=g)


def steady_timings(ms_of):
    """A stand-in for `exact_layers._time_candidates` on a machine without noise: every round of a candidate
    `(mapper, num_exact_layers)` takes `ms_of(mapper, num_exact_layers)` ms (both clocks); the own prefill 100 ms."""

    def fake(source, target, configs, ids, rounds=5, measure_own=True):
        per = [{"wall": [ms_of(m, n)] * rounds, "cpu": [ms_of(m, n)] * rounds} for m, n in configs]
        return per, {"wall": [100.0] * rounds if measure_own else [], "cpu": [100.0] * rounds if measure_own else []}

    return fake


def residual_pair(residual_layers=(0,)):
    """A tiny qwen3 pair (2 -> 3 layers) with its source-only mapper (1 exact layer) and, for each residual layer J
    asked for, the mapper that also reads the target's residual entering J: `(source, target, ids, base, [mappers])`."""
    from hf_kvtransfer import fit_mapper
    from hf_kvtransfer.fitting.calibration_pass import calibration_pass
    from hf_kvtransfer.fitting.residual_stats import ResidualStatistics, solve_residual_mapper

    source = tiny_model("qwen3", num_hidden_layers=2, seed=0)
    target = tiny_model("qwen3", num_hidden_layers=3, seed=1)
    ids = random_ids(6, 40, seed=5)
    base = fit_mapper(source, target, ids, top_k=2, num_exact_layers=1, heldout_fraction=0, progress=False)
    stats = ResidualStatistics.for_models(source, target, layers=[0, 1], lags=(0, 1), stride=1)
    calibration_pass(source, target, ids, consumers=[stats], progress=False)
    return source, target, ids, base, [solve_residual_mapper(base, stats, residual_layer=j) for j in residual_layers]


def left_pad(ids: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad row i to keep only its last `lengths[i]` tokens; returns (ids, mask)."""
    ids = ids.clone()
    mask = torch.ones_like(ids)
    for row, n in enumerate(lengths):
        ids[row, : ids.shape[1] - n] = COMMON["pad_token_id"]
        mask[row, : ids.shape[1] - n] = 0
    return ids, mask


@pytest.fixture(scope="session")
def qwen3_model():
    return tiny_model("qwen3", num_hidden_layers=3)


@pytest.fixture(scope="session")
def calibration_ids():
    return random_ids(24, 64, seed=123)


@pytest.fixture(scope="session")
def identity_mapper(qwen3_model, calibration_ids):
    from hf_kvtransfer import fit_mapper

    # lambda=0.01 on 384 calibration tokens shrinks the map by ~1e-4 relative (logit error ~1e-3); the paper's
    # 128K tokens make that negligible. A small lambda gives the same effect on a fast test budget.
    return fit_mapper(qwen3_model, qwen3_model, calibration_ids, top_k=1, ridge_lambda=1e-4, progress=False)


def exact_identity_mapper(model, mode: str = "per_layer"):
    """A mapper from `model` to itself whose weights are the identity by construction (no fit). `mode`:
    "per_layer" (target layer t reads source layer t), "grouped" (every layer reads all source layers, zero weights
    on the others), "low_rank" (per layer, stored as full-rank factors `up @ down`) or "token_table" (per layer, but
    layer 0's map is zero and its keys and values come from token tables alone (the research plug-in, `tables_plugin`): layer 0's K/V depend only on each
    token, so a lag-0 table of the model's own layer-0 K/V per id is exact, and a constant moved from the lag-0 rows to
    every lag-1 row checks one look-up per lag and position; a misplaced id changes the answer)."""
    from hf_kvtransfer import KVMapper, MapperConfig

    num_layers = model.config.num_hidden_layers
    selected = [list(range(num_layers)) if mode == "grouped" else [t] for t in range(num_layers)]
    config = MapperConfig(source_config=model.config.to_dict(), target_config=model.config.to_dict(), selected_layers=selected)
    width = config.target_layout.layer_dim
    if mode == "low_rank":
        config = replace(config, mapper_type="lowrank", rank=[[width, width]] * num_layers)
    if mode == "token_table":
        tables_plugin()  # registers the token tables
        config = replace(config, map_inputs={"token_tables": {"lags": [0, 1], "readers": [0]}})
    mapper = KVMapper(config)
    with torch.no_grad():
        for param in mapper.parameters():
            param.zero_()
        for t, layer in enumerate(mapper.layers):
            for kind in ("key", "value"):
                proj = getattr(layer, kind)
                if mode == "low_rank":
                    proj.down.weight.copy_(torch.eye(width))
                    proj.up.weight.copy_(torch.eye(width))
                elif not (mode == "token_table" and t == 0):
                    offset = selected[t].index(t) * width
                    proj.weight[:, offset : offset + width] = torch.eye(width)
        if mode == "token_table":
            for kind, table in _layer0_states(model).items():
                shift = torch.linspace(-1, 1, width)
                tables = getattr(mapper.tokens, kind)["0"]
                tables[0, :-1] = table - shift
                tables[1] = shift
    return mapper


def _layer0_states(model) -> dict[str, torch.Tensor]:
    """Layer 0's RoPE-free keys (after its key norm) and values for every token id: `[vocab, kv_heads * head_dim]`."""
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        h = model.model.layers[0].input_layernorm(model.model.embed_tokens.weight)
        keys = attn.k_proj(h).view(h.shape[0], -1, attn.head_dim)
        keys = attn.k_norm(keys) if hasattr(attn, "k_norm") else keys
        return {"key": keys.flatten(1), "value": attn.v_proj(h)}


@pytest.fixture(scope="session")
def grouped_identity_mapper(identity_mapper):
    """`identity_mapper` rewritten so every target layer reads *all* source layers (zero weights on the others):
    the same map, taken through the cache's grouped path (one product for all layers sharing a selection)."""
    import copy

    from hf_kvtransfer import KVMapper

    config = copy.deepcopy(identity_mapper.config)
    num_layers = len(config.selected_layers)
    config.selected_layers, config.top_k = [list(range(num_layers))] * num_layers, num_layers
    mapper = KVMapper(config)
    width = identity_mapper.source_layout.layer_dim
    with torch.no_grad():
        for t, (dense, one) in enumerate(zip(mapper.layers, identity_mapper.layers)):
            for kind in ("key", "value"):
                getattr(dense, kind).weight.zero_()[:, t * width : (t + 1) * width] = getattr(one, kind).weight
                getattr(dense, kind).bias.copy_(getattr(one, kind).bias)
    return mapper


# -- the exactly linear pair -----------------------------------------------------------------------


def _rope_commuting_transform(head_dim: int, g: torch.Generator) -> torch.Tensor:
    """A scaled rotation inside each RoPE plane (dims i, i + d/2): it commutes with every RoPE rotation."""
    half = head_dim // 2
    m = torch.zeros(head_dim, head_dim)
    scale = 0.5 + torch.rand(half, generator=g)
    angle = torch.rand(half, generator=g) * 6.28
    for i in range(half):
        c, s = scale[i] * torch.cos(angle[i]), scale[i] * torch.sin(angle[i])
        m[i, i], m[i, i + half], m[i + half, i], m[i + half, i + half] = c, -s, s, c
    return m


def linear_pair(num_source_layers: int = 3, inserted_after: tuple[int, ...] = (0, 2), seed: int = 0):
    """A source Llama and a target that computes the same function but stores linearly transformed KV.

    Target layer for source layer s: keys K' = B_h K (B commutes with RoPE; q_proj compensates), values
    V' = A_h V (o_proj compensates), KV heads permuted (query head groups follow). After the source layers
    listed in `inserted_after`, an extra layer with zero `o_proj` and `down_proj` is inserted: it leaves the
    function unchanged but its KV is unrelated to any source layer.

    Returns:
        `(source, target, true_source_of)` where `true_source_of[t]` is the source layer behind target layer
        `t`, or None for an inserted layer.
    """
    source = tiny_model("llama3-scaling", num_hidden_layers=num_source_layers, seed=seed, initializer_range=0.15)
    cfg = source.config
    d, n_kv, n_heads = cfg.head_dim, cfg.num_key_value_heads, cfg.num_attention_heads
    group = n_heads // n_kv
    g = torch.Generator().manual_seed(seed + 1)
    true_source_of: list[int | None] = []
    for s in range(num_source_layers):
        true_source_of.append(s)
        if s in inserted_after:
            true_source_of.append(None)
    target = tiny_model(
        "llama3-scaling", num_hidden_layers=len(true_source_of), seed=seed + 2, initializer_range=0.15
    )
    sd_src = source.state_dict()
    with torch.no_grad():
        for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            target.state_dict()[name].copy_(sd_src[name])
        perm = torch.randperm(n_kv, generator=g)  # target KV head h reads source KV head perm[h]
        for t, s in enumerate(true_source_of):
            tl = target.model.layers[t]
            if s is None:
                tl.self_attn.o_proj.weight.zero_()
                tl.mlp.down_proj.weight.zero_()
                continue
            sl = source.model.layers[s]
            for name in ("input_layernorm", "post_attention_layernorm"):
                getattr(tl, name).weight.copy_(getattr(sl, name).weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(tl.mlp, name).weight.copy_(getattr(sl.mlp, name).weight)
            wq = sl.self_attn.q_proj.weight.view(n_heads, d, -1)
            wk = sl.self_attn.k_proj.weight.view(n_kv, d, -1)
            wv = sl.self_attn.v_proj.weight.view(n_kv, d, -1)
            wo = sl.self_attn.o_proj.weight.view(-1, n_heads, d)
            new_q, new_k, new_v, new_o = (torch.empty_like(w) for w in (wq, wk, wv, wo))
            for h in range(n_kv):
                src_h = int(perm[h])
                b = _rope_commuting_transform(d, g)
                a = torch.eye(d) + 0.3 * torch.randn(d, d, generator=g) / d**0.5
                new_k[h] = b @ wk[src_h]
                new_v[h] = a @ wv[src_h]
                for j in range(group):
                    # scores: (B^-T q)^T (B k) = q^T k ; outputs: o_proj A^-1 (A v) = o_proj v
                    new_q[h * group + j] = torch.linalg.inv(b).T @ wq[src_h * group + j]
                    new_o[:, h * group + j] = wo[:, src_h * group + j] @ torch.linalg.inv(a)
            tl.self_attn.q_proj.weight.copy_(new_q.reshape_as(tl.self_attn.q_proj.weight))
            tl.self_attn.k_proj.weight.copy_(new_k.reshape_as(tl.self_attn.k_proj.weight))
            tl.self_attn.v_proj.weight.copy_(new_v.reshape_as(tl.self_attn.v_proj.weight))
            tl.self_attn.o_proj.weight.copy_(new_o.reshape_as(tl.self_attn.o_proj.weight))
    return source, target, true_source_of


@pytest.fixture(scope="session")
def linear_models():
    return linear_pair()


def scrambled_mapper(mapper):
    """Same shapes as `mapper`, weights scrambled: a transfer that loses the context, so checks of it can fail."""
    from hf_kvtransfer import KVMapper

    out = KVMapper(mapper.config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in out.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return out


def load_script(path: str | os.PathLike):
    """A script of the repository (`research/`, `docs/`), imported as a module named after its file; it stays in
    `sys.modules` (a dataclass looks its module up while it is built)."""
    name = Path(path).stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
