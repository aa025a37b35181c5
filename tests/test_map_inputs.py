"""The map-input interface (`core/map_inputs.py`): an input added in its own class with its own config, registered,
is applied by the conversion with no other change; the library's inputs are registered in the order they must apply;
a saved config naming an input this version does not know, or whose inputs contradict each other or the models, is
refused at load with one line naming the field."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass

import pytest
import torch

from conftest import exact_identity_mapper, random_ids
from hf_kvtransfer import KVMapper, TransferredCache, prefill
from hf_kvtransfer.core import map_inputs
from hf_kvtransfer.core.map_inputs import MapInput, MapInputConfig, with_input, writable
from mapper_kinds import FIXTURES, NESTED_FIXTURES


@dataclass
class ValueShiftConfig(MapInputConfig):
    """The toy input's settings: how much of the position index it adds."""

    scale: float = 1.0

    def validate(self, config, name: str) -> None:
        if not self.scale > 0:
            raise ValueError(f"{name}.scale must be > 0, got {self.scale}")


class ValueShift(MapInput):
    """A toy input: adds `scale` times the prompt's position index to target layer 1's values (no RoPE on values, so
    the change is visible as is)."""

    name, order, config_class = "value_shift", 15, ValueShiftConfig

    @property
    def readers(self) -> list[int]:
        return [1]

    def from_ids(self, input_ids, attention_mask):
        positions = torch.arange(input_ids.shape[1], dtype=torch.float32).expand(input_ids.shape[0], -1)  # (B, T)
        return self.settings.scale * positions

    def apply(self, state, group, rows):
        width = self.mapper.target_layout.layer_dim
        values = writable(rows[1])
        for i, _ in self.group_readers(group):
            values[..., i * width : (i + 1) * width] += self.require(state).unsqueeze(-1).to(values.dtype)
        return [rows[0], values]


def test_a_registered_input_is_applied_without_any_other_change(qwen3_model, monkeypatch, tmp_path):
    mapper = exact_identity_mapper(qwen3_model)
    ids = random_ids(2, 12, seed=3)
    plain = TransferredCache(prefill(qwen3_model, ids), mapper, num_recompute_tokens=1, num_exact_layers=0).convert_all()
    monkeypatch.setitem(map_inputs.MAP_INPUTS, ValueShift.name, ValueShift)
    with pytest.raises(ValueError, match=r"^map_inputs.value_shift.scale must be > 0, got -1.0$"):
        with_input(mapper.config, ValueShift.name, ValueShiftConfig(scale=-1.0))
    shifting = KVMapper(with_input(mapper.config, ValueShift.name, ValueShiftConfig(scale=2.0)), layer_maps=mapper.layers)
    assert [type(inp) for inp in shifting.map_inputs] == [ValueShift] and mapper.map_inputs == []
    # Saved, its settings are a dict under its name, and load back as its config.
    shifting.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["map_inputs"] == {"value_shift": {"scale": 2.0}}
    loaded = KVMapper.from_pretrained(tmp_path)
    assert loaded.config.map_inputs == {"value_shift": ValueShiftConfig(scale=2.0)}
    shifted = TransferredCache(prefill(qwen3_model, ids), loaded, num_recompute_tokens=1, num_exact_layers=0).convert_all()
    positions = torch.arange(11, dtype=torch.float32).view(1, 1, 11, 1)
    for t, (a, b) in enumerate(zip(plain.layers, shifted.layers)):
        torch.testing.assert_close(b.keys, a.keys)
        torch.testing.assert_close(b.values, a.values + (2 * positions if t == 1 else 0))
    # Its state follows the cache's batch operations like the source's K/V (here: beams repeat each row).
    cache = TransferredCache(prefill(qwen3_model, ids), loaded, num_recompute_tokens=1, num_exact_layers=0)
    cache.batch_repeat_interleave(2)
    assert cache._transfer.inputs["value_shift"].shape == (4, 11)


def test_the_library_inputs_apply_additions_before_the_key_norm():
    # The library's own inputs; the research plug-in's (imported by mapper_kinds) fall in between by their `order`.
    assert map_inputs.BUILT_IN_MAP_INPUTS == ("residual", "key_norm")
    order = [cls.name for cls in map_inputs.registered_map_inputs()]
    assert order == ["residual", "token_tables", "key_norm", "first_layer_table"]


def _tampered(tmp_path, source, change) -> str:
    """A copy of the saved mapper `source` whose config.json `change(config)` edited."""
    shutil.copytree(source, tmp_path / "mapper")
    path = tmp_path / "mapper" / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))
    return str(tmp_path / "mapper")


# (what is wrong, the saved mapper, the edit, the one line expected): the target has 3 layers; these mappers read the
# residual entering layer 1 with 2 exact layers and add token tables on layer 2 (the research plug-in's input,
# registered by mapper_kinds).
NESTED, FLAT = NESTED_FIXTURES / "token-tables", FIXTURES / "token-tables"
REFUSALS = {
    "an input this version does not know": (
        NESTED, lambda c: c["map_inputs"].update(gated_cross_attention={"layers": [2]}),
        r"map_inputs.gated_cross_attention: unknown map input \(this version knows \['first_layer_table', 'key_norm', "
        r"'residual', 'token_tables'\]\); a map input defined outside the library registers itself when its module "
        r"is imported \(register_map_input\): import that module first; else upgrade hf-kvtransfer"),
    "a setting an input does not know": (
        NESTED, lambda c: c["map_inputs"]["residual"].update(window=8),
        r"map_inputs.residual.window: unknown setting of this input"),
    "too few exact layers for the residual": (
        NESTED, lambda c: c.update(num_exact_layers=1),
        r"map_inputs.residual.layer = 1 needs num_exact_layers >= 2 .*, got 1"),
    "token readers outside the target's layers": (
        NESTED, lambda c: c["map_inputs"]["token_tables"].update(readers=[2, 3]),
        r"map_inputs.token_tables.readers must be ascending distinct target layers in \[0, 3\), got \[2, 3\]"),
    "residual readers at or before the residual's layer": (
        NESTED, lambda c: c["map_inputs"]["residual"].update(readers=[1, 2]),
        r"map_inputs.residual.readers must be ascending distinct target layers in \(1, 3\), got \[1, 2\]"),
    "a key norm without the residual": (
        NESTED, lambda c: c["map_inputs"].pop("residual"),
        r"map_inputs.key_norm needs a 'ridge' mapper reading the target's residual"),
    "the residual held in tables that do not hold it": (
        NESTED, lambda c: c["map_inputs"]["residual"].update(in_tables=True),
        r"map_inputs.residual.in_tables needs layer 0"),
    "a flat (older) config with residual readers before its layer": (
        FLAT, lambda c: c.update(residual_readers=[0]),
        r"map_inputs.residual.readers must be ascending distinct target layers in \(1, 3\), got \[0\]"),
    "a flat (older) config with token lags but no readers": (
        FLAT, lambda c: c.update(token_readers=None),
        r"map_inputs.token_tables.readers is missing \(this input needs lags, readers\)"),
}


@pytest.mark.parametrize("what", REFUSALS)
def test_a_saved_config_that_contradicts_itself_is_refused_in_one_line(what, tmp_path):
    source, change, expected = REFUSALS[what]
    with pytest.raises(ValueError, match=expected) as refused:
        KVMapper.from_pretrained(_tampered(tmp_path, source, change))
    assert "\n" not in str(refused.value)
