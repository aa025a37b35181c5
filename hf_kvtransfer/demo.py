"""The README's first command: move a prompt's cache from a small model to a large one and show what changes.

Offline with `family=` (a directory of small/large checkpoints and texts, like the trained Qwen3 family the
repository ships); with Hub ids (or local paths) for `source` / `target` / `mapper`, the same run on real models.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from .cache import TransferredCache
from .capture import prefill
from .evaluate import prefix_perplexity, split_documents, text_windows
from .fit import fit_mapper
from .mapper import KVMapper
from .models import load_pair
from .timing import median_ms, time_call

logger = logging.getLogger(__name__)

FAMILY_ENV = "HF_KVTRANSFER_FAMILY"
DEFAULT_PROMPT_TOKENS = 192


def find_family(path: str | os.PathLike | None = None) -> Path:
    """Locate a model family directory (`small/` and `large/` checkpoints, `calibration.txt`, `heldout.txt`):
    `path`, else `$HF_KVTRANSFER_FAMILY`.

    Raises:
        FileNotFoundError: with how to point at one (the repository ships a trained family; the wheel does not).
    """
    candidate = path or os.environ.get(FAMILY_ENV)
    if candidate and all((Path(candidate) / name / "model.safetensors").is_file() for name in ("small", "large")):
        return Path(candidate)
    where = f"{candidate} has no small/ and large/ checkpoints" if candidate else "no family directory given"
    raise FileNotFoundError(
        f"{where}: point --family (or ${FAMILY_ENV}) at a model family directory (small/ and large/ with "
        "model.safetensors, calibration.txt, heldout.txt; the git repository ships one), or pass --source/--target "
        "model ids"
    )


def time_transfer(source, target, mapper: KVMapper, input_ids: torch.Tensor, repeats: int = 3) -> dict[str, float]:
    """Median milliseconds of the mapping (strip + map + re-rope, all layers) vs the target's own prefill."""
    src_cache = prefill(source, input_ids.to(next(source.parameters()).device))
    device = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    # one warm-up call: first-call allocations and kernel selection are not what a server pays per request
    mapping = median_ms(time_call(
        lambda: TransferredCache(src_cache, mapper, num_recompute_tokens=0).convert_all(device=device, dtype=dtype),
        device, repeats,
    )[0])  # fmt: skip
    own = median_ms(time_call(lambda: prefill(target, input_ids.to(device)), device, repeats)[0])
    return {"num_tokens": int(input_ids.shape[-1]), "mapping_ms": mapping, "target_prefill_ms": own, "speedup": own / mapping}


