"""What the vLLM connector tells the caller per request (`integrations/transfer_status.py`): no vLLM. The
connector's use of it in real engines is in `tests/test_vllm_connector.py` (marked `vllm`)."""

from __future__ import annotations

from types import SimpleNamespace

from hf_kvtransfer.integrations import transfer_status as ts


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
