"""KVMapper persistence (strict), config validation and compatibility checks."""

import copy
import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import random_ids, tiny_model
from hf_kvtransfer import KVMapper, MapperConfig, TransferredCache, prefill
from hf_kvtransfer.core.mapper import config_fingerprint


def test_save_load_round_trip(identity_mapper, qwen3_model, tmp_path):
    given = copy.deepcopy(identity_mapper.config)
    identity_mapper.save_pretrained(tmp_path / "m")
    assert identity_mapper.config == given  # saving does not touch the mapper's config
    files = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert files == ["README.md", "config.json", "fit_report.json", "model.safetensors"]
    # the fit's exact-layer probe had too few held-out tokens here: it says so and records no number
    report = json.loads((tmp_path / "m" / "fit_report.json").read_text())["exact_layers"]
    assert report["chosen"] is None and "too few" in report["reason"]
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["num_exact_layers"] is None
    assert config["library_version"] and config["selected_layers"] == [[0], [1], [2]]
    assert config["target_fingerprint"]["num_key_value_heads"] == 2
    loaded = KVMapper.from_pretrained(tmp_path / "m")
    for (k1, v1), (k2, v2) in zip(identity_mapper.state_dict().items(), loaded.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
    # what saving adds to the written copy: size and dtype for the card
    num_parameters = sum(v.numel() for v in identity_mapper.state_dict().values())
    assert loaded.config == replace(identity_mapper.config, num_parameters=num_parameters, dtype="float32")
    # the loaded mapper rebuilds both rotary modules from the stored configs alone
    ids = random_ids(1, 14, seed=1)
    a = TransferredCache(prefill(qwen3_model, ids), identity_mapper, num_exact_layers=0).convert_all()
    b = TransferredCache(prefill(qwen3_model, ids), loaded, num_exact_layers=0).convert_all()
    assert all(torch.equal(x.keys, y.keys) for x, y in zip(a.layers, b.layers))


def test_strict_loading_names_the_problem(identity_mapper, tmp_path):
    path = tmp_path / "m"
    identity_mapper.save_pretrained(path)
    state = load_file(str(path / "model.safetensors"))

    missing = dict(state)
    missing.pop("layers.1.value.bias")
    save_file(missing, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors \['layers.1.value.bias'\]"):
        KVMapper.from_pretrained(path)

    wrong = dict(state)
    wrong["layers.0.key.weight"] = torch.zeros(32, 31)
    save_file(wrong, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers.0.key.weight has shape \[32, 31\], config implies \[32, 32\]"):
        KVMapper.from_pretrained(path)

    extra = dict(state, **{"layers.9.key.weight": torch.zeros(1)})
    save_file(extra, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensors"):
        KVMapper.from_pretrained(path)

    nan = dict(state)
    nan["layers.2.key.bias"] = torch.full((32,), float("nan"))
    save_file(nan, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="non-finite"):
        KVMapper.from_pretrained(path)

    (path / "model.safetensors").unlink()
    with pytest.raises(OSError, match="model.safetensors"):
        KVMapper.from_pretrained(path)


def test_unknown_config_keys_warn_and_bad_values_raise(identity_mapper, tmp_path):
    data = identity_mapper.config.to_dict()
    with pytest.warns(UserWarning, match="unknown mapper config keys"):
        MapperConfig.from_dict({**data, "from_the_future": 1})
    with pytest.raises(ValueError, match="one per target layer"):
        MapperConfig.from_dict({**data, "selected_layers": [[0], [1]]})
    with pytest.raises(ValueError, match=r"selected_layers\[1\]"):
        MapperConfig.from_dict({**data, "selected_layers": [[0], [5], [2]]})
    with pytest.raises(ValueError, match="mapper_type"):
        MapperConfig.from_dict({**data, "mapper_type": "magic"})


def test_check_compatible(identity_mapper, qwen3_model):
    identity_mapper.check_compatible(qwen3_model.config, qwen3_model.config)  # no warning, no error
    rope_changed = tiny_model("qwen3", num_hidden_layers=3, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    with pytest.warns(UserWarning, match="rope_parameters"):
        identity_mapper.check_compatible(target_config=rope_changed.config)
    with pytest.raises(ValueError, match="rope_parameters"):
        identity_mapper.check_compatible(target_config=rope_changed.config, strict=True)
    deeper = tiny_model("qwen3", num_hidden_layers=4)
    with pytest.raises(ValueError, match="num_hidden_layers: mapper has 3, model has 4") as refused:
        identity_mapper.check_compatible(target_config=deeper.config)
    # A mapper that records no model id names no "None" model.
    assert identity_mapper.config.target_model_id is None
    assert "None" not in str(refused.value) and "another target model" in str(refused.value)


def test_fingerprint_round_trips_through_config_dict(qwen3_model):
    assert config_fingerprint(qwen3_model.config) == config_fingerprint(qwen3_model.config.to_dict())
