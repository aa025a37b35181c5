"""The vLLM connector on a CUDA GPU at a real shape: random-weight Qwen3-0.6B -> Qwen3-1.7B, bf16 (run by `.ci/gpu`).

Question: on GPU vLLM (CUDA kernels, bf16), does the target engine through the connector give the greedy tokens of
transformers on `TransferredCache` with the same mapper, within what bf16 alone changes, and how much time to
first token does the hand-off save at 1024 and 4096 tokens?

Weights are random (the shapes, not the content, set the costs); the mapper is random orthogonal with 1 exact layer
(no fit: its output is deterministic and position-sensitive, which is what a parity check needs). Prompts are random
token ids. Per prompt length: the source engine stores the prompt, the target engine answers through the connector
and without it (TTFT = vLLM's first_token_latency, median of 5 after a warm-up), and transformers on the GPU gives
(a) greedy tokens on `TransferredCache` in bf16, (b) its own prefill's greedy tokens in bf16 and in float32: (b)'s
agreement is the numeric reference a bf16 comparison can be held to.

    bash .ci/gpu           # or: python research/vllm_serving/gpu_check.py --lengths 1024 4096
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "hf_kvtransfer" / "commands" / "known_configs"


def _checkpoint(name: str, out: Path, seed: int) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads((CONFIGS / f"Qwen--{name}.json").read_text()))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    return out


def _mapper(source: Path, target: Path, out: Path) -> Path:
    import torch
    from transformers import AutoConfig

    from hf_kvtransfer import KVMapper, MapperConfig

    s, t = AutoConfig.from_pretrained(source), AutoConfig.from_pretrained(target)
    config = MapperConfig(source_config=s.to_dict(), target_config=t.to_dict(), num_exact_layers=1,
                          selected_layers=[[i * s.num_hidden_layers // t.num_hidden_layers]
                                           for i in range(t.num_hidden_layers)])  # fmt: skip
    mapper = KVMapper(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in mapper.layers:
            for proj in (layer.key, layer.value):
                w = torch.randn(proj.weight.shape, generator=g)
                q = torch.linalg.qr(w if w.shape[0] >= w.shape[1] else w.T)[0]
                proj.weight.copy_(q if w.shape[0] >= w.shape[1] else q.T)
                proj.bias.zero_()
    mapper.save_pretrained(out)
    return out


def _engine(model: Path, kv=None, max_model_len: int = 8192):
    from vllm import LLM

    return LLM(model=str(model), dtype="bfloat16", max_model_len=max_model_len, seed=0, skip_tokenizer_init=True,
               gpu_memory_utilization=0.3, enable_prefix_caching=False, disable_log_stats=False,
               kv_transfer_config=kv)  # fmt: skip


def _connector(role: str, store: str, **extra):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="HFKVTransferConnector", kv_role=role,
                            kv_connector_module_path="hf_kvtransfer.integrations.vllm_connector",
                            kv_connector_extra_config={"store": store, **extra})  # fmt: skip


def _run(llm, prompts, n):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
    out = []
    for p in prompts:
        r = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
        out.append({"tokens": list(r.outputs[0].token_ids), "cached": r.num_cached_tokens or 0,
                    "ttft": getattr(r.metrics, "first_token_latency", None)})  # fmt: skip
    return out


def _close(llm):
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--output", default=str(ROOT / "research" / "vllm_serving" / "results" / "gpu.json"))
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from hf_kvtransfer import KVMapper, TransferredCache

    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    small = _checkpoint("Qwen3-0.6B", work / "small", 0)
    large = _checkpoint("Qwen3-1.7B", work / "large", 1)
    mapper_dir = _mapper(small, large, work / "mapper")
    vocab = json.loads((small / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    result = {"device": torch.cuda.get_device_name(0), "shapes": "Qwen3-0.6B -> Qwen3-1.7B (random weights, bf16)"}
    for length in args.lengths:
        prompts = [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(args.prompts + 1)]
        store = str(work / f"store{length}")
        llm = _engine(small, _connector("kv_producer", store))
        _run(llm, prompts, 1)
        _close(llm)
        runs = {}
        for name, kv in (("connector", _connector("kv_consumer", store, mapper=str(mapper_dir))), ("own", None)):
            llm = _engine(large, kv)
            runs[name] = _run(llm, prompts, args.new_tokens)[1:]  # the first warms up
            _close(llm)
        # transformers on the GPU: TransferredCache (bf16) and the target's own prefill in bf16 and float32
        dev = "cuda"
        src = AutoModelForCausalLM.from_pretrained(small, dtype=torch.bfloat16).to(dev).eval()
        tgt = AutoModelForCausalLM.from_pretrained(large, dtype=torch.bfloat16).to(dev).eval()
        mapper = KVMapper.from_pretrained(mapper_dir).to(dev)
        ref = {"transformers": [], "own_bf16": [], "own_fp32": []}
        with torch.no_grad():
            for p in prompts[1:]:
                ids = torch.tensor([p], device=dev)
                cache = src(ids, use_cache=True).past_key_values
                tc = TransferredCache(cache, mapper, input_ids=ids, model=tgt)
                out = tgt.generate(ids, past_key_values=tc, max_new_tokens=args.new_tokens, do_sample=False)
                ref["transformers"].append(out[0, length:].tolist())
                ref["own_bf16"].append(tgt.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)[0, length:].tolist())
            tgt32 = tgt.float()
            for p in prompts[1:]:
                ids = torch.tensor([p], device=dev)
                ref["own_fp32"].append(tgt32.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)[0, length:].tolist())
        del src, tgt, tgt32, mapper
        torch.cuda.empty_cache()

        def agree(a, b):  # leading greedy tokens equal, per prompt
            return [next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), len(u)) for u, v in zip(a, b)]

        conn = [r["tokens"] for r in runs["connector"]]
        result[str(length)] = {
            "ttft_ms": {k: 1e3 * statistics.median(r["ttft"] for r in runs[k] if r["ttft"]) for k in runs},
            "cached_tokens": [r["cached"] for r in runs["connector"]],
            "connector_vs_transformers_leading_equal": agree(conn, ref["transformers"]),
            "engine_own_vs_transformers_own_bf16_leading_equal": agree([r["tokens"] for r in runs["own"]], ref["own_bf16"]),
            "bf16_vs_fp32_own_leading_equal": agree(ref["own_bf16"], ref["own_fp32"]),
            "new_tokens": args.new_tokens,
        }
        print(length, json.dumps(result[str(length)]), flush=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2, sort_keys=True))
    print(f"written: {args.output}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