def run_demo(
    source: str | None = None,
    target: str | None = None,
    mapper: str | KVMapper | None = None,
    *,
    family: str | os.PathLike | None = None,
    prompt: str | None = None,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    max_new_tokens: int = 32,
    calibration: str | os.PathLike | None = None,
    num_sequences: int = 64,
    seq_len: int = 256,
    top_k: int | str = 4,
    text: str | os.PathLike | None = None,
    eval_windows: int = 48,
    timing_tokens: int = 512,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> dict[str, Any]:
    """Transfer a prompt's cache source -> target, generate through it, and measure against the target's own run.

    With no model ids, uses the bundled family (`small` -> `large`), fits a mapper on its `calibration.txt`
    and measures retention on its `heldout.txt`.

    Returns:
        A dict with `prompt`, `transfer_text`, `target_text`, `same_tokens`, `retention` (the quick
        prefix-perplexity run of `evaluate.prefix_perplexity`, or None without text), `timing`, `fit_seconds`.
    """
    if (source is None) != (target is None):
        raise ValueError("pass both --source and --target (or neither, for the bundled family)")
    if source is None:
        root = find_family(family)
        source, target = str(root / "small"), str(root / "large")
        calibration = calibration or root / "calibration.txt"
        text = text or root / "heldout.txt"
    src_model, tgt_model, tokenizer = load_pair(source, target, device)
    result: dict[str, Any] = {"source": source, "target": target}

    start = time.perf_counter()
    if isinstance(mapper, KVMapper):
        kv_mapper = mapper
    elif mapper is not None:
        kv_mapper = KVMapper.from_pretrained(mapper)
    else:
        if calibration is None:
            raise ValueError("with --source/--target, pass --mapper (a fitted mapper) or --calibration FILE to fit one")
        # all sequences fit the mapper (no held-out shard: the retention below is measured on other text)
        kv_mapper = fit_mapper(
            src_model, tgt_model, calibration, tokenizer=tokenizer, num_sequences=num_sequences, seq_len=seq_len,
            top_k=top_k, heldout_fraction=0, progress=progress,
        )  # fmt: skip
    kv_mapper.check_compatible(src_model.config, tgt_model.config)
    result["fit_seconds"] = time.perf_counter() - start
    result["mapper"] = {"top_k": kv_mapper.config.top_k, "ridge_lambda": kv_mapper.config.ridge_lambda,
                        "calibration_tokens": kv_mapper.config.calibration.get("num_tokens")}

    docs = split_documents(Path(text).read_text(encoding="utf-8"), tokenizer.eos_token) if text else []
    if prompt is None:
        if not docs:
            raise ValueError("pass --prompt TEXT (or --text FILE to take a prompt from)")
        prompt_ids = tokenizer(docs[0], add_special_tokens=False)["input_ids"][:prompt_tokens]
    else:
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    input_ids = torch.tensor([prompt_ids], device=device)
    result["prompt"] = tokenizer.decode(prompt_ids)
    result["prompt_tokens"] = len(prompt_ids)

    gen = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
               pad_token_id=tokenizer.eos_token_id)
    with torch.no_grad():
        mask = torch.ones_like(input_ids)
        cache = TransferredCache(prefill(src_model, input_ids), kv_mapper)
        transfer = tgt_model.generate(input_ids, attention_mask=mask, cache=cache, **gen)[0, input_ids.shape[1] :]
        own = tgt_model.generate(input_ids, attention_mask=mask, **gen)[0, input_ids.shape[1] :]
    result["transfer_text"] = tokenizer.decode(transfer)
    result["target_text"] = tokenizer.decode(own)
    same = 0
    while same < min(len(transfer), len(own)) and transfer[same] == own[same]:
        same += 1
    result["same_tokens"] = {"prefix": same, "total": int((transfer == own).sum()), "of": len(own)}

    result["retention"] = None
    token_docs = [tokenizer(d, add_special_tokens=False, verbose=False)["input_ids"] for d in docs]
    if token_docs and eval_windows > 0:
        windows = text_windows(token_docs, 256, eval_windows)
        result["retention"] = prefix_perplexity(
            src_model, tgt_model, kv_mapper, windows.to(device), diagnostics=True, progress=progress
        )
    # Timing on a longer context than the prompt, where prefill cost dominates fixed overheads.
    stream = [t for d in token_docs for t in d] or prompt_ids
    timing_ids = torch.tensor([(stream * (timing_tokens // len(stream) + 1))[:timing_tokens]])
    result["timing"] = time_transfer(src_model, tgt_model, kv_mapper, timing_ids)
    result["torch_threads"] = torch.get_num_threads()
    return result


def format_demo(result: dict[str, Any]) -> str:
    """The demo's report as text (the CLI prints it)."""
    def tail(text: str, n: int = 300) -> str:
        text = text.replace("\n", " / ")
        return text if len(text) <= n else "..." + text[-n:]

    same = result["same_tokens"]
    lines = [
        f"source: {result['source']}",
        f"target: {result['target']}",
        f"mapper: top_k={result['mapper']['top_k']} lambda={result['mapper']['ridge_lambda']} "
        f"({result['mapper']['calibration_tokens']} calibration tokens; ready in {result['fit_seconds']:.1f} s)",
        "",
        f"prompt ({result['prompt_tokens']} tokens): {tail(result['prompt'])}",
        "",
        f"target, own prefill        : {result['target_text'].replace(chr(10), ' / ')}",
        f"target, transferred cache  : {result['transfer_text'].replace(chr(10), ' / ')}",
        f"  same greedy tokens: first {same['prefix']} identical, {same['total']}/{same['of']} positions equal",
        "",
    ]
    ret = result.get("retention")
    if ret:
        ci = ret["normalized_retention_ci"]
        lines += [
            f"prefix-conditioned perplexity ({ret['num_windows']} held-out windows, T={ret['prefix_len']}): "
            f"own prefix {ret['perplexity']['target']:.3f} | transferred {ret['perplexity']['transfer']:.3f} | "
            f"no prefix {ret['perplexity']['floor']:.3f}",
            f"  retention {100 * ret['retention']:.2f}%, floor-normalized retention "
            f"{100 * ret['normalized_retention']:.1f}% (95% CI [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]), "
            f"top-1 agreement {100 * ret['top1_agreement']:.1f}%",
        ]
    else:
        lines.append("retention: not measured (pass --text FILE)")
    t = result["timing"]
    lines += [
        f"time for {t['num_tokens']} tokens: mapping {t['mapping_ms']:.1f} ms vs target prefill "
        f"{t['target_prefill_ms']:.1f} ms ({t['speedup']:.2f}x; median, {result['torch_threads']} CPU threads)",
    ]
    return "\n".join(lines)
