"""Does a request the target engine serves without a transfer ever read a transfer's blocks from the prefix cache?

With prefix caching on (vLLM's default): the source engine stores `--prompts` [A | B | A] prompts; the target
engine (the connector as `kv_consumer`) serves each prompt plus a few new tokens as a transfer, then the same
requests again (a second transfer: what it reuses), then the store is emptied and the same requests are sent once
more, now plain requests. A plain engine (no connector) serves them too. For the plain requests after the
transfers: how many read cached tokens, and whether their greedy tokens and first-token log-probabilities equal
the plain engine's. Prints a summary and writes JSON.

Run in the vLLM environment (`.ci/vllm` builds `.venv-vllm`):

    OMP_WAIT_POLICY=PASSIVE .venv-vllm/bin/python research/vllm_serving/prefix_isolation.py --mapper mappers/s2l

`PYTHONPATH=<another checkout>` runs another version of the connector (one without per-request statuses reports
none).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _engine(model: Path, kv=None):
    from vllm import LLM

    return LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
               distributed_executor_backend="uni", kv_transfer_config=kv)  # fmt: skip


def _close(llm) -> None:
    import gc

    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def _serve(llm, requests: list[list[int]], new_tokens: int) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, logprobs=5, ignore_eos=True)
    rows = []
    for ids in requests:  # one at a time, as a router hands them off
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        first = {int(t): lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}
        rows.append({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0,
                     "first_logprobs": first, "status": (out.kv_transfer_params or {}).get("hf_kvtransfer")})  # fmt: skip
    return rows


def _prompts(family: Path, count: int, span: int, new: int) -> tuple[list[list[int]], list[list[int]]]:
    """`count` [A | B | A] prompts of spans of `span` tokens from heldout.txt, and each with `new` tokens more."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(family / "large")((family / "heldout.txt").read_text()).input_ids
    stride = 2 * span + new
    if count * stride > len(ids):
        raise SystemExit(f"heldout.txt has {len(ids)} tokens: not enough for {count} prompts of {stride}")
    prompts, requests = [], []
    for i in range(count):
        a, b = ids[i * stride : i * stride + span], ids[i * stride + span : i * stride + 2 * span]
        prompts.append(a + b + a)
        requests.append(a + b + a + ids[i * stride + 2 * span : (i + 1) * stride])
    return prompts, requests


def _compare(rows: list[dict], plain: list[dict]) -> dict:
    deltas = [max(abs(r["first_logprobs"][t] - lp) for t, lp in p["first_logprobs"].items() if t in r["first_logprobs"])
              for r, p in zip(rows, plain)]  # fmt: skip
    return {
        "requests": len(rows),
        "requests_with_cached_tokens": sum(r["cached"] > 0 for r in rows),
        "cached_tokens": sum(r["cached"] for r in rows),
        "greedy_tokens_equal_plain_engine": sum(r["tokens"] == p["tokens"] for r, p in zip(rows, plain)),
        "max_abs_first_token_logprob_diff": max(deltas),
    }


def _statuses(rows: list[dict]) -> dict:
    out: dict[str, int] = {}
    for row in rows:
        key = "none" if row["status"] is None else row["status"]["status"]
        out[key] = out.get(key, 0) + 1
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mapper", required=True, help="small -> large mapper directory")
    parser.add_argument("--family", default=str(ROOT / "examples" / "family"))
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--span", type=int, default=96, help="tokens of A and of B")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens after the stored prompt, and generated")
    parser.add_argument("--output", default=str(ROOT / "research/vllm_serving/results/prefix_isolation.json"))
    args = parser.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm.config import KVTransferConfig

    import hf_kvtransfer

    family, store = Path(args.family), Path(tempfile.mkdtemp(prefix="prefix_isolation_"))

    def connector(role, **extra):
        return KVTransferConfig(kv_connector="HFKVTransferConnector", kv_role=role, kv_load_failure_policy="recompute",
                                kv_connector_module_path="hf_kvtransfer.integrations.vllm_connector",
                                kv_connector_extra_config={"store": str(store), **extra})  # fmt: skip

    prompts, requests = _prompts(family, args.prompts, args.span, args.new_tokens)
    source = _engine(family / "small", connector("kv_producer"))
    _serve(source, prompts, 1)  # stores each prompt's KV
    _close(source)
    target = _engine(family / "large", connector("kv_consumer", mapper=args.mapper))  # prefix caching: vLLM's default
    first = _serve(target, requests, args.new_tokens)
    second = _serve(target, requests, args.new_tokens)
    shutil.rmtree(store)  # the store emptied: the same requests are now plain requests
    after = _serve(target, requests, args.new_tokens)
    _close(target)
    plain_engine = _engine(family / "large")
    plain = _serve(plain_engine, requests, args.new_tokens)
    _close(plain_engine)

    reused = [r["status"]["reused_tokens"] for r in second if r["status"]]
    result = {
        "connector": str(Path(hf_kvtransfer.__file__).parent),
        "mapper": args.mapper, "prompts": args.prompts, "prompt_tokens": 3 * args.span,
        "request_tokens": 3 * args.span + args.new_tokens,
        "first_transfer": {"cached_tokens": sum(r["cached"] for r in first), "statuses": _statuses(first)},
        "second_transfer": {"cached_tokens": sum(r["cached"] for r in second), "statuses": _statuses(second),
                            "reused_tokens": sum(reused) if reused else None},
        "plain_after_transfers": {**_compare(after, plain), "statuses": _statuses(after)},
    }  # fmt: skip
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(json.dumps(result, indent=2, sort_keys=True))
    return result


if __name__ == "__main__":
    main()
