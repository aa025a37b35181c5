"""The README's first command: move a prompt's cache from a small model to a large one and show what changes.

Offline with `family=` (a directory of small/large checkpoints and texts, like the trained Qwen3 family the
repository ships); with Hub ids (or local paths) for `source` / `target` / `mapper`, the same run on real models.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..core.cache import TransferredCache
from ..core.capture import cache_argument, prefill
from ..core.loading import load_pair
from ..core.map_inputs import maps_read
from ..core.mapper import KVMapper
from ..core.options import with_options
from ..evaluation.content import passage_recall
from ..evaluation.evaluate import split_documents
from ..evaluation.tasks import passage_recall_items
from ..evaluation.timing import time_to_first_token
from ..fitting.content_gate import tolerance_points
from ..fitting.fit import fit_mapper
from .demo_mapper import CHECKPOINT, keep_mapper, kept_mapper_dir, read_kept_mapper, writable

logger = logging.getLogger(__name__)

FAMILY_ENV = "HF_KVTRANSFER_FAMILY"
# Where the git repository keeps its trained family, relative to the repository root (the working directory).
REPO_FAMILY = Path("examples") / "family"
DEFAULT_RECALL_ITEMS = 200


# The pair directories a family holds, source first: the bundled family's, then the deep pair's.
FAMILY_LAYOUTS = (("small", "large"), ("source", "target"))


def family_pair(root: str | os.PathLike, needs: str = "model.safetensors") -> tuple[Path, Path] | None:
    """`(source, target)` checkpoint directories of the family at `root`, each holding the file `needs` (None: it
    holds neither layout)."""
    for names in FAMILY_LAYOUTS:
        if all((Path(root) / name / needs).is_file() for name in names):
            return Path(root) / names[0], Path(root) / names[1]
    return None


def find_family(path: str | os.PathLike | None = None) -> Path:
    """Locate a model family directory (`small/` and `large/` checkpoints, or `source/` and `target/`, with
    `calibration.txt` and `heldout.txt`): `path`, else `$HF_KVTRANSFER_FAMILY`, else `examples/family` when the
    working directory holds it (the repository root).

    Raises:
        FileNotFoundError: with how to point at one (the repository ships a trained family; the wheel does not).
    """
    candidate = path or os.environ.get(FAMILY_ENV) or (REPO_FAMILY if REPO_FAMILY.is_dir() else None)
    if candidate and family_pair(candidate) is not None:
        return Path(candidate)
    where = f"{candidate} has no small/ and large/ (or source/ and target/) checkpoints" if candidate else (
        f"no family directory given (and no {REPO_FAMILY} here)"
    )
    raise FileNotFoundError(
        f"{where}: point --family (or ${FAMILY_ENV}) at a model family directory (small/ and large/ with "
        "model.safetensors, calibration.txt, heldout.txt; the git repository ships examples/family and "
        "examples/family_deep), or pass --source/--target model ids"
    )


@dataclass(frozen=True)
class DemoConfig:
    """The options of `run_demo` (each one also accepted as a keyword of `run_demo`).

    Attributes:
        family: the model family directory used without model ids (`find_family`).
        prompt: the prompt whose cache is transferred; default a held-out passage-recall question drawn from `text`.
        max_new_tokens: tokens the target answers with (default: a recall answer and its closing quotes, else 32).
        calibration: the text a mapper is fitted on when none is given (the family's `calibration.txt`).
        num_sequences, seq_len: the fit's calibration sample.
        top_k: the fit's `top_k` (default `FitConfig`'s).
        num_exact_layers: `TransferredCache`'s: the target's first layers computed from the prompt's ids (default:
            the mapper's, which the fit chose with its content probe, `exact_layers.py`).
        text: held-out text the recall questions' distractors and the timing context are drawn from (the family's
            `heldout.txt`).
        recall_items: passage-recall questions behind the retention number (0 = skip).
        timing_tokens: context tokens of the time-to-first-token measurement.
        device: where the models run.
        progress: progress bars.
        exact_layers_items: the fit's option of that name (items per content probe; default `FitConfig`'s, 64):
            fewer make the fit faster and its choice less sure.
        refit: fit the mapper again even where an earlier demo kept one for the same models and options
            (`demo_mapper.py`).
    """

    family: str | os.PathLike | None = None
    prompt: str | None = None
    max_new_tokens: int | None = None
    calibration: str | os.PathLike | None = None
    num_sequences: int = 64
    seq_len: int = 256
    top_k: int | str | None = None
    num_exact_layers: int | None = None
    text: str | os.PathLike | None = None
    recall_items: int = DEFAULT_RECALL_ITEMS
    timing_tokens: int = 512
    device: str | torch.device = "cpu"
    progress: bool = True
    exact_layers_items: int | None = None
    refit: bool = False


def run_demo(
    source: str | None = None,
    target: str | None = None,
    mapper: str | KVMapper | None = None,
    config: DemoConfig | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Transfer a prompt's cache source -> target, let the target answer through it, and compare with its own run.

    With no model ids, uses the bundled family (`small` -> `large`) and fits a mapper on its `calibration.txt`.
    Without `prompt`, the prompt is a held-out passage-recall question (`tasks.passage_recall_items`, distractors
    from `text`): its answer is only in the passage, so the target can only get it right by *using* the
    transferred context. The retention number is the same measure over `recall_items` such questions.
    `num_exact_layers` is `TransferredCache`'s: the target's first layers computed from the prompt's ids (default:
    the mapper's, which the fit chose with its content probe, `exact_layers.py`). `exact_layers_items` is the fit's
    option of that name (items per content probe; default `FitConfig`'s, 64): fewer make the fit faster and its
    choice less sure.

    Args:
        config: the options (`DemoConfig`); any of its fields may be given as a keyword instead (`prompt=...`).

    Returns:
        A dict with `prompt`, `answers` (`own`, `transfer`, `no_context` text; with the expected `answer` for a
        recall question), `recall` (`content_eval.passage_recall`'s result, or None without text), `timing`,
        `fit_seconds`.
    """
    cfg = with_options(DemoConfig, config, options, "run_demo")
    source, target, cfg = _resolve_pair(source, target, cfg)
    src_model, tgt_model, tokenizer = load_pair(source, target, cfg.device)
    result: dict[str, Any] = {"source": source, "target": target}

    start = time.perf_counter()
    kv_mapper, kept = _demo_mapper(mapper, src_model, tgt_model, tokenizer, cfg)
    kv_mapper.check_compatible(src_model.config, tgt_model.config)
    result["fit_seconds"] = time.perf_counter() - start
    result.update({k: None if v is None else str(v) for k, v in kept.items()})  # mapper_read_from, mapper_kept_in
    result["mapper"] = _mapper_summary(kv_mapper, cfg.num_exact_layers)

    docs = split_documents(Path(cfg.text).read_text(encoding="utf-8"), tokenizer.eos_token) if cfg.text else []
    items = (
        passage_recall_items(tokenizer, cfg.recall_items, seed=0, distractor_texts=docs)
        if docs and cfg.recall_items > 0 else []
    )  # fmt: skip
    prompt_ids, no_context_ids, answer, max_new_tokens = _demo_prompt(tokenizer, items, cfg)
    if answer is not None:
        result["answer"] = answer
    result["prompt"] = tokenizer.decode(prompt_ids)
    result["prompt_tokens"] = len(prompt_ids)

    tokens = _target_answers(src_model, tgt_model, kv_mapper, tokenizer, prompt_ids, no_context_ids, max_new_tokens, cfg)
    result["answers"] = {name: tokenizer.decode(t) for name, t in tokens.items()}
    result["same_tokens"] = {"prefix": _common_prefix(tokens["own"], tokens["transfer"]), "of": len(tokens["own"])}

    result["recall"] = (
        passage_recall(src_model, tgt_model, kv_mapper, items, num_exact_layers=cfg.num_exact_layers, num_bootstrap=1000,
                       progress=cfg.progress)
        if items else None
    )  # fmt: skip
    result["timing"] = _demo_timing(src_model, tgt_model, kv_mapper, tokenizer, docs, prompt_ids, cfg)
    result["torch_threads"] = torch.get_num_threads()
    return result


