"""Time to first token through the target engine: its own prefill vs the connector writing every layer's KV before
the forward vs layer-wise (`layerwise_load`: each layer's mapped KV written when its attention layer asks for it),
with the layers mapped in the forward's thread or ahead of it on a background thread (`map_ahead`).

Question: on a family's pair (default: the bundled small -> large), at 512, 1024 and 4096 prompt tokens, does
layer-wise loading change the target's time to first token against loading every layer before the forward, does
mapping ahead on a second core shorten it, and what do they save against the engine's own prefill?

Setup: a source engine (small, `kv_producer`) stores each prompt's KV; then one target engine (large, `kv_consumer`
with the mapper) serves every request, prefix caching off, each request alone (one greedy token):

- `own`: the request with the transfer turned off (`kv_transfer_params={"hf_kvtransfer": {"transfer": False}}`):
  the engine prefills the whole prompt;
- `at_once` / `layerwise` / `ahead`: the stored prompt transferred (all but the library's recomputed tokens reported
  as cached), with the worker-side connector's `layerwise_load` and `map_ahead` set between requests (off / on, off
  / on, on; one engine in one process: the same engine, weights and memory for the four).

The engine's forward runs on one thread; `ahead` maps on one more (the machine's second core).
Repeats are interleaved (each repeat runs every length, the four modes in one of their 24 orders in turn); TTFT
is vLLM's per-request `first_token_latency`, median over the repeats; ratios are of medians within this one process,
and per repeat (layer-wise and ahead over at once, run in the same repeat: robust to the machine's load drifting). One thread:
run with `OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE` (the script asks vLLM not to bind its own threads and records
the thread count torch uses). The load average when it starts and ends is recorded.

    hf-kvtransfer fit --source examples/family/small --target examples/family/large \\
        --dataset examples/family/calibration.txt --output DIR   # the default fit
    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE .venv-vllm/bin/python research/vllm_serving/layerwise_ttft.py --mapper DIR
    # the deep pair (24-layer target), with the mapper of its default fit (docs/results/deep-pair.md):
    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE .venv-vllm/bin/python research/vllm_serving/layerwise_ttft.py \
        --family examples/family_deep --source source --target target --mapper DIR \
        --output research/vllm_serving/results/layerwise_ttft_deep.json
    # the same with the target engine compiled (vLLM's default) instead of enforce_eager: --compiled
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from vllm_serving import _close, _connector, _engine

ROOT = Path(__file__).resolve().parents[2]
MODES = ("own", "at_once", "layerwise", "ahead")
ORDERS = list(itertools.permutations(MODES))  # each mode before and after each other as often


def _prompts(family: Path, target: str, lengths: list[int]) -> dict[int, list[int]]:
    """A distinct stretch of heldout.txt per length."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(family / target)((family / "heldout.txt").read_text()).input_ids
    out, start = {}, 0
    for n in lengths:
        if start + n > len(ids):
            raise ValueError(f"heldout.txt holds {len(ids)} tokens, too few for prompts of {lengths}")
        out[n], start = ids[start : start + n], start + n
    return out


