"""Mappers saved by an earlier version load unchanged and transfer the same keys and values.

`tests/fixtures/saved_mappers/` holds one mapper of each kind the fit saves (written by `python tests/mapper_kinds.py`
with the version named in each config), and the K/V each transferred then for a fixed prompt. A change of the saved
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
from mapper_kinds import FIXTURES, KINDS, transferred_kv


@pytest.fixture(scope="module")
def pair():
    # The pair `fit_fixtures.save_pair(root, source_layers=2, target_layers=3)` saves, rebuilt from its seeds.
    source = tiny_model("qwen3", num_hidden_layers=2, seed=1)
    target = tiny_model("qwen3", num_hidden_layers=3, seed=2, num_key_value_heads=1, head_dim=8, num_attention_heads=2)
    return source, target


@pytest.mark.parametrize("kind", KINDS)
def test_saved_mapper_loads_and_transfers_as_it_did(kind, pair, tmp_path):
    path = FIXTURES / kind
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no unknown keys, no migration warnings
        mapper = KVMapper.from_pretrained(path)
    expected = load_file(path / "expected_kv.safetensors")
    got = transferred_kv(*pair, mapper)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-5, msg=lambda m: f"{kind} {name}: {m}")
    # Saved again, it is the same config (but for the version that wrote it).
    mapper.save_pretrained(tmp_path)
    again, before = (json.loads((p / "config.json").read_text()) for p in (tmp_path, path))
    again.pop("library_version"), before.pop("library_version")
    assert again == before