def _resolve_pair(source: str | None, target: str | None, cfg: DemoConfig) -> tuple[str, str, DemoConfig]:
    """The model ids, and without them the bundled family's (with its calibration and held-out text as defaults)."""
    if (source is None) != (target is None):
        raise ValueError("pass both --source and --target (or neither, for the bundled family)")
    if source is None:
        root = find_family(cfg.family)
        source, target = map(str, family_pair(root))
        cfg = replace(cfg, calibration=cfg.calibration or root / "calibration.txt", text=cfg.text or root / "heldout.txt")
    return source, target, cfg


def _demo_mapper(mapper: str | KVMapper | None, src_model, tgt_model, tokenizer,
                 cfg: DemoConfig) -> tuple[KVMapper, dict[str, Path | None]]:  # fmt: skip
    """The mapper given (loaded when a path or id), else the one an earlier demo kept for these models and options,
    else one fitted on `cfg.calibration`, then kept (`demo_mapper.py`); and the folder it was read from
    (`mapper_read_from`) or kept in (`mapper_kept_in`)."""
    none = {"mapper_read_from": None, "mapper_kept_in": None}
    if isinstance(mapper, KVMapper):
        return mapper, none
    if mapper is not None:
        return KVMapper.from_pretrained(mapper), none
    if cfg.calibration is None:
        raise ValueError("with --source/--target, pass --mapper (a fitted mapper) or --calibration FILE to fit one")
    # all sequences fit the mapper (no held-out shard: the retention below is measured on other text)
    given = {"top_k": cfg.top_k, "exact_layers_items": cfg.exact_layers_items}
    fit_options = {name: value for name, value in given.items() if value is not None}  # else FitConfig's
    options = {"num_sequences": cfg.num_sequences, "seq_len": cfg.seq_len, "heldout_fraction": 0, **fit_options}
    folder = kept_mapper_dir(src_model, tgt_model, cfg.calibration, options)
    kept = None if cfg.refit else read_kept_mapper(folder)
    if kept is not None:
        return kept, {**none, "mapper_read_from": folder}
    if cfg.refit:
        shutil.rmtree(folder / CHECKPOINT, ignore_errors=True)  # a fit from the start, not resumed
    keep = writable(folder)
    fitted = fit_mapper(src_model, tgt_model, cfg.calibration, tokenizer=tokenizer, progress=cfg.progress,
                        checkpoint_dir=str(folder / CHECKPOINT) if keep else None, **options)  # fmt: skip
    return fitted, {**none, "mapper_kept_in": folder if keep and keep_mapper(fitted, folder) else None}