class _LoadLog(logging.Handler):
    """Counts the connector's 'written at once' / 'written layer by layer' lines."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.counts = {"at once": 0, "layer by layer;": 0, "layer by layer, mapped ahead": 0}

    def emit(self, record):
        for how in self.counts:
            if f"written {how}" in record.getMessage():
                self.counts[how] += 1


def _request(llm, worker, prompt: list[int], mode: str) -> dict:
    from vllm import SamplingParams

    extra = {"kv_transfer_params": {"hf_kvtransfer": {"transfer": False}}} if mode == "own" else None
    if mode != "own":
        worker.layerwise_load = mode in ("layerwise", "ahead")
        worker.map_ahead = mode == "ahead"
    params = SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra)
    started, cpu_started = time.perf_counter(), time.process_time()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return {"ttft": out.metrics.first_token_latency, "wall": wall, "cpu": cpu, "cached": out.num_cached_tokens or 0,
            "token": out.outputs[0].token_ids[0]}  # fmt: skip


def _summary(samples: dict[str, list[dict]], length: int) -> dict:
    med = {m: 1e3 * statistics.median(r["ttft"] for r in samples[m]) for m in MODES}
    wall = {m: 1e3 * statistics.median(r["wall"] for r in samples[m]) for m in MODES}
    row = {
        "prompt_tokens": length,
        "cached_tokens": {m: samples[m][0]["cached"] for m in MODES},
        "ttft_ms_median": med,
        "wall_ms_median": wall,
        # Process CPU time over wall time of the whole request (all threads): above 1 where a second core worked.
        "cores_used_median": {m: statistics.median(r["cpu"] / r["wall"] for r in samples[m]) for m in MODES},
        "ratio_at_once_over_own": med["at_once"] / med["own"],
    }
    for m in ("layerwise", "ahead"):
        at_once, other = samples["at_once"], samples[m]
        row[f"ratio_{m}_over_own"] = med[m] / med["own"]
        row[f"ratio_{m}_over_at_once"] = med[m] / med["at_once"]
        # Per repeat, over at once (the two ran in the same repeat): robust to the machine's load drifting.
        row[f"paired_ratio_{m}_over_at_once_median"] = statistics.median(b["ttft"] / a["ttft"] for a, b in zip(at_once, other))
        row[f"{m}_faster_in_repeats"] = sum(b["ttft"] < a["ttft"] for a, b in zip(at_once, other))
        row[f"same_first_token_at_once_{m}"] = all(a["token"] == b["token"] for a, b in zip(at_once, other))
    row["ttft_ms"] = {m: [round(1e3 * r["ttft"], 3) for r in samples[m]] for m in MODES}
    return row  # fmt: skip


def _store_prompts(source: Path, store: str, prompts: dict[int, list[int]], max_len: int) -> None:
    llm = _engine(source, _connector("kv_producer", store), max_model_len=max_len)
    for prompt in prompts.values():
        llm.generate([{"prompt_token_ids": prompt}], use_tqdm=False)
    _close(llm)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mapper", required=True, help="source -> target mapper directory")
    parser.add_argument("--family", default=str(ROOT / "examples" / "family"))
    parser.add_argument("--source", default="small", help="the source model's folder in --family")
    parser.add_argument("--target", default="large", help="the target model's folder in --family")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=24)
    parser.add_argument("--compiled", action="store_true",
                        help="the target engine compiled (vLLM's default: torch.compile) instead of enforce_eager")
    parser.add_argument("--output", default=str(ROOT / "research" / "vllm_serving" / "results" / "layerwise_ttft.json"))
    args = parser.parse_args(argv)
    load_start, uptime_start = os.getloadavg(), subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    import vllm
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    family = Path(args.family)
    prompts = _prompts(family, args.target, args.lengths)
    max_len = max(args.lengths) + 64
    store = tempfile.mkdtemp(prefix="layerwise_ttft_store_")
    started = time.perf_counter()
    _store_prompts(family / args.source, store, prompts, max_len)
    llm = _engine(family / args.target, _connector("kv_consumer", store, mapper=args.mapper), max_model_len=max_len,
                  compiled=args.compiled)
    worker = get_kv_transfer_group()  # the worker-side connector (engine in this process)
    log = _LoadLog()
    logging.getLogger("hf_kvtransfer").addHandler(log)
    logging.getLogger("hf_kvtransfer").setLevel(logging.INFO)
    for n in args.lengths:  # warm-up: every mode once per length (and the attention seen calling wait_for_layer_load)
        for mode in MODES:
            _request(llm, worker, prompts[n], mode)
    log.counts = dict.fromkeys(log.counts, 0)
    samples = {n: {m: [] for m in MODES} for n in args.lengths}
    for r in range(args.repeats):
        for n in args.lengths:
            for mode in ORDERS[r % len(ORDERS)]:
                samples[n][mode].append(_request(llm, worker, prompts[n], mode))
    threads = torch.get_num_threads()
    num_exact = worker.num_exact_layers
    _close(llm)
    result = {
        "question": "TTFT of the target engine: own prefill vs the connector writing every layer first vs layer-wise, "
                    "mapped in the forward's thread or ahead on a background thread",
        "family": str(family), "source": args.source, "target": args.target, "mapper": args.mapper, "num_exact_layers": num_exact, "repeats": args.repeats,
        "target_engine": "compiled" if args.compiled else "enforce_eager",
        "loads_written": log.counts,  # measured requests (after the warm-up)
        "torch_threads": threads, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "date": date, "load_average_start": [round(x, 2) for x in load_start], "uptime_start": uptime_start,
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "vllm": vllm.__version__, "torch": torch.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "seconds": round(time.perf_counter() - started, 1),
        "lengths": [_summary(samples[n], n) for n in args.lengths],
    }  # fmt: skip
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"load average at start {result['load_average_start']}, torch threads {threads}; loads {log.counts}")
    for row in result["lengths"]:
        t = row["ttft_ms_median"]
        print(f"{row['prompt_tokens']:5d} tokens: TTFT own {t['own']:.1f} ms, at once {t['at_once']:.1f} ms, "
              f"layer-wise {t['layerwise']:.1f} ms, mapped ahead {t['ahead']:.1f} ms (over at once, per repeat: "
              f"layer-wise {row['paired_ratio_layerwise_over_at_once_median']:.3f}, ahead "
              f"{row['paired_ratio_ahead_over_at_once_median']:.3f}, ahead faster in {row['ahead_faster_in_repeats']}"
              f"/{len(row['ttft_ms']['own'])}; cores used at once {row['cores_used_median']['at_once']:.2f}, ahead "
              f"{row['cores_used_median']['ahead']:.2f})")  # fmt: skip
    print(f"written: {args.output}")
    return result


if __name__ == "__main__":
    main()
