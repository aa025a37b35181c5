"""What the vLLM connector keeps and saves: recall and hand-off retention through a real target engine, parity with
`TransferredCache` in transformers, and time to first token, on the bundled family.

Question: at the connector's defaults (the mapper's exact layers computed by the target, the library's recomputed
tokens), does the target engine answer from a handed-off context as well as it does from its own prefill, and as
transformers does on `TransferredCache` with the same mapper? How much time to first token does it save?

Per item (the library's `passage_recall_items` / `handoff_items` on heldout.txt, the same as `hf-kvtransfer eval`):

1. the source engine (small, connector `kv_producer`) reads each recall prompt, and answers each hand-off item's
   question 1 greedily (its prompt and answer stored);
2. the target engine (large) with the connector answers: recall from the prompt, hand-off question 2 from the
   dialogue (prompt, the source's answer, the follow-up);
3. the same target engine without the connector: its own prefill (`own`) and the context-free floor
   (`no_context`: the prompt without the passage / the follow-up alone);
4. transformers, float32: the large model on `TransferredCache(small's cache, mapper)` at the same settings
   (`transformers`), and the large model's own prefill in bfloat16 (the numeric reference: how often a change of
   arithmetic alone flips the greedy answer).

Right = greedy exact match of the answer tokens. Retention = (connector - no_context) / (own - no_context), with a
paired bootstrap CI. Engines run one at a time, each request alone (so TTFT is one request's); TTFT is vLLM's
per-request `first_token_latency`, median over the items.

Run (fit the mapper in the main environment; then the engines in the vLLM one):

    hf-kvtransfer fit --source examples/family/small --target examples/family/large \\
        --dataset examples/family/calibration.txt --output mappers/s2l
    OMP_NUM_THREADS=1 .venv-vllm/bin/python research/vllm_serving/vllm_serving.py --mapper mappers/s2l --items 200
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _connector(role: str, store: str, **extra):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="HFKVTransferConnector", kv_role=role,
                            kv_connector_module_path="hf_kvtransfer.integrations.vllm_connector",
                            kv_connector_extra_config={"store": store, **extra})  # fmt: skip


def _engine(model: Path, kv=None, max_model_len: int = 2048, compiled: bool = False):
    from vllm import LLM

    return LLM(model=str(model), dtype="float32", enforce_eager=not compiled, max_model_len=max_model_len, seed=0,
               distributed_executor_backend="uni", enable_prefix_caching=False, disable_log_stats=False,
               kv_transfer_config=kv)  # fmt: skip


def _close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def _answer(llm, ids: list[int], n: int) -> dict:
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": list(ids)}], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]  # fmt: skip
    ttft = getattr(getattr(out, "metrics", None), "first_token_latency", None)
    return {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0, "ttft": ttft}


def _transformers_answers(mapper_dir: str, family: Path, recall, handoff, answers1, extra: dict) -> dict:
    """Greedy answers of transformers' large model on TransferredCache (float32) and of its own prefill in bf16."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_kvtransfer import KVMapper, TransferredCache, resolve_num_recompute_tokens

    small = AutoModelForCausalLM.from_pretrained(family / "small", dtype=torch.float32).eval()
    large = AutoModelForCausalLM.from_pretrained(family / "large", dtype=torch.float32).eval()
    large_bf16 = AutoModelForCausalLM.from_pretrained(family / "large", dtype=torch.bfloat16).eval()
    mapper = KVMapper.from_pretrained(mapper_dir)
    num_exact = extra.get("num_exact_layers")
    if extra.get("allow_lossy") and num_exact is None:
        num_exact = 0

    @torch.no_grad()
    def greedy(model, ids, n, cache=None, start=0):
        feed, out = torch.tensor([ids[start:]]), []
        positions = torch.arange(start, len(ids)).unsqueeze(0)
        for _ in range(n):
            logits = model(feed, past_key_values=cache, position_ids=positions, use_cache=True)
            cache = logits.past_key_values
            token = int(logits.logits[0, -1].argmax())
            out.append(token)
            feed, positions = torch.tensor([[token]]), positions[:, -1:] + 1
        return out

    @torch.no_grad()
    def transferred(context, ids, n):
        src = small(torch.tensor([context]), use_cache=True).past_key_values
        r = resolve_num_recompute_tokens(extra.get("num_recompute_tokens"), len(context))
        cache = TransferredCache(src, mapper, num_recompute_tokens=r, input_ids=torch.tensor([context]),
                                 num_exact_layers=num_exact, model=large)  # fmt: skip
        return greedy(large, ids, n, cache, start=len(context) - r)

    out = {"recall": {"transformers": [], "bf16": []}, "handoff": {"transformers": [], "bf16": []}}
    for item in recall:
        n = len(item.answer_ids)
        out["recall"]["transformers"].append(transferred(item.prompt_ids, item.prompt_ids, n))
        out["recall"]["bf16"].append(greedy(large_bf16, item.prompt_ids, n))
    for item, a1 in zip(handoff, answers1):
        dialogue = item.prompt_ids + a1 + item.followup_ids
        n = len(item.answer2_ids)
        # The engine's source stored the prompt (+ the answer but its last token): the context handed off.
        context = item.prompt_ids + a1[:-1]
        out["handoff"]["transformers"].append(transferred(context, dialogue, n))
        out["handoff"]["bf16"].append(greedy(large_bf16, dialogue, n))
    return out