def _mapper_summary(kv_mapper: KVMapper, num_exact_layers: int | None) -> dict[str, Any]:
    """The mapper as the report describes it: its fit, its exact layers (and what chose them) and its inputs."""
    exact_report = kv_mapper.report.get("exact_layers", {})
    return {"top_k": kv_mapper.config.top_k, "ridge_lambda": kv_mapper.config.ridge_lambda,
            "calibration_tokens": kv_mapper.config.calibration.get("num_tokens"),
            # what the fit's progress bar counts: every token of every sequence, through both models
            "calibration_tokens_read": _tokens_read(kv_mapper.config.calibration),
            "calibration_stride": kv_mapper.config.calibration.get("stride"),
            "num_exact_layers": kv_mapper.resolve_num_exact_layers(num_exact_layers),
            "target_layers": kv_mapper.target_layout.num_layers,
            "exact_window": kv_mapper.config.exact_window,  # None: the exact layers attend to the whole prompt
            # what the mapped layers read, in the phrase of every other surface (fit, info, eval, bench)
            "maps_read": maps_read(kv_mapper.config, kv_mapper.resolve_num_exact_layers(num_exact_layers)),
            "exact_layers_probe_retention": (
                exact_report.get("min_retention")
                if num_exact_layers is None and kv_mapper.config.num_exact_layers is not None else None
            ),
            "exact_layers_probe_items": exact_report.get("num_items"),
            "exact_layers_gate_tolerance": (exact_report.get("gate") or {}).get("tolerance")}  # fmt: skip


def _demo_prompt(tokenizer, items: list, cfg: DemoConfig) -> tuple[list[int], list[int] | None, str | None, int]:
    """`(prompt ids, the prompt's ids without its passage or None, the expected answer or None, max_new_tokens)`:
    `cfg.prompt`, else the first recall question."""
    if cfg.prompt is not None:
        return tokenizer(cfg.prompt, add_special_tokens=False)["input_ids"], None, None, cfg.max_new_tokens or 32
    if not items:
        raise ValueError("pass --prompt TEXT, or --text FILE to draw passage-recall questions from")
    item = items[0]
    # Up to the closing quotes of the answer (a few tokens), unless asked for more.
    max_new_tokens = cfg.max_new_tokens or len(item.answer_ids) + 2
    return item.prompt_ids, item.no_passage_prompt_ids, tokenizer.decode(item.answer_ids), max_new_tokens


