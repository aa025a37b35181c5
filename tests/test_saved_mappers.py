"""Mappers saved by an earlier version load unchanged and transfer the same keys and values.

`tests/fixtures/saved_mappers/` holds one mapper of each kind the fit saves, and of the research plug-in's kinds
(token tables, the first-layer table: registered by `mapper_kinds`; written by `python tests/mapper_kinds.py` with the
version named in each config), and the K/V each transferred then for a fixed prompt. A change of the saved
format must keep loading them, and a change of the conversion must keep their numbers.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_model
from hf_kvtransfer import KVMapper
from mapper_kinds import FIXTURES, KINDS, NESTED_FIXTURES, NESTED_KINDS, transferred_kv

# The flat fields the inputs' settings were before they were nested (`MapperConfig.map_inputs`), written out here
# rather than taken from the migration under test.
FLAT = {"residual": {"residual_layer": "layer", "residual_lags": "lags", "residual_rank": "rank",
                     "residual_readers": "readers", "residual_in_tables": "in_tables"},
        "token_tables": {"token_lags": "lags", "token_readers": "readers"}}  # fmt: skip
SWITCHES = {"key_before_norm": "key_norm", "first_layer_table": "first_layer_table"}


def migrated(flat: dict) -> dict:
    """A flat config.json in the nested form: each input's fields under `map_inputs[name]`, defaults written out."""
    data, inputs = dict(flat), {}
    for name, fields in FLAT.items():
        values = {new: data.pop(old, None) for old, new in fields.items()}
        if values["layer" if name == "residual" else "lags"] is not None:
            inputs[name] = {"rank": None, "readers": None, "in_tables": False, **{k: v for k, v in values.items() if v is not None}} \
                if name == "residual" else values
    inputs.update({name: {} for old, name in SWITCHES.items() if data.pop(old, False)})
    return {**data, "map_inputs": inputs}


@pytest.fixture(scope="module")
def pair():
    # The pair `fit_fixtures.save_pair(root, source_layers=2, target_layers=3)` saves, rebuilt from its seeds.
    source = tiny_model("qwen3", num_hidden_layers=2, seed=1)
    target = tiny_model("qwen3", num_hidden_layers=3, seed=2, num_key_value_heads=1, head_dim=8, num_attention_heads=2)
    return source, target


@pytest.mark.parametrize("path", [FIXTURES / k for k in KINDS] + [NESTED_FIXTURES / k for k in NESTED_KINDS],
                         ids=KINDS + [f"nested-{k}" for k in NESTED_KINDS])
def test_saved_mapper_loads_and_transfers_as_it_did(path, pair, tmp_path):
    kind = path.name
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no unknown keys, no migration warnings
        mapper = KVMapper.from_pretrained(path)
    expected = load_file(path / "expected_kv.safetensors")
    got = transferred_kv(*pair, mapper)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-5, msg=lambda m: f"{kind} {name}: {m}")
    # Saved again, it is the same config (but for the version that wrote it), in the running version's form.
    mapper.save_pretrained(tmp_path)
    again, before = (json.loads((p / "config.json").read_text()) for p in (tmp_path, path))
    again.pop("library_version"), before.pop("library_version")
    assert again == before if "map_inputs" in before else again == migrated(before)


@pytest.mark.parametrize("kind", NESTED_KINDS)
def test_a_card_rendered_from_a_flat_config_says_what_the_nested_one_says(kind):
    # `push_mapper_dir` renders a card from config.json when a folder has none: an older, flat config must still
    # say what the mapped layers read, in the words `info` uses for the loaded mapper (test_surfaces checks those
    # words against what a transfer does).
    from conftest import tables_plugin

    from hf_kvtransfer import KVMapper
    from hf_kvtransfer.core.card import render_model_card
    from hf_kvtransfer.core.map_inputs import maps_read

    tables_plugin()  # the plug-in kinds' inputs registered, whatever ran before
    flat, nested = (render_model_card(json.loads((root / kind / "config.json").read_text())) for root in (FIXTURES, NESTED_FIXTURES))
    assert str(flat) == str(nested)
    mapper = KVMapper.from_pretrained(NESTED_FIXTURES / kind)
    read = maps_read(mapper.config, mapper.resolve_num_exact_layers(None))
    assert f"- **What the mapped layers read**: {read}\n" in str(flat), (kind, read)