def _mapper_summary(mapper_dir: str, num_exact_layers: int | None, allow_lossy: bool) -> dict:
    """What the connector's transfers computed with this mapper: its exact layers (0 when every layer is mapped on
    purpose), their window, and what the other layers' maps read."""
    from hf_kvtransfer import KVMapper
    from hf_kvtransfer.core.map_inputs import maps_read

    mapper = KVMapper.from_pretrained(mapper_dir)
    exact = 0 if allow_lossy and num_exact_layers is None else mapper.resolve_num_exact_layers(num_exact_layers)
    return {"num_exact_layers": exact, "num_target_layers": len(mapper.layers), "exact_window": mapper.config.exact_window,
            "maps_read": maps_read(mapper.config, exact)}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mapper", required=True, help="small -> large mapper directory")
    parser.add_argument("--family", default=str(ROOT / "examples" / "family"))
    parser.add_argument("--items", type=int, default=200, help="recall items and hand-off items (each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-recompute-tokens", type=int, help="connector option (default: the library's)")
    parser.add_argument("--num-exact-layers", type=int, help="connector option (default: the mapper's)")
    parser.add_argument("--allow-lossy", action="store_true", help="connector option: map every layer")
    parser.add_argument("--skip-transformers", action="store_true", help="no transformers parity / bf16 reference")
    parser.add_argument("--output", default=str(ROOT / "research" / "vllm_serving" / "results" / "result.json"))
    args = parser.parse_args(argv)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import numpy as np
    from transformers import AutoTokenizer

    from hf_kvtransfer.evaluation.evaluate import split_documents
    from hf_kvtransfer.evaluation.metrics import mean_and_ci, retention_over_items
    from hf_kvtransfer.evaluation.tasks import handoff_items, passage_recall_items

    family = Path(args.family)
    tokenizer = AutoTokenizer.from_pretrained(family / "large")
    documents = split_documents((family / "heldout.txt").read_text(), getattr(tokenizer, "eos_token", None))
    recall = passage_recall_items(tokenizer, args.items, seed=args.seed, distractor_texts=documents)
    handoff = handoff_items(tokenizer, args.items, seed=args.seed, distractor_texts=documents)
    extra = {k: v for k, v in (("num_recompute_tokens", args.num_recompute_tokens),
                               ("num_exact_layers", args.num_exact_layers),
                               ("allow_lossy", args.allow_lossy or None)) if v is not None}  # fmt: skip
    store = tempfile.mkdtemp(prefix="vllm_serving_store_")
    started = time.perf_counter()

    llm = _engine(family / "small", _connector("kv_producer", store))
    for item in recall:
        _answer(llm, item.prompt_ids, 1)
    answers1 = [_answer(llm, item.prompt_ids, len(item.answer1_ids))["tokens"] for item in handoff]
    _answer(llm, recall[0].prompt_ids, 1)  # one more step: replies that ended last are stored
    _close(llm)

    runs = {}
    for name, kv in (("connector", _connector("kv_consumer", store, mapper=args.mapper, **extra)), ("own", None)):
        llm = _engine(family / "large", kv)
        _answer(llm, recall[0].no_passage_prompt_ids, 1)  # warm-up
        runs[name] = {
            "recall": [_answer(llm, it.prompt_ids, len(it.answer_ids)) for it in recall],
            "handoff": [_answer(llm, it.prompt_ids + a1 + it.followup_ids, len(it.answer2_ids))
                        for it, a1 in zip(handoff, answers1)],
        }  # fmt: skip
        if name == "own":
            runs["no_context"] = {
                "recall": [_answer(llm, it.no_passage_prompt_ids, len(it.answer_ids)) for it in recall],
                "handoff": [_answer(llm, it.followup_ids, len(it.answer2_ids)) for it in handoff],
            }
        _close(llm)
    engine_seconds = time.perf_counter() - started
    reference = None if args.skip_transformers else _transformers_answers(args.mapper, family, recall, handoff,
                                                                          answers1, extra)  # fmt: skip

    result = {"items": args.items, "connector_options": extra, "engine_seconds": round(engine_seconds, 1),
              "mapper": _mapper_summary(args.mapper, args.num_exact_layers, args.allow_lossy)}  # fmt: skip
    answers = {"recall": [it.answer_ids for it in recall], "handoff": [it.answer2_ids for it in handoff]}
    for task in ("recall", "handoff"):
        right = {name: np.array([r["tokens"] == list(a) for r, a in zip(runs[name][task], answers[task])], float)
                 for name in runs}  # fmt: skip
        row = {name: mean_and_ci(v) for name, v in right.items()}
        row.update(retention_over_items(right["own"], right["connector"], right["no_context"]))
        row["ttft_ms"] = {name: 1e3 * statistics.median(r["ttft"] for r in runs[name][task] if r["ttft"])
                          for name in ("connector", "own")}  # fmt: skip
        row["cached_tokens_median"] = statistics.median(r["cached"] for r in runs["connector"][task])
        row["prompt_tokens_median"] = statistics.median(
            len(it.prompt_ids) if task == "recall" else len(it.prompt_ids) + len(a1) + len(it.followup_ids)
            for it, a1 in zip(recall if task == "recall" else handoff, answers1 if task == "handoff" else [[]] * len(recall))
        )  # fmt: skip
        if reference is not None:
            ref = reference[task]
            engine = [r["tokens"] for r in runs["connector"][task]]
            own = [r["tokens"] for r in runs["own"][task]]
            row["transformers"] = mean_and_ci(np.array([t == list(a) for t, a in zip(ref["transformers"], answers[task])], float))
            row["connector_equals_transformers"] = mean_and_ci(np.array([a == b for a, b in zip(engine, ref["transformers"])], float))
            row["own_equals_bf16_own"] = mean_and_ci(np.array([a == b for a, b in zip(own, ref["bf16"])], float))
        if task == "handoff":
            row["q1_source_accuracy"] = float(np.mean([a == list(it.answer1_ids) for a, it in zip(answers1, handoff)]))
        result[task] = row
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2, sort_keys=True))
    for task in ("recall", "handoff"):
        row = result[task]
        acc = {k: f"{100 * row[k]['mean']:.1f}%" for k in ("own", "connector", "no_context")}
        ret = row.get("retention")
        ci = row.get("retention_ci")
        line = (f"{task}: accuracy own {acc['own']}, through the connector {acc['connector']}, no context "
                f"{acc['no_context']}; retention {100 * ret:.1f}%" if ret is not None else f"{task}: {acc}")  # fmt: skip
        if ci:
            line += f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"
        line += f"; TTFT {row['ttft_ms']['connector']:.1f} ms vs own {row['ttft_ms']['own']:.1f} ms"
        if "transformers" in row:
            line += (f"; transformers on TransferredCache {100 * row['transformers']['mean']:.1f}%, same greedy answer "
                     f"as the connector {100 * row['connector_equals_transformers']['mean']:.1f}%, own fp32 vs bf16 "
                     f"{100 * row['own_equals_bf16_own']['mean']:.1f}%")  # fmt: skip
        print(line)
    print(f"written: {args.output}")
    return result


if __name__ == "__main__":
    main()