def _target_answers(
    src_model, tgt_model, kv_mapper: KVMapper, tokenizer, prompt_ids: list[int], no_context_ids: list[int] | None,
    max_new_tokens: int, cfg: DemoConfig,
) -> dict[str, list[int]]:
    """The target's greedy answer tokens: `own` (its own prefill), `transfer` (the transferred cache) and, for a
    recall question, `no_context` (without the passage)."""
    input_ids = torch.tensor([prompt_ids], device=cfg.device)
    gen = {"max_new_tokens": max_new_tokens, "min_new_tokens": max_new_tokens, "do_sample": False,
           "pad_token_id": tokenizer.eos_token_id}  # fmt: skip

    def answer(ids: torch.Tensor, **cache) -> list[int]:
        mask = torch.ones_like(ids)
        return tgt_model.generate(ids, attention_mask=mask, **cache, **gen)[0, ids.shape[1] :].tolist()

    with torch.no_grad():
        transferred = TransferredCache(
            prefill(src_model, input_ids), kv_mapper, num_exact_layers=cfg.num_exact_layers, model=tgt_model
        )
        tokens = {"own": answer(input_ids), "transfer": answer(input_ids, **{cache_argument(tgt_model): transferred})}
        if no_context_ids is not None:
            tokens["no_context"] = answer(torch.tensor([no_context_ids], device=cfg.device))
    return tokens


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many first tokens `a` and `b` share."""
    same = 0
    while same < min(len(a), len(b)) and a[same] == b[same]:
        same += 1
    return same


def _demo_timing(src_model, tgt_model, kv_mapper: KVMapper, tokenizer, docs: list[str], prompt_ids: list[int],
                 cfg: DemoConfig) -> dict[str, Any]:  # fmt: skip
    """Time to the first token on a longer context than the prompt, where prefill cost dominates fixed overheads."""
    token_docs = [tokenizer(d, add_special_tokens=False, verbose=False)["input_ids"] for d in docs[:8]]
    stream = [t for d in token_docs for t in d] or prompt_ids
    timing_ids = torch.tensor([(stream * (cfg.timing_tokens // len(stream) + 1))[: cfg.timing_tokens]])
    return time_to_first_token(src_model, tgt_model, kv_mapper, timing_ids, num_exact_layers=cfg.num_exact_layers)


def _tokens_read(calibration: dict) -> int | None:
    sequences, seq_len = calibration.get("num_sequences"), calibration.get("seq_len")
    return sequences * seq_len if sequences and seq_len else None


def _short(text: str) -> str:
    # An answer up to its closing quotes, on one line.
    text = text.split("``")[0] if "``" in text else text
    return text.replace("\n", " / ").strip() or "(nothing)"


def _probe_clause(m: dict[str, Any]) -> str:
    """What chose the exact layers, in the words of the fit's decision."""
    if m.get("exact_layers_gate_tolerance") is not None:
        return (f" (the fit's content probe chose the cheapest configuration whose passage recall and hand-off stay within "
                f"{tolerance_points(m['exact_layers_gate_tolerance'])} of accuracy of the target's own on held-out probe "
                "questions)")  # fmt: skip
    if m.get("exact_layers_probe_retention"):
        return (f" (the fit's content probe chose the cheapest configuration that keeps "
                f"{m['exact_layers_probe_retention']:.0%} of the target's copying from its context)")  # fmt: skip
    return ""


def _ready(result: dict[str, Any]) -> str:
    """How the mapper came to be: fitted now, or read from the folder an earlier demo kept it in."""
    if result.get("mapper_read_from"):
        return f"fitted by an earlier demo, read from {result['mapper_read_from']} in {result['fit_seconds']:.1f} s; --refit fits again"
    return f"ready in {result['fit_seconds']:.1f} s"


def _window_clause(m: dict[str, Any]) -> str:
    """How far back the exact layers attend over the transferred prompt (nothing: all of it)."""
    window = m.get("exact_window")
    return f" (their attention reaching back {window} tokens)" if window else ""


def _calibration_tokens(m: dict[str, Any]) -> str:
    """The calibration tokens as the fit's progress bar counts them, and how many of them the fit used."""
    read, used, stride = m.get("calibration_tokens_read"), m.get("calibration_tokens"), m.get("calibration_stride")
    if read is None or read == used:
        return f"{used} calibration tokens"
    return f"{read} calibration tokens, every {stride}th fit: {used}" if stride else f"{read} calibration tokens, {used} fit"


