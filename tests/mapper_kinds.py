"""Every mapper kind the fit saves, made by the fit's own functions on a tiny pair whose target has another KV layout
than its source (source: 2 layers, 2 KV heads of 16; target: 3 layers, 1 KV head of 8), and the two kinds of the
research plug-in (`PLUGIN_KINDS`: token tables and the first-layer table, research/token_tables/token_tables_plugin,
imported here so that they load). Used by the surface matrix (`test_surfaces.py`) and to write the saved-mapper
fixtures (`python tests/mapper_kinds.py`; `--nested`: the same mappers saved again with the running version's nested
input configs)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

from conftest import tables_plugin

# The plug-in's inputs registered (for the rest of the session): its kinds load, transfer and serve as the library's do.
plugin = tables_plugin()

# The kinds of map inputs defined outside the library (the research plug-in's).
PLUGIN_KINDS = ["token-tables", "first-layer-table"]
KINDS = ["source-only", "k1", "low-rank", "mlp", "residual", "residual-alone", *PLUGIN_KINDS]
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "saved_mappers"
# The same mappers saved with their inputs' settings nested (`MapperConfig.map_inputs`): the kinds that have inputs.
NESTED_KINDS = ["residual", "residual-alone", "token-tables", "first-layer-table"]
# Kinds the surface matrix runs besides the saved fixtures': the residual mapper with the per-request quality gate
# the fit records with --quality-gate-quantile (its threshold a quantile of the score on calibration rows).
SURFACE_KINDS = [*KINDS, "quality-gate"]
NESTED_FIXTURES = FIXTURES.parent / "saved_mappers_nested"


def calibration_ids(tokenizer, corpus: Path) -> torch.Tensor:
    return torch.tensor(tokenizer(corpus.read_text())["input_ids"][: 16 * 48]).view(16, 48)


def make_kinds(source, target, ids: torch.Tensor) -> dict:
    """`{kind: KVMapper}` for the pair, fit on `ids` `[16, 48]`."""
    from hf_kvtransfer import fit_mapper
    from hf_kvtransfer.fitting.calibration_pass import calibration_pass
    from hf_kvtransfer.fitting.quality_gate import calibrate_quality_gate
    from hf_kvtransfer.fitting.residual_stats import ResidualStatistics, solve_residual_mapper

    fit = dict(num_exact_layers=1, heldout_fraction=0, progress=False)
    base = fit_mapper(source, target, ids, top_k=2, **fit)
    stats = ResidualStatistics.for_models(source, target, layers=[0, 1], lags=[0, 1], stride=1)
    calibration_pass(source, target, ids, consumers=[stats], progress=False)
    residual = solve_residual_mapper(base, stats, residual_layer=1)
    return {
        "source-only": base,
        "k1": fit_mapper(source, target, ids, top_k=1, **fit),
        "low-rank": fit_mapper(source, target, ids, top_k=2, rank="2", **fit),
        "mlp": fit_mapper(source, target, ids, top_k=2, mapper_type="mlp", mlp_epochs=1, mlp_hidden_size=32,
                          **{**fit, "heldout_fraction": 0.25}),
        "residual": residual,
        "residual-alone": solve_residual_mapper(base, stats, residual_layer=1, sources={2: []}),
        "token-tables": plugin.fit_token_tables(source, target, residual, ids, readers=[2], lags=(0, 1), pseudo_count=1.0),
        "first-layer-table": plugin.tabulate_first_layer(base, target),
        "quality-gate": calibrate_quality_gate(source, target, copy.deepcopy(residual), ids[-4:], quantile=0.5),
    }


def fixture_prompt() -> torch.Tensor:
    return torch.arange(4, 40).view(1, -1) % 60 + 4


def transferred_kv(source, target, mapper) -> dict[str, torch.Tensor]:
    """The converted cache of `fixture_prompt()` (every layer, with the mapper's exact layers), by layer."""
    from hf_kvtransfer import TransferredCache, prefill

    ids = fixture_prompt()
    cache = TransferredCache(prefill(source, ids), mapper, num_recompute_tokens=1, model=target).convert_all()
    return {f"{kind}.{t}": getattr(layer, kind) for t, layer in enumerate(cache.layers) for kind in ("keys", "values")}


def write_fixtures() -> None:
    """Save each kind as the running version saves it, with the K/V it transfers, under `FIXTURES`."""
    import tempfile

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fit_fixtures import save_pair, write_corpus

    root = Path(tempfile.mkdtemp())
    source_dir, target_dir = save_pair(root, source_layers=2, target_layers=3)
    source = AutoModelForCausalLM.from_pretrained(source_dir).eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    ids = calibration_ids(AutoTokenizer.from_pretrained(target_dir), write_corpus(root / "corpus.txt", num_paragraphs=120))
    for kind, mapper in make_kinds(source, target, ids).items():
        out = FIXTURES / kind
        mapper.save_pretrained(out)
        (out / "README.md").unlink()  # the card is tested elsewhere; the fixture is the config and weights
        save_file({k: v.contiguous() for k, v in transferred_kv(source, target, mapper).items()}, out / "expected_kv.safetensors")


def write_nested_fixtures() -> None:
    """Load each of `NESTED_KINDS` from `FIXTURES` and save it as the running version saves it (nested input
    configs) under `NESTED_FIXTURES`, with the same K/V to transfer."""
    import shutil

    from hf_kvtransfer import KVMapper

    for kind in NESTED_KINDS:
        out = NESTED_FIXTURES / kind
        KVMapper.from_pretrained(FIXTURES / kind).save_pretrained(out)
        (out / "README.md").unlink()
        shutil.copy(FIXTURES / kind / "expected_kv.safetensors", out / "expected_kv.safetensors")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if sys.argv[1:] == ["--nested"]:
        write_nested_fixtures()
    else:
        write_fixtures()
