"""The map-input interface (`core/map_inputs.py`): an input added in its own class, registered, is applied by the
conversion with no other change; the library's inputs are registered in the order they must apply."""

from __future__ import annotations

import torch

from conftest import exact_identity_mapper, random_ids
from hf_kvtransfer import TransferredCache, prefill
from hf_kvtransfer.core import map_inputs
from hf_kvtransfer.core.map_inputs import MapInput


class ValueShift(MapInput):
    """A toy input: adds the prompt's position index to target layer 1's values (no RoPE on values, so the change is
    visible as is)."""

    name, order = "value_shift", 15

    @staticmethod
    def used_by(config) -> bool:
        return True

    @property
    def readers(self) -> list[int]:
        return [1]

    def from_ids(self, input_ids, attention_mask):
        return torch.arange(input_ids.shape[1], dtype=torch.float32).expand(input_ids.shape[0], -1)  # (B, T)

    def apply(self, state, group, rows):
        width = self.mapper.target_layout.layer_dim
        for i, _ in self.group_readers(group):
            rows[1][..., i * width : (i + 1) * width] += self.require(state).unsqueeze(-1).to(rows[1].dtype)
        return rows


def test_a_registered_input_is_applied_without_any_other_change(qwen3_model, monkeypatch):
    mapper = exact_identity_mapper(qwen3_model)
    ids = random_ids(2, 12, seed=3)
    plain = TransferredCache(prefill(qwen3_model, ids), mapper, num_recompute_tokens=1, num_exact_layers=0).convert_all()
    monkeypatch.setitem(map_inputs.MAP_INPUTS, ValueShift.name, ValueShift)
    assert [type(inp) for inp in mapper.map_inputs] == [ValueShift]
    shifted = TransferredCache(prefill(qwen3_model, ids), mapper, num_recompute_tokens=1, num_exact_layers=0).convert_all()
    positions = torch.arange(11, dtype=torch.float32).view(1, 1, 11, 1)
    for t, (a, b) in enumerate(zip(plain.layers, shifted.layers)):
        torch.testing.assert_close(b.keys, a.keys)
        torch.testing.assert_close(b.values, a.values + (positions if t == 1 else 0))
    # Its state follows the cache's batch operations like the source's K/V (here: beams repeat each row).
    cache = TransferredCache(prefill(qwen3_model, ids), mapper, num_recompute_tokens=1, num_exact_layers=0)
    cache.batch_repeat_interleave(2)
    assert cache._transfer.inputs["value_shift"].shape == (4, 11)


def test_the_library_inputs_apply_additions_before_the_key_norm():
    order = [cls.name for cls in map_inputs.registered_map_inputs()]
    assert order == ["residual", "token_tables", "key_norm"]