def format_demo(result: dict[str, Any]) -> str:
    """The demo's report as text (the CLI prints it)."""
    lines = [*_mapper_lines(result), "", *_answer_lines(result), "", _recall_line(result.get("recall"))]
    t = result["timing"]
    lines.append(
        f"time to the first token on {t['num_tokens']} context tokens: {t['transfer_ms']:.1f} ms from the transferred "
        f"cache (mapping, {t['num_exact_layers']} exact layer(s), {t['num_recompute_tokens']} recomputed tokens) "
        f"instead of {t['target_prefill_ms']:.1f} ms for the target's own prefill ({t['speedup']:.1f}x faster; median, "
        f"{result['torch_threads']} CPU thread{'' if result['torch_threads'] == 1 else 's'})"
    )
    return "\n".join(lines)


def _mapper_lines(result: dict[str, Any]) -> list[str]:
    """The report's head: the models, the mapper, its exact layers and what its maps read."""
    m = result["mapper"]
    lines = [
        f"source: {result['source']}",
        f"target: {result['target']}",
        f"mapper: top_k={m['top_k']} lambda={m['ridge_lambda']} ({_calibration_tokens(m)}; {_ready(result)})",
        f"exact layers: the target computes its first {m['num_exact_layers']} of {m['target_layers']} layers from the "
        f"prompt's ids{_window_clause(m)}, the rest are mapped"
        + _probe_clause(m),
    ]
    mapped = m["target_layers"] - m["num_exact_layers"]
    if mapped:
        lines.append(f"maps: the {mapped} mapped layer{'s' if mapped > 1 else ''} read: {m['maps_read']}")
    return lines


def _answer_lines(result: dict[str, Any]) -> list[str]:
    """The prompt and the target's answers: for a recall question, the fact asked about and which answers are right."""
    def tail(text: str, n: int = 300) -> str:
        text = text.replace("\n", " / ")
        return text if len(text) <= n else "..." + text[-n:]

    answers = result["answers"]
    if "answer" not in result:
        return [
            f"prompt ({result['prompt_tokens']} tokens): {tail(result['prompt'])}",
            "",
            f"target, own prefill        : {answers['own'].replace(chr(10), ' / ')}",
            f"target, transferred cache  : {answers['transfer'].replace(chr(10), ' / ')}",
            f"  first {result['same_tokens']['prefix']} of {result['same_tokens']['of']} greedy tokens identical",
        ]
    # A passage-recall question: the answer is in the passage only.
    prompt = result["prompt"]
    question = prompt[prompt.rindex("Q: "):] if "Q: " in prompt else prompt
    fact = next((ln for ln in prompt.split("\n") if f"``{result['answer']}``" in ln), "")
    lines = [
        f"context ({result['prompt_tokens']} tokens, read by the source only): a passage of made-up API facts, "
        "unrelated text, then a question. The fact asked about:",
        f"  {fact.strip()}",
        f"question: {question.replace(chr(10), ' / ')}",
        "",
    ]
    for name, label in (("own", "target reading the context itself"),
                        ("transfer", "target on the transferred cache "),
                        ("no_context", "target without the passage     ")):
        got = _short(answers[name])
        lines.append(f"  {label}: {got}  ({'right' if got == result['answer'] else 'wrong'})")
    return lines


def _recall_line(rec: dict[str, Any] | None) -> str:
    """The recall retention beside the counts of right answers it is computed from."""
    if not rec:
        return "recall retention: not measured (pass --text FILE to draw questions from)"
    acc = {name: 100 * rec["accuracy"][name]["mean"] for name in ("own", "transfer", "no_context")}
    n = rec["num_items"]
    if rec["retention"] is None:
        return (
            f"recall over {n} held-out questions: {acc['own']:.0f}% right reading the context, {acc['transfer']:.0f}% "
            f"from the transferred cache, {acc['no_context']:.0f}% without the passage; no retention: "
            f"{rec['retention_undefined']}"
        )
    lo, hi = rec["retention_ci"]
    # The ratio of the counts of right answers (not of the rounded percentages): the printed arithmetic holds.
    right = {name: round(rec["accuracy"][name]["mean"] * n) for name in acc}
    return (
        f"recall retention {100 * rec['retention']:.0f}% (95% CI [{100 * lo:.0f}, {100 * hi:.0f}]): over {n} "
        f"held-out questions the target answered {acc['own']:.0f}% right reading the context itself, "
        f"{acc['transfer']:.0f}% from the transferred cache and {acc['no_context']:.0f}% without the passage; "
        f"retention = ({right['transfer']} - {right['no_context']}) / ({right['own']} - {right['no_context']}) "
        f"right answers of {n}"
    )
