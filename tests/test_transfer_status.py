"""What the vLLM connector tells the caller per request, and the identity checks it runs at start-up
(`integrations/transfer_status.py`, `integrations/served_identity.py`): no vLLM. The connector's use of them in
real engines is in `tests/test_vllm_connector.py` (marked `vllm`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hf_kvtransfer.integrations import transfer_status as ts
from hf_kvtransfer.integrations.served_identity import (
    IdentityError,
    ServedModel,
    check_served_target,
    model_name,
    stored_by_other_source,
)


def test_a_fallback_moves_every_token_to_the_engine():
    record = ts.RequestTransfer(ts.APPLIED, matched_tokens=200, mapped_tokens=40, reused_tokens=128,
                                recomputed_tokens=72)  # fmt: skip
    record.fall_back(ts.ENTRY_CORRUPTED)
    assert record.as_params({"mapper": "m"}) == {"status": "fallback", "reason": ts.ENTRY_CORRUPTED,
                                                 "matched_tokens": 200, "mapped_tokens": 0, "reused_tokens": 0,
                                                 "recomputed_tokens": 240}  # fmt: skip
    counts = ts.StatusCounts()
    counts.add(record)
    counts.add(ts.RequestTransfer(ts.APPLIED))
    assert counts == {"fallback": 1, f"fallback: {ts.ENTRY_CORRUPTED}": 1, "applied": 1}


def test_applied_names_the_mapper():
    params = ts.RequestTransfer(ts.APPLIED, matched_tokens=10).as_params({"mapper": "org/m", "num_exact_layers": 2})
    assert params["mapper"] == "org/m" and params["num_exact_layers"] == 2 and "reason" not in params


def test_salt_is_one_namespace_per_mapper_and_settings_and_keeps_the_callers():
    a = ts.transfer_salt("org/m", None, 2, None)
    assert a == ts.transfer_salt("org/m", None, 2, None)
    assert len({a, ts.transfer_salt("org/m", "v2", 2, None), ts.transfer_salt("org/m", None, 3, None),
                ts.transfer_salt("org/m", None, 2, 8), ts.transfer_salt("org/n", None, 2, None)}) == 5  # fmt: skip
    assert ts.salted(None, a) == a and ts.salted("tenant-7", a) == f"tenant-7|{a}"


def test_requests_the_connector_does_not_transfer():
    plain = dict(lora_request=None, mm_features=None, prompt_embeds=None, skip_reading_prefix_cache=False)
    assert ts.unsupported_reason(SimpleNamespace(**plain)) is None
    for field, value, word in (("lora_request", object(), "LoRA"), ("mm_features", [object()], "multimodal"),
                               ("prompt_embeds", object(), "embeddings"),
                               ("skip_reading_prefix_cache", True, "prompt_logprobs")):  # fmt: skip
        assert word in ts.unsupported_reason(SimpleNamespace(**{**plain, field: value}))
    assert ts.transfer_requested(None) and ts.transfer_requested({"do_remote_prefill": True})
    assert not ts.transfer_requested({"hf_kvtransfer": {"transfer": False}})


def _mapper(target="Qwen/Qwen3-1.7B", revision=None, source="Qwen/Qwen3-0.6B"):
    return SimpleNamespace(target_model_id=target, target_revision=revision, source_model_id=source)


@pytest.mark.parametrize("given, name", [
    ("Qwen/Qwen3-1.7B", "qwen3-1.7b"), ("/models/Qwen3-1.7B/", "qwen3-1.7b"), ("examples/family/large", "large"),
    ("/hf/hub/models--Qwen--Qwen3-1.7B/snapshots/0123abcd", "qwen3-1.7b"), (None, None),
])  # fmt: skip
def test_model_names_compare_across_forms(given, name):
    assert model_name(given) == name


def test_served_target_identity():
    served = ServedModel("/hf/hub/models--Qwen--Qwen3-1.7B/snapshots/abc", None, num_key_value_heads=8)
    assert check_served_target(_mapper(), served, "m") is None
    with pytest.raises(IdentityError, match=r"serves 'Qwen/Qwen3-4B'.*served_model_id"):
        check_served_target(_mapper(), ServedModel("Qwen/Qwen3-4B", None, 8), "m")
    # a local copy declared to be the mapper's target
    copy = ServedModel("/data/ckpt", None, 8)
    assert check_served_target(_mapper(), copy, "m", served_model_id="Qwen/Qwen3-1.7B") is None
    assert check_served_target(_mapper(target=None), ServedModel("/data/ckpt", None, 8), "m") is None  # unknown
    with pytest.raises(IdentityError, match="tensor_parallel_size"):
        check_served_target(_mapper(), ServedModel("Qwen/Qwen3-1.7B", None, 8, tensor_parallel_size=3), "m")
    assert check_served_target(_mapper(), ServedModel("Qwen/Qwen3-1.7B", None, 2, tensor_parallel_size=4), "m") is None


def test_revision_mismatch_warns_unless_silenced():
    served = ServedModel("Qwen/Qwen3-1.7B", "main", 8)
    warning = check_served_target(_mapper(revision="abc123"), served, "m")
    assert "'abc123'" in warning and "'main'" in warning and "warn_revision_mismatch" in warning
    assert check_served_target(_mapper(revision="abc123"), served, "m", warn_revision_mismatch=False) is None
    assert check_served_target(_mapper(revision="main"), served, "m") is None


def test_store_entries_of_another_source_are_named():
    assert stored_by_other_source(_mapper(), "/models/Qwen3-0.6B") is None
    assert stored_by_other_source(_mapper(), None) is None
    assert "Qwen/Qwen3-4B" in stored_by_other_source(_mapper(), "Qwen/Qwen3-4B")
