"""`hf-kvtransfer` command line: thin subcommands over the public API.

Each subcommand registers itself with an `_add_<name>(subparsers)` function listed in `_SUBCOMMANDS`;
the handler receives the parsed `argparse.Namespace` and returns an exit code.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import textwrap
from pathlib import Path

from ..version import __version__

_DEBUG_HINT = "rerun with --debug (or HF_DEBUG=1) for the full traceback"


class CLIError(Exception):
    """A failure the command line reports as `error: <message>` plus `hint: <hint>`, without a traceback."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


def _is_user_error(exc: BaseException) -> bool:
    """Errors a user can act on (bad input, a missing file or repo, the network, a missing optional package):
    one line plus a hint. Anything else (TypeError, KeyError, ...) is a bug in this library and keeps its traceback."""
    if isinstance(exc, ImportError):
        return "pip install" in str(exc)  # ours say what to install; any other is a broken environment or a bug
    # OSError covers the Hub's errors (MapperHubError and huggingface_hub's HTTP errors) and the file system's.
    return isinstance(exc, (CLIError, ValueError, OSError))


def _says_everything(exc: BaseException) -> bool:
    """Whether an error's one line is all there is to know: this library raised it (its messages say what is wrong
    and what to pass). An error raised inside another library keeps the `--debug` hint: its traceback may say more."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(package + os.sep)


# -- hints: the next step after a common mistake (the error line says what is wrong) ---------------------------

_MAPPER_TAKES = "a mapper is a folder that `hf-kvtransfer fit ... --output DIR` wrote, or a Hub repo id org/name"
_MODEL_TAKES = "a model is a folder holding config.json and its weights, or a Hub repo id org/name (e.g. Qwen/Qwen3-0.6B)"
# What each path option takes: the hint after a path that does not exist.
_PATH_OPTIONS = {
    "mapper": _MAPPER_TAKES,
    "mapper_dir": _MAPPER_TAKES,
    "reverse_mapper": _MAPPER_TAKES,
    "source": _MODEL_TAKES,
    "target": _MODEL_TAKES,
    "dataset": "--dataset takes a local .txt, .jsonl or .parquet file or a folder of them, or a Hub dataset id org/name",
    "calibration": "--calibration takes a text file (documents separated by blank lines)",
    "text": "--text takes a text file (documents separated by lines holding only the EOS token)",
    "mc": "--mc takes a JSONL file of multiple-choice items",
    "family": "without --family, `hf-kvtransfer demo` finds examples/family when run from the repository's root",
    "stats_dir": None,  # its errors say what writes one
}


def _missing_path_hint(exc: BaseException, args: argparse.Namespace) -> str | None:
    """What the option naming a path that does not exist takes, and where a relative path is read from."""
    if not (isinstance(exc, FileNotFoundError) or "does not exist" in str(exc)):
        return None
    text = f"{exc} {getattr(exc, 'filename', None) or ''}"
    for dest, takes in _PATH_OPTIONS.items():
        value = getattr(args, dest, None)
        if not isinstance(value, str) or not value or os.path.exists(os.path.expanduser(value)):
            continue
        if re.search(rf"(?<![\w/.~-]){re.escape(value)}(?![\w/-])", text):
            where = None if os.path.isabs(os.path.expanduser(value)) else (
                f"relative paths are read from the current directory, {os.getcwd()}"
            )
            return "; ".join(part for part in (takes, where) if part) or None
    return None


def _require_files(args: argparse.Namespace, *dests: str) -> None:
    """Fail before anything loads when a file option names no file (`--text FILE`, `--mc FILE`)."""
    from ..core.hub import missing_local_path_message

    for dest in dests:
        value = getattr(args, dest, None)
        if value and not os.path.isfile(value):
            flag = "--" + dest.replace("_", "-")
            if os.path.isdir(value):
                raise IsADirectoryError(f"{flag} {value} is a directory; pass a file")
            raise FileNotFoundError(missing_local_path_message(value, f"{flag} file", bare=True))


def _require_output_folders(args: argparse.Namespace, *dests: str) -> None:
    """Fail before anything runs when an output file option's folder does not exist (`--json out/x.json`): the
    results of a long run would otherwise be lost when it ends."""
    for dest in dests:
        value = getattr(args, dest, None)
        folder = os.path.dirname(os.path.abspath(value)) if value else None
        if folder is not None and not os.path.isdir(folder):
            flag = "--" + dest.replace("_", "-")
            raise CLIError(f"{flag} {value}: the folder {folder} does not exist", "create it first, or write elsewhere")


def _other_pair_hint(exc: BaseException, args: argparse.Namespace) -> str | None:
    """A mapper loaded for models it was not fit for: the fit command for these models."""
    if not (isinstance(exc, ValueError) and "this mapper was fit for" in str(exc)):
        return None
    return _fit_this_pair(getattr(args, "source", None), getattr(args, "target", None), "--mapper")


def _fit_this_pair(source: str | None, target: str | None, option: str) -> str:
    import shlex

    command = f"hf-kvtransfer fit --source {shlex.quote(source or 'SOURCE')} --target {shlex.quote(target or 'TARGET')}"
    return f"pass the mapper fit for these models as {option}, or fit one: {command} --dataset TEXT --output DIR"


def _offline_hint(exc: BaseException, args: argparse.Namespace) -> str | None:
    """Offline by a flag or by the environment, for something only the Hub has."""
    if getattr(args, "offline", False) and "use_hub=False" in str(exc):
        return "leave out --offline to ask the Hub for the model's config.json"
    switches = [f"{name}={os.environ[name]}" for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
                if os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")]  # fmt: skip
    if switches and re.search(r"offline mode|couldn't connect|could not reach", str(exc)):
        return f"{' and '.join(switches)} in your environment keeps the Hub out: unset it for one run with network access"
    return None


_HINTS = (_offline_hint, _missing_path_hint, _other_pair_hint)


def _hint(exc: BaseException, args: argparse.Namespace) -> str | None:
    """The `hint:` line after `error:` (None: the error line says it all): the exception's own hint, else the first
    rule that knows the mistake, else, for an error another library worded, how to see its traceback."""
    hint = getattr(exc, "hint", None)
    for rule in _HINTS:
        hint = hint or rule(exc, args)
    return hint or (None if _says_everything(exc) else _DEBUG_HINT)


def _example(text: str) -> str:
    return "example:\n" + textwrap.indent(textwrap.dedent(text).strip(), "  ")


def build_parser() -> argparse.ArgumentParser:
    """The `hf-kvtransfer` parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="hf-kvtransfer",
        description="Reuse a source model's KV cache in a target model of the same family (no re-prefill).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_example(
            """
            hf-kvtransfer demo
            hf-kvtransfer fit --source examples/family/small --target examples/family/large \\
                --dataset examples/family/calibration.txt --output mappers/family
            hf-kvtransfer info mappers/family
            """
        ),
    )
    parser.add_argument("--version", action="version", version=f"hf-kvtransfer {__version__}")
    _add_global_options(parser, False)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(subparsers)
    return parser


def _add_global_options(parser: argparse.ArgumentParser, default) -> None:
    # On the main parser (default False) and on every subcommand (default SUPPRESS, so that a flag given before the
    # subcommand is not reset by the subparser's default): `--debug` works before or after the subcommand.
    parser.add_argument("--debug", action="store_true", default=default, help="show full tracebacks (also HF_DEBUG=1)")
    parser.add_argument("-v", "--verbose", action="store_true", default=default, help="log progress details")


def _subparser(subparsers, name: str, help: str, example: str) -> argparse.ArgumentParser:
    # argparse %-formats a subcommand's `help` (for %(default)s): a literal % must be doubled ("95% CIs").
    p = subparsers.add_parser(
        name, help=help.replace("%", "%%"), description=help, epilog=_example(example),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    _add_global_options(p, argparse.SUPPRESS)
    return p


# -- subcommands (each: _add_<name> registers, _run_<name> executes) -------------------------------------

_SUBCOMMANDS: list = []


def _add_push(subparsers) -> None:
    p = _subparser(
        subparsers,
        "push",
        "publish a mapper folder to the Hugging Face Hub (config, weights and model card in one commit)",
        """
        hf-kvtransfer push mappers/family my-org/family-kv --private
        hf-kvtransfer push mappers/family my-org/family-kv --revision k8
        """,
    )
    p.add_argument("mapper_dir", help="folder written by `KVMapper.save_pretrained` or `hf-kvtransfer fit`")
    p.add_argument("repo_id", help="Hub repo to create or update, e.g. my-org/qwen3-14b-to-32b-kv")
    p.add_argument("--private", action="store_true", help="create the repo private (only applies when it is new)")
    p.add_argument("--revision", help="branch to publish to (created from main if missing)")
    p.add_argument("--commit-message", help="commit title (default: describes the mapper)")
    p.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing directly")
    p.add_argument("--token", help="Hub token with write access (default: `hf auth login` / HF_TOKEN)")
    p.add_argument("--max-shard-size", default="5GB", help="weights above this go as shards + index (default 5GB)")
    p.set_defaults(func=_run_push)


def _run_push(args) -> int:
    from ..core.mapper import KVMapper

    # Loading first validates the folder strictly, and re-rendering the card puts the repo id in its usage snippet.
    mapper = KVMapper.from_pretrained(args.mapper_dir, local_files_only=True)
    url = mapper.push_to_hub(
        args.repo_id,
        private=args.private or None,
        revision=args.revision,
        commit_message=args.commit_message,
        token=args.token,
        create_pr=args.create_pr,
        max_shard_size=args.max_shard_size,
    )
    print(url)
    return 0


def _add_info(subparsers) -> None:
    p = _subparser(
        subparsers,
        "info",
        "summarise a mapper (local folder or Hub repo): model pair, k, size, fit quality",
        """
        hf-kvtransfer info mappers/family
        hf-kvtransfer info my-org/family-kv --revision k8
        """,
    )
    p.add_argument("mapper", help="local mapper folder or Hub repo id")
    p.add_argument("--revision", help="branch, tag or commit on the Hub")
    p.add_argument("--token", help="Hub token for private or gated repos")
    p.add_argument("--json", action="store_true", help="print the full config.json instead of the summary")
    p.set_defaults(func=_run_info)


def _run_info(args) -> int:
    import json

    from ..core.checkpoint import checkpoint_info
    from ..core.hub import CONFIG_NAME, REPORT_NAME, resolve_mapper_dir
    from ..core.mapper import KVMapper

    path = resolve_mapper_dir(args.mapper, revision=args.revision, token=args.token)
    config = json.loads((path / CONFIG_NAME).read_text())
    if args.json:
        print(json.dumps(config, indent=2, sort_keys=True))
        return 0
    from ..core.flops import mapper_first_token

    # Describe only a mapper that loads: opened as `from_pretrained` opens it (every shard, shapes, finite values).
    mapper = KVMapper.from_pretrained(str(path), local_files_only=True)
    report = json.loads((path / REPORT_NAME).read_text()) if (path / REPORT_NAME).is_file() else {}
    print(_format_info(config, checkpoint_info(path)["total_size"], report, mapper_first_token(mapper),
                       _transfer_lines(mapper, report), _top_k_note(mapper)))  # fmt: skip
    return 0


def _top_k_note(mapper) -> str:
    """" (not used: ...)" when the default transfer reads no source layer, so `top_k` plays no part in it."""
    from ..core.defaults import resolve_num_exact_layers
    from ..core.map_inputs import top_k_unused

    why = top_k_unused(mapper.config, resolve_num_exact_layers(mapper, None))
    return f" ({why})" if why else ""


def _transfer_lines(mapper, report: dict) -> list[str]:
    """What a transfer with `mapper` does at its defaults (`resolve_transfer`, as the cache resolves them): the layers
    the target computes, how far back they attend, what the other layers' maps read, the prompt's recomputed tokens."""
    from ..core.defaults import resolve_transfer
    from ..core.map_inputs import maps_read

    settings = resolve_transfer(mapper, num_tokens=2**31)  # a long prompt: the recomputed tokens are not capped
    layers, exact = len(mapper.config.selected_layers), settings.num_exact_layers
    reason = (report.get("exact_layers") or {}).get("reason")
    lines = [f"exact:       the target computes its first {exact} of {layers} layer(s) itself"
             + (" (the default: this mapper records none)" if mapper.config.num_exact_layers is None else "")
             + (f"; {reason}" if reason else "")]  # fmt: skip
    if settings.exact_window:
        lines.append(f"window:      the exact layers attend within {settings.exact_window} tokens of each token "
                     "(the recomputed tokens to the whole prompt)")  # fmt: skip
    lines.append(f"maps:        {layers - exact} mapped layer(s), reading: {maps_read(mapper.config, exact)}" if exact < layers
                 else "maps:        none (the target computes every layer: the transfer is its own cache)")  # fmt: skip
    lines.append(f"recomputed:  the prompt's last {settings.num_recompute_tokens} token(s) run through the target "
                 "(at most half of a short prompt)")  # fmt: skip
    if mapper.config.quality_gate is not None:
        lines.append(f"gate:        {mapper.config.quality_gate.describe()}")
    return lines


def _format_info(config: dict, weights_bytes: int, report: dict | None = None,
                 first_token: dict[int, dict[str, int]] | None = None, transfer: list[str] = (),
                 top_k_note: str = "") -> str:  # fmt: skip
    def fp(which: str) -> str:
        f = config.get(f"{which}_fingerprint", {})
        name = config.get(f"{which}_model_id") or "?"
        rev = config.get(f"{which}_revision")
        return (
            f"{name}{'@' + rev if rev else ''} ({f.get('model_type')}, {f.get('num_hidden_layers')} layers x "
            f"{f.get('num_key_value_heads')} KV heads x {f.get('head_dim')})"
        )

    lines = [
        f"mapper:      {config.get('mapper_type')} (hf-kvtransfer {config.get('library_version')})",
        f"source:      {fp('source')}",
        f"target:      {fp('target')}",
        f"top_k:       {config.get('top_k')}{top_k_note}    ridge_lambda: {config.get('ridge_lambda')}",
        f"parameters:  {config.get('num_parameters') or 0:,} ({weights_bytes / 2**20:.1f} MiB on disk"
        + (f", {config['dtype']})" if config.get("dtype") else ")"),
    ]
    if config.get("rank"):
        lines.append("rank:        K/V per target layer " + ", ".join(f"{k}/{v}" for k, v in config["rank"]))
    lines += transfer
    if first_token:
        (n, f), *rest = first_token.items()
        more = "".join(f", {g['own_prefill'] / g['total']:.2f}x at {m}" for m, g in rest)
        lines.append(
            f"first token: {f['own_prefill'] / f['total']:.2f}x fewer FLOPs than the target's own prefill at {n} "
            f"tokens{more} (its exact layers, the maps, the recomputed tokens; `hf-kvtransfer bench` times it here)"
        )
    calibration = config.get("calibration") or {}
    if calibration:
        lines.append("calibration: " + ", ".join(f"{k}={v}" for k, v in sorted(calibration.items()) if v is not None))
    for label, key in (("fit R^2", "fit_r2"), ("held-out R^2", "heldout_r2")):
        rk, rv = config.get(f"{key}_key"), config.get(f"{key}_value")
        if rk and rv:
            lines.append(
                f"{label + ':':<13}K mean {sum(rk) / len(rk):.4f} (min {min(rk):.4f}), "
                f"V mean {sum(rv) / len(rv):.4f} (min {min(rv):.4f})"
            )
    for name, value in sorted(((report or {}).get("eval_results") or {}).items()):
        lines.append(f"eval:        {name} = {value}")
    return "\n".join(lines)


_SUBCOMMANDS += [_add_push, _add_info]


# -- eval / demo (evaluate.py, demo.py) ------------------------------------------------------------------


_DEVICE_HELP = "where both models run: cpu (default), cuda or cuda:N"


def _load_pair(args):
    from ..core.loading import load_pair

    return load_pair(args.source, args.target, device=args.device, dtype=args.dtype)


def _add_eval(subparsers) -> None:
    p = _subparser(
        subparsers,
        "eval",
        "measure what a mapper retains: prefix-conditioned perplexity, content tasks (repeated spans, passage "
        "recall, hand-off, greedy agreement; own / transfer / no context with 95% CIs), multiple choice, diagnostics, "
        "multi-turn drift",
        """
        hf-kvtransfer eval --source examples/family/small --target examples/family/large \\
            --mapper mappers/family --text examples/family/heldout.txt --json eval.json --plot eval.png
        hf-kvtransfer eval --source examples/family/small --target examples/family/large --mapper mappers/family \\
            --text examples/family/heldout.txt --tasks recall,handoff --items 300
        hf-kvtransfer eval --source examples/family/small --target examples/family/large --mapper mappers/family \
            --text examples/family/heldout.txt --tasks depth --depth-lengths 256 512 1024 --plot depth.png
        """,
    )
    p.add_argument("--source", required=True, help="source model id or path")
    p.add_argument("--target", required=True, help="target model id or path (its tokenizer is used)")
    p.add_argument("--mapper", required=True, help="source -> target mapper (Hub id or local directory)")
    p.add_argument("--text", required=True, help="evaluation text file (documents split at lines holding only EOS)")
    p.add_argument("--tasks", help="comma-separated, from: perplexity, continuation, repeat (repeated spans), recall "
                   "(passage recall), handoff, agreement (greedy generations), depth (passage recall over context lengths x "
                   "needle positions; only when named), multiple-choice (needs --mc), multi-turn (needs "
                   "--reverse-mapper); default: every one that applies")
    p.add_argument("--items", type=int, default=600,
                   help="items per content task: repeat, recall, handoff, agreement prompts (default 600)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="agreement: tokens generated per prompt (default 16)")
    p.add_argument("--depth-lengths", type=int, nargs="+", default=[512, 1024], metavar="N",
                   help="depth: context lengths in tokens, each with the passage at the start, middle and end "
                        "(default 512 1024)")
    p.add_argument("--depth-items", type=int, default=100, help="depth: items per cell (default 100)")
    p.add_argument("--reverse-mapper", help="target -> source mapper: adds the multi-turn handoff")
    p.add_argument("--mc", help="multiple-choice JSONL (generic / HellaSwag / ARC / PIQA / WinoGrande fields)")
    p.add_argument("--mc-limit", type=int, help="score only the first N multiple-choice items")
    p.add_argument("--prefix-len", type=int, default=128,
                   help="prefix length T (perplexity windows of 2T tokens, repeated-span prefixes, agreement prompts; "
                   "default 128)")
    p.add_argument("--max-windows", type=int, default=256, help="perplexity windows, evenly spaced (default 256)")
    p.add_argument("--recompute", type=int, default=None,
                   help="context tokens the target recomputes in every transfer (default: TransferredCache's, 32 or "
                        "half a shorter context; 0: the whole prefix transferred; recall and agreement: at least 1)")
    p.add_argument("--exact-layers", type=int, default=None,
                   help="the target's first layers computed from the prompt's ids in every transfer (default: the "
                        "mapper's, chosen by its fit; 0 measures the mapper alone)")
    p.add_argument("--exact-window", type=int, default=None, metavar="N",
                   help="the exact layers attend within N tokens in every transfer (default: the mapper's "
                        "exact_window, chosen by its fit; 0: the whole prompt)")
    p.add_argument("--no-continuation", action="store_true", help="skip the continuation task built from --text")
    p.add_argument("--num-items", type=int, default=200, help="continuation-task items (default 200)")
    p.add_argument("--context-len", type=int, default=128, help="continuation-task context tokens (default 128)")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: number of turns (default 4)")
    p.add_argument("--turn-len", type=int, default=64, help="multi-turn: tokens per turn (default 64)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="windows / items per forward pass (default 8; lower it if memory runs out)")
    p.add_argument("--seed", type=int, default=0, help="seed of the items drawn from --text and of the bootstrap (default 0)")
    p.add_argument("--device", default="cpu", help=_DEVICE_HELP)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype both models are loaded in (default float32)")
    p.add_argument("--json", help="write the results as JSON here; while it runs, each finished task (and depth cell) is kept beside it "
                   "(FILE.journal.jsonl), so the same command run again after an interruption resumes")
    p.add_argument("--markdown", help="write the markdown tables here (they are printed either way)")
    p.add_argument("--plot", help="write a PNG of per-layer cosine / R^2, content tasks and per-turn drift (needs matplotlib)")
    p.set_defaults(func=_run_eval)


def _with_exact_window(mapper, window: int | None):
    """`mapper`, or with `--exact-window N` a copy whose exact layers attend within N tokens (0: the whole prompt)."""
    if window is None:
        return mapper
    if window < 0:
        raise CLIError(f"--exact-window must be a number of tokens >= 1, or 0 for the whole prompt, got {window}")
    return mapper.with_config(exact_window=window or None)


def _run_eval(args) -> int:
    from pathlib import Path

    from ..core.map_inputs import maps_read
    from ..core.mapper import KVMapper
    from ..evaluation.evaluate import eval_journal, evaluate
    from ..evaluation.multiple_choice import load_multiple_choice
    from .reporting import eval_settings, origin_of_exact_layers

    _check_eval_args(args)
    # Mappers (small) before models (large): a broken or mistyped one fails at once.
    mapper = _with_exact_window(KVMapper.from_pretrained(args.mapper), args.exact_window)
    reverse = KVMapper.from_pretrained(args.reverse_mapper) if args.reverse_mapper else None
    source, target, tokenizer = _load_pair(args)
    mapper.check_compatible(source.config, target.config)
    if reverse is not None:
        try:
            reverse.check_compatible(target.config, source.config)
        except ValueError as exc:  # the pair the other way round: its hint swaps --source and --target
            raise CLIError(str(exc), _fit_this_pair(args.target, args.source, "--reverse-mapper")) from exc
    items = load_multiple_choice(args.mc, tokenizer, args.mc_limit) if args.mc else None
    settings = {
        "num_exact_layers": mapper.resolve_num_exact_layers(args.exact_layers),
        "exact_window": mapper.config.exact_window,
        "exact_layers_origin": origin_of_exact_layers(mapper, args.exact_layers),
        "num_target_layers": mapper.target_layout.num_layers,
        "num_recompute_tokens": "default" if args.recompute is None else args.recompute,
        "maps_read": maps_read(mapper.config, mapper.resolve_num_exact_layers(args.exact_layers)),
    }
    print(f"eval: every transfer with {eval_settings(settings)}", flush=True)
    journal = eval_journal(_eval_journal_path(args.json), source, target) if args.json else None
    results = _journaled(args, journal, lambda: evaluate(
        source, target, mapper, tokenizer, Path(args.text).read_text(encoding="utf-8"), tasks=args.tasks,
        num_content_items=args.items, max_new_tokens=args.max_new_tokens, prefix_len=args.prefix_len,
        depth_lengths=args.depth_lengths, depth_items=args.depth_items,
        max_windows=args.max_windows, num_recompute_tokens=args.recompute, num_exact_layers=args.exact_layers,
        continuation=not args.no_continuation, context_len=args.context_len, num_items=args.num_items,
        multiple_choice_items=items, reverse_mapper=reverse, num_turns=args.turns, turn_len=args.turn_len,
        batch_size=args.batch_size, seed=args.seed, journal=journal,
    ))  # fmt: skip
    results["config"].update(source=args.source, target=args.target, mapper=args.mapper, text=args.text)
    results["config"].update({k: settings[k] for k in ("exact_layers_origin", "num_target_layers", "maps_read")})
    _write_eval_results(args, results)
    if journal is not None:
        journal.path.unlink(missing_ok=True)  # the results are written: nothing left to resume
    return 0


def _journaled(args, journal, run):
    """`run()` with `eval`'s journal: on a stop before any task finished the journal goes (nothing to resume from),
    on Ctrl-C the message says what is kept; tasks read back are said once the run ends."""
    try:
        results = run()
    except BaseException as exc:
        if journal is not None and not journal.entries:
            journal.path.unlink(missing_ok=True)
        if isinstance(exc, KeyboardInterrupt):
            args.interrupted_message = _eval_interrupted(journal)
        raise
    if journal is not None and journal.reused:
        print(f"eval: {_kept(journal.reused_names)} read back from {journal.path}", flush=True)
    return results


def _kept(names) -> str:
    """Results of `eval`'s journal in words: "2 finished task(s)", "1 finished task(s) and 3 depth cell(s)"."""
    from ..evaluation.evaluate import DEPTH_CELL

    cells = names.get(DEPTH_CELL, 0)
    tasks = sum(names.values()) - cells
    return " and ".join(part for part, n in ((f"{tasks} finished task(s)", tasks), (f"{cells} {DEPTH_CELL}(s)", cells))
                        if n) or "nothing"  # fmt: skip


def _eval_journal_path(json_path: str) -> Path:
    """Where `eval --json FILE` keeps its finished tasks while it runs: FILE.journal.jsonl."""
    return Path(json_path).with_name(Path(json_path).name + ".journal.jsonl")


def _eval_interrupted(journal) -> str:
    """What an interrupted `eval` says: the finished tasks kept for a rerun, or that there are none to keep."""
    if journal is None:
        return "interrupted; nothing is kept without --json (with --json FILE, finished tasks are kept to resume from)"
    if not journal.entries:
        return "interrupted before a task finished; running the command again starts over"
    return (f"interrupted; {_kept(journal.kept_names())} are kept in {journal.path}\n"
            "hint: run the same command again to resume from there")  # fmt: skip


def _check_eval_args(args) -> None:
    """`eval`'s cheap checks, before anything loads: --plot's matplotlib, the item counts, the tasks, the files."""
    from ..evaluation.evaluate import resolve_tasks
    from .reporting import pyplot

    if args.plot:
        try:
            pyplot()  # a missing matplotlib fails before the run, not after it
        except ImportError as exc:
            raise CLIError(str(exc), "or leave out --plot: the results as JSON and markdown need no matplotlib") from exc
    if args.items < 1:
        raise CLIError(f"--items must be >= 1, got {args.items}", "the content tasks default to 600 items")
    if args.depth_items < 1 or min(args.depth_lengths) < 64:
        raise CLIError(f"--depth-items must be >= 1 and --depth-lengths >= 64 tokens, got {args.depth_items} and "
                       f"{args.depth_lengths}", "the defaults are --depth-items 100 --depth-lengths 512 1024")
    try:  # a mistyped task fails before anything loads
        resolve_tasks(args.tasks, multiple_choice=bool(args.mc), multi_turn=bool(args.reverse_mapper),
                      continuation=not args.no_continuation)
    except ValueError as exc:
        raise CLIError(str(exc), "e.g. --tasks perplexity,recall,handoff; `hf-kvtransfer eval --help` describes each") from exc
    _require_files(args, "text", "mc")
    _require_output_folders(args, "json", "markdown", "plot")


def _write_eval_results(args, results: dict) -> None:
    """`eval`'s table on stdout, and the --json, --markdown and --plot files asked for."""
    import json
    from pathlib import Path

    from .reporting import evaluation_markdown, plot_evaluation

    table = evaluation_markdown(results)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    if args.markdown:
        Path(args.markdown).write_text(table, encoding="utf-8")
    if args.plot:
        plot_evaluation(results, args.plot)
        print(f"wrote {args.plot}")


def _add_demo(subparsers) -> None:
    p = _subparser(
        subparsers,
        "demo",
        "transfer a prompt's cache from a small model to a large one and compare with the large model's own run "
        "(offline on the bundled family when run without arguments)",
        """
        hf-kvtransfer demo
        hf-kvtransfer demo --family examples/family --exact-layers 4
        hf-kvtransfer demo --family examples/family_deep      # the 8 -> 24-layer pair: about 13 minutes on one core
        hf-kvtransfer demo --source examples/family/small --target examples/family/large --mapper mappers/family \\
            --text examples/family/heldout.txt
        hf-kvtransfer demo --source Qwen/Qwen3-0.6B --target Qwen/Qwen3-1.7B --mapper my-org/qwen3-0.6b-to-1.7b-kv \\
            --text examples/family/heldout.txt
        """,
    )
    p.add_argument("--source", help="source model id or path (default: the bundled family's small model)")
    p.add_argument("--target", help="target model id or path (default: the bundled family's large model)")
    p.add_argument("--mapper", help="fitted mapper id or path (default: fit one on --calibration now)")
    p.add_argument("--family", help="model family directory: small/ and large/ (or source/ and target/), calibration.txt, heldout.txt (default: $HF_KVTRANSFER_FAMILY, else examples/family, which the repository ships)")
    p.add_argument("--calibration", help="text file to fit the mapper on (default: the family's calibration.txt)")
    p.add_argument("--num-sequences", type=int, default=64, help="calibration sequences (default 64)")
    p.add_argument("--seq-len", type=int, default=256, help="calibration sequence length (default 256)")
    p.add_argument("--top-k", default=None, help="source layers per target layer (default: fit_mapper's, 8; 'all')")
    p.add_argument("--exact-layers", type=int, default=None,
                   help="the target's first layers computed from the prompt's ids instead of mapped "
                        "(TransferredCache's num_exact_layers; default: the mapper's, chosen by its fit)")
    p.add_argument("--exact-layers-items", type=int, default=None, metavar="N",
                   help="items per content probe of the fit that chooses the exact layers (fit's option of that "
                        "name; default 64): fewer fit faster and choose less surely")
    p.add_argument("--prompt", help="prompt text (default: a held-out passage-recall question drawn from --text)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens to generate (default: the answer's length + 2 for a recall question, else 32)")
    p.add_argument("--text", help="documents to draw recall questions' distractors from (default: the family's heldout.txt)")
    p.add_argument("--recall-items", type=int, default=200,
                   help="held-out passage-recall questions behind the retention number (default 200; 0 = skip)")
    p.add_argument("--refit", action="store_true",
                   help="fit the mapper again: without --mapper a demo keeps the mapper it fits (in demo/ of "
                        "$HF_KVTRANSFER_CACHE, default ~/.cache/huggingface/hf-kvtransfer) and a later demo with the "
                        "same models and options reads it")
    p.add_argument("--device", default="cpu", help=_DEVICE_HELP)
    p.add_argument("--json", help="write the demo's numbers as JSON here")
    p.set_defaults(func=_run_demo)


def _run_demo(args) -> int:
    import json
    from pathlib import Path

    from ..core.mapper import KVMapper
    from .demo import format_demo, run_demo

    _require_files(args, "text")
    top_k = args.top_k if args.top_k in (None, "all") else int(args.top_k)
    # A given mapper loads before the models: a broken or mistyped one fails at once.
    mapper = KVMapper.from_pretrained(args.mapper) if args.mapper else None
    result = run_demo(
        args.source, args.target, mapper, family=args.family, prompt=args.prompt,
        max_new_tokens=args.max_new_tokens, calibration=args.calibration, num_sequences=args.num_sequences,
        seq_len=args.seq_len, top_k=top_k, num_exact_layers=args.exact_layers, text=args.text,
        recall_items=args.recall_items, device=args.device, exact_layers_items=args.exact_layers_items,
        refit=args.refit,
    )
    print(format_demo(result))
    if result.get("mapper_kept_in"):
        print(f"demo: the fitted mapper is kept in {result['mapper_kept_in']}: the same demo again reads it "
              "(--refit fits anew)", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
    return 0


_SUBCOMMANDS += [_add_demo, _add_eval]


# -- fit / solve (workflow.py), options generated from FitConfig ----------------------------------------------

_GROUP_TITLES = {
    "solve": "what is solved",
    "data": "calibration data",
    "fit": "the calibration pass",
    "exact": "exact layers (the target's first layers it computes itself; chosen after the solve)",
    "mlp": "MLP mapper (--mapper mlp; paper: 2 x 1024 ReLU units, Adam, MSE)",
}
_SOLVE_FIELDS = ("top_k", "ridge_lambda", "refit", "rank", "mapper_dtype")


def _add_config_options(parser: argparse.ArgumentParser, names=None) -> None:
    """One option per `FitConfig` field (its metadata: flag, help, group, choices); unset options keep the
    dataclass default, so defaults live in one place."""
    from ..fitting.config import fields_for_cli

    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in fields_for_cli(names):
        meta = f.metadata
        group = groups.get(meta["group"])
        if group is None:
            group = groups[meta["group"]] = parser.add_argument_group(_GROUP_TITLES[meta["group"]])
        flag = meta["cli"] or "--" + f.name.replace("_", "-")
        kwargs = {"dest": f.name, "help": meta["help"], "default": argparse.SUPPRESS}
        kind = str(f.type)
        if meta.get("invert"):
            kwargs["action"] = "store_false"
        elif meta.get("boolean_optional"):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind.startswith("bool"):
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = int if kind.startswith("int") else float if kind.startswith("float") else str
            for key in ("choices", "metavar"):
                if key in meta:
                    kwargs[key] = meta[key]
        group.add_argument(flag, **kwargs)


def fit_config_from_args(args):
    """The `FitConfig` of the options given on the command line (dataclass defaults for the rest)."""
    from ..fitting.config import FIELD_NAMES, FitConfig

    return FitConfig(**{name: value for name, value in vars(args).items() if name in FIELD_NAMES})




def _add_fit(subparsers) -> None:
    p = _subparser(
        subparsers,
        "fit",
        "fit a ridge KV mapper from calibration text (paper defaults: FineWeb-Edu, 500 x 1024 tokens, stride 4, "
        "k=8, lambda=0.01); resumable, distributed under torchrun",
        """
        hf-kvtransfer fit --source Qwen/Qwen3-0.6B --target Qwen/Qwen3-1.7B --output mappers/0.6b-to-1.7b
        hf-kvtransfer fit --source examples/family/small --target examples/family/large \\
            --dataset examples/family/calibration.txt --num-sequences 128 --seq-len 256 --top-k 1,2,all \\
            --output mappers/family-k
        torchrun --nproc-per-node 8 -m hf_kvtransfer.commands.cli fit --source Qwen/Qwen3-14B --target Qwen/Qwen3-32B \\
            --dtype bfloat16 --top-k auto --stats-dir stats/14b-32b --output mappers/14b-to-32b
        """,
    )
    p.add_argument("--source", required=True, help="source model id or local directory")
    p.add_argument("--target", required=True, help="target model id or local directory")
    p.add_argument("--output", required=True, help="mapper directory (one subdirectory per k when several)")
    p.add_argument("--dtype", default="auto", help="model dtype: auto (the checkpoint's on a GPU, float32 on the CPU), float32, bfloat16, float16 "
                   "(default auto)")
    p.add_argument("--device-map", help="accelerate device map for both models, e.g. auto or cuda:0")
    p.add_argument("--source-revision", help="source model revision")
    p.add_argument("--target-revision", help="target model revision")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the model repos' own modelling code (only for repos you trust; transformers' flag)")
    p.add_argument("--push-to-hub", metavar="REPO", help="also upload the mapper to this Hub repo")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    _add_config_options(p)
    p.set_defaults(func=_run_fit)


def _journaled_scores(where: Path | None) -> int:
    """The probe scores an interrupted fit kept (`fitting/probe_journal.py`: one line each after a header)."""
    if where is None or not where.is_dir():
        return 0
    return sum(max(0, len(f.read_text(encoding="utf-8").splitlines()) - 1) for f in where.glob("probe-journal-*.jsonl"))


def _run_fit(args) -> int:
    from ..core.progress import write_line
    from .workflow import fit_and_save, fit_checkpoint_dir

    config = fit_config_from_args(args)
    try:
        results = fit_and_save(
            args.source, args.target, args.output, config, dtype=args.dtype, device_map=args.device_map,
            source_revision=args.source_revision, target_revision=args.target_revision,
            trust_remote_code=args.trust_remote_code, push_to_hub=args.push_to_hub, overwrite=args.overwrite,
            log=write_line,
        )  # fmt: skip
    except KeyboardInterrupt as exc:
        where = fit_checkpoint_dir(args.output, config)
        saved = sorted(where.glob("checkpoint-*.safetensors")) if where is not None and where.is_dir() else []
        done = str(exc).split(";")[0].removeprefix("interrupted ") if str(exc).startswith("interrupted after") else ""
        scores = _journaled_scores(where)
        if saved:
            kept = f"the statistics and {scores} probe score{'s' if scores != 1 else ''}" if scores else "the statistics so far"
            args.interrupted_message = (
                f"interrupted{' ' + done if done else ''}; {kept} are checkpointed in {where}\n"
                "hint: run the same command again to resume from there"
            )
        else:
            args.interrupted_message = "interrupted before a checkpoint was written: running the command again starts over"
        raise
    _print_written(results)
    return 0


_SUBCOMMANDS += [_add_fit]


def _print_written(results) -> None:
    from ..core.map_inputs import maps_read

    def mean(values):
        return f"{sum(values) / len(values):.4f}" if values else "-"

    for path, mapper in results:
        c = mapper.config
        print(
            f"wrote {path}: k={c.top_k} lambda={c.ridge_lambda:g} fit R^2 K/V {mean(c.fit_r2_key)}/{mean(c.fit_r2_value)}"
            f" held-out R^2 K/V {mean(c.heldout_r2_key)}/{mean(c.heldout_r2_value)}"
            + (f" rank {sum(map(sum, c.rank))} total" if c.rank else "")
            + f", {mapper.num_parameters():,} parameters ({next(mapper.parameters()).dtype})".replace("torch.", "")
            + f", {mapper.num_exact_layers} of {mapper.target_layout.num_layers} target layers computed exactly"
            + (f" within a window of {c.exact_window} tokens" if c.exact_window else "")
            + (f"; what the other layers' maps read: {maps_read(c, mapper.num_exact_layers)}"
               if mapper.num_exact_layers < mapper.target_layout.num_layers else "")  # fmt: skip
        )


def _add_solve(subparsers) -> None:
    p = _subparser(
        subparsers,
        "solve",
        "solve mappers from statistics a fit kept (--stats-dir): any k, lambda, rank or weight dtype, no models loaded",
        """
        hf-kvtransfer fit --source examples/family/small --target examples/family/large \\
            --dataset examples/family/calibration.txt --num-sequences 128 --seq-len 256 --top-k 4 \\
            --stats-dir stats/family --output mappers/family-k4
        hf-kvtransfer solve --stats-dir stats/family --top-k 4 --rank energy=0.99 --mapper-dtype bfloat16 \\
            --output mappers/family-k4-small
        """,
    )
    p.add_argument("--stats-dir", required=True, help="the --stats-dir of a fit (holds train/ and maybe heldout/)")
    p.add_argument("--output", required=True, help="mapper directory (one subdirectory per k when several)")
    _add_config_options(p, _SOLVE_FIELDS)
    p.add_argument("--push-to-hub", metavar="REPO", help="also upload the mapper to this Hub repo")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    p.set_defaults(func=_run_solve)


def _run_solve(args) -> int:
    from ..core.progress import write_line
    from .workflow import solve_and_save

    results = solve_and_save(
        args.stats_dir, args.output, fit_config_from_args(args), push_to_hub=args.push_to_hub, overwrite=args.overwrite,
        log=write_line,
    )  # fmt: skip
    _print_written(results)
    return 0


_SUBCOMMANDS += [_add_solve]


# -- plan (plan.py) ------------------------------------------------------------------------------------------


def _add_plan(subparsers) -> None:
    p = _subparser(
        subparsers,
        "plan",
        "sizes and costs of a mapper from the two configs alone (no weights): parameters and bytes, fit statistics "
        "(full / two-stage, and which one fit picks here), FLOPs vs the target's prefill, FLOPs to the first token "
        "(exact layers, maps, recomputed tokens, and what each map input adds), transfer memory",
        """
        hf-kvtransfer plan --source Qwen/Qwen3-14B --target Qwen/Qwen3-32B --top-k 8 --seq-len 32768
        hf-kvtransfer plan --source meta-llama/Llama-3.2-1B --target meta-llama/Llama-3.2-3B --rank 256 --json
        hf-kvtransfer plan --source meta-llama/Llama-3.1-8B --target meta-llama/Llama-3.1-70B --exact-layers 4 \\
            --residual-positions 2 --offline
        hf-kvtransfer plan --source Qwen/Qwen3-0.6B --target Qwen/Qwen3-1.7B --exact-layers 3 --exact-window 128 \\
            --residual-rank 256 --seq-len 1024 --offline
        hf-kvtransfer plan --source Qwen/Qwen3-0.6B --target Qwen/Qwen3-1.7B --max-statistics-memory 96 --offline
        """,
    )
    p.add_argument("--source", required=True, help="Hub id, local model folder or config.json (known families work offline)")
    p.add_argument("--target", required=True, help="Hub id, local model folder or config.json")
    p.add_argument("--top-k", type=int, default=8, help="source layers per target layer (default 8)")
    p.add_argument("--rank", type=int, help="reduced rank of every map (default: full rank)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens transferred, for FLOPs and memory (default 4096)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences transferred at once (default 1)")
    p.add_argument("--dtype", default="bfloat16", help="mapper weights and KV caches: bfloat16 (default), float16, float32")
    p.add_argument("--available-memory", type=float, metavar="GIB", help="memory for the fit statistics (default: free RAM)")
    p.add_argument("--max-statistics-memory", type=float, metavar="GIB",
                   help="the fit's statistics budget, as `fit --max-statistics-memory`: which K/V statistics and how many "
                   "residual layers a fit would collect within it (default: the fit's, half the free memory for the K/V "
                   "sums and 4 GiB for the residual sums)")
    p.add_argument("--exact-layers", type=int, metavar="N",
                   help="target layers the transfer computes itself, for the first-token FLOPs (default: "
                   "TransferredCache's for a mapper that records none, 1; a fit's content probe chooses a mapper's)")
    p.add_argument("--recompute-tokens", type=int, metavar="N",
                   help="prompt tokens the target recomputes, for the first-token FLOPs (default 32, at most half)")
    p.add_argument("--exact-window", type=int, metavar="N",
                   help="the exact layers attend within N tokens, for the first-token FLOPs (default: the whole prompt; "
                        "a fit records a window where its content gate accepts one)")  # fmt: skip
    # The residual input's `plan_positions` option (the parser imports no map input: they pull in torch); its default
    # is the input's `plan_default_positions`.
    p.add_argument("--residual-positions", type=int, metavar="P",
                   help="cost maps that also read P positions (t, t-1, ...) of the target's residual stream after the "
                   "exact layers: mapper size and FLOPs to the first token (default 3, what a default fit reads; 0 leaves it out)")
    p.add_argument("--residual-rank", type=int, metavar="R",
                   help="cost those maps through one projection of the residual features to rank R shared by every "
                   "layer, as `fit --residual-rank R` (or the fit's reduced-rank candidate) saves them (default: full rank)")
    p.add_argument("--offline", action="store_true", help="never ask the Hub: local paths and the shipped configs only")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run_plan)


def _run_plan(args) -> int:
    import json

    from .plan import format_plan, plan_transfer

    plan = plan_transfer(
        args.source, args.target, top_k=args.top_k, rank=args.rank, seq_len=args.seq_len, dtype=args.dtype,
        batch_size=args.batch_size, use_hub=not args.offline, num_exact_layers=args.exact_layers,
        num_recompute_tokens=args.recompute_tokens, exact_window=args.exact_window,
        **({} if args.residual_positions is None else {"residual_positions": args.residual_positions}),
        **({} if args.residual_rank is None else {"residual_rank": args.residual_rank}),
        available_memory=int(args.available_memory * 2**30) if args.available_memory else None,
        max_statistics_memory=args.max_statistics_memory,
    )  # fmt: skip
    print(json.dumps(plan.to_dict(), indent=2, sort_keys=True) if args.json else format_plan(plan))
    return 0


_SUBCOMMANDS += [_add_plan]


# -- bench (bench.py) ----------------------------------------------------------------------------------------

# Where `hf-kvtransfer bench` without --source/--target takes its shapes from: the bundled family's configs, as the
# repository lays them out (or $HF_KVTRANSFER_FAMILY).
_BENCH_FAMILY = os.path.join("examples", "family")


def _add_bench(subparsers) -> None:
    p = _subparser(
        subparsers,
        "bench",
        "time to first token at the mapper's defaults (its exact layers and recomputed tokens) and all mapped, "
        "against the target's own prefill; the transfer itself, the decode step and memory, over sequence lengths; "
        "writes bench.json, bench.md and bench.png (runs with OMP_WAIT_POLICY=PASSIVE)",
        """
        hf-kvtransfer bench --seq-lens 512 1024 4096 --ranks full 8 --output-dir bench_out
        hf-kvtransfer bench --source examples/family/small --target examples/family/large \\
            --mapper mappers/s2l --seq-lens 512 1024 4096 --threads 1
        hf-kvtransfer bench --source Qwen/Qwen3-0.6B --target Qwen/Qwen3-1.7B --random-weights --exact-layers 4
        hf-kvtransfer bench --quick --device cuda      # < 3 minutes on one GPU
        """,
    )
    # Defaults live in BenchConfig: an option not given is not set here (SUPPRESS), and BenchConfig's applies.
    unset = argparse.SUPPRESS
    _add_bench_models(p, unset)
    _add_bench_mappers(p, unset)
    _add_bench_measurements(p, unset)
    p.set_defaults(func=_run_bench)


def _add_bench_models(p: argparse.ArgumentParser, unset: str) -> None:
    """`bench`'s models and mappers to time, and the transfer settings of time to first token."""
    p.add_argument("--source", default=unset, help="source model dir / Hub id (with --random-weights, its config); "
                   f"default: the configs of {_BENCH_FAMILY}/small and large (or of $HF_KVTRANSFER_FAMILY's pair) with "
                   "random weights")  # fmt: skip
    p.add_argument("--target", default=unset, help="target model dir / Hub id")
    p.add_argument("--random-weights", action="store_true", default=unset,
                   help="time models of the --source/--target configs with random weights (no checkpoints needed)")
    p.add_argument("--mapper", dest="mappers", action="append", default=unset, metavar="[NAME=]PATH",
                   help="a saved mapper to time (repeatable; the first one gives time to first token); without one, "
                   "mappers are solved here (see --ranks)")
    p.add_argument("--exact-layers", type=int, default=unset, metavar="N",
                   help="the target's first layers it computes itself in time to first token at the defaults "
                   "(default: the mapper's, chosen by its fit's content probe; a mapper solved here has no probe and "
                   "records none, so TransferredCache's default, 1)")
    p.add_argument("--recompute-tokens", type=int, default=unset, metavar="N",
                   help="prompt tokens the target recomputes in time to first token at the defaults (default: "
                   "TransferredCache's, 32, at most half a shorter prompt)")


def _add_bench_mappers(p: argparse.ArgumentParser, unset: str) -> None:
    """`bench`'s mappers solved on the spot: their statistics, held-out scoring, top-k and ranks."""
    p.add_argument("--statistics", default=unset, help="saved KVStatistics to solve mappers from (else collected here)")
    p.add_argument("--calibration-text", default=unset, help="text file for the statistics (tokenized with --target's "
                   "tokenizer); default: random tokens, fine for timing")
    p.add_argument("--calibration-tokens", type=int, default=unset, help="tokens of calibration (default 16384)")
    p.add_argument("--heldout-tokens", type=int, default=unset,
                   help="also report held-out K/V R^2 per mapper (and with bf16-rounded weights) on this many tokens "
                   "of --heldout-text (default: random tokens); 0 skips (default)")
    p.add_argument("--heldout-text", default=unset, help="text file for --heldout-tokens (tokenized with --target's tokenizer)")
    p.add_argument("--top-k", default=unset, help="source layers per target layer for solved mappers (default 4)")
    p.add_argument("--ranks", nargs="+", default=unset,
                   help="mappers to solve: full, an integer rank, energy=0.99, budget=0.25, each optionally with "
                   "another top-k as kN:SPEC (k1:full) and a weight/compute dtype as SPEC@bf16 (full@bf16); the "
                   "first one is also used for TTFT and decode (default: full 16 8)")


def _add_bench_measurements(p: argparse.ArgumentParser, unset: str) -> None:
    """`bench`'s measurements (lengths, repeats, device, what is timed) and where the results go."""
    from ..evaluation import timing  # the default lengths, without importing torch for `--help`

    p.add_argument("--seq-lens", type=int, nargs="+", default=unset,
                   help=f"context lengths (default {' '.join(map(str, timing.DEFAULT_SEQ_LENS))})")
    p.add_argument("--repeats", type=int, default=unset, help="timed repeats per measurement (default 5, quick 3)")
    p.add_argument("--warmup", type=int, default=unset, help="untimed warm-up calls (default 1)")
    p.add_argument("--decode-steps", type=int, default=unset, help="decode steps timed per repeat (default 8, quick 4)")
    p.add_argument("--device", default=unset, help="cuda / cpu (default: cuda when available)")
    p.add_argument("--dtype", default=unset, choices=["float32", "bfloat16", "float16"],
                   help="model and mapper dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--threads", type=int, default=unset, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--quick", action="store_true",
                   help=f"seq lens {' '.join(map(str, timing.QUICK_SEQ_LENS))}, 3 repeats, 4 decode steps, ranks full 8 "
                   "(options given explicitly win)")
    p.add_argument("--no-ttft", dest="ttft", action="store_false", default=unset, help="skip time to first token")
    p.add_argument("--no-decode", dest="decode", action="store_false", default=unset, help="skip the decode-step comparison")
    p.add_argument("--output-dir", default="bench_results", help="where bench.json/.md/.png go (default %(default)s)")
    p.add_argument("--no-reexec", action="store_true",
                   help="do not re-execute with OMP_WAIT_POLICY=PASSIVE when it is unset (it is recorded either way)")


def _reexec_with_passive_omp(argv: list[str]) -> None:
    """Re-run this command with `OMP_WAIT_POLICY=PASSIVE` unless the user set a policy: OpenMP reads it when torch
    loads, i.e. before a subcommand runs, and busy-waiting threads make small CPU ops cost milliseconds."""
    if "OMP_WAIT_POLICY" in os.environ:
        return
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "hf_kvtransfer.commands.cli", *argv], env)


def _bench_config(args):
    """The `BenchConfig` of the parsed arguments: the options given, and the bundled family's configs with random
    weights when neither --source nor --target is."""
    import dataclasses

    from .bench import BenchConfig

    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(BenchConfig) if hasattr(args, f.name)}
    if "source" not in given and "target" not in given:
        from .demo import family_pair

        family = os.environ.get("HF_KVTRANSFER_FAMILY") or _BENCH_FAMILY
        pair = family_pair(family, needs="config.json")
        if pair is None:
            raise CLIError(
                f"no --source/--target given and no model family at {family} (small/ and large/, or source/ and "
                "target/, with config.json)",
                "pass --source and --target (model folders or Hub ids; add --random-weights to time their configs "
                "with random weights), run from the repository root, or set HF_KVTRANSFER_FAMILY",
            )
        if given.get("mappers"):
            raise CLIError("--mapper needs the --source and --target it was fit for")
        given.update(source=str(pair[0]), target=str(pair[1]), random_weights=True)
    elif "source" not in given or "target" not in given:
        raise CLIError("give both --source and --target, or neither (random weights of the bundled family's configs)")
    source, target = given.pop("source"), given.pop("target")
    return BenchConfig.quick(source, target, **given) if args.quick else BenchConfig(source, target, **given)


def _run_bench(args) -> int:
    from .bench import run
    from .reporting import bench_markdown, save_bench_report

    if not args.no_reexec and args.command_line is not None:
        _reexec_with_passive_omp(args.command_line)
    config = _bench_config(args)
    report = run(config, announce=print)
    if args.command_line is not None:
        import shlex

        report["settings"]["command"] = shlex.join(["hf-kvtransfer", *args.command_line])
    paths = save_bench_report(report, args.output_dir)
    logging.getLogger(__name__).info("wrote %s", ", ".join(str(p) for p in paths.values()))
    print(bench_markdown(report), end="")
    print(f"results in {args.output_dir}/bench.{{json,md,png}}")
    return 0


_SUBCOMMANDS += [_add_bench]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # The process's own command line (None when called from Python): what `bench` re-executes itself with.
    args.command_line = sys.argv[1:] if argv is None else None
    if args.command is None:
        parser.print_help()
        return 2
    from ..core.progress import LineHandler, transformers_bars_as_lines

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s",
                        handlers=[LineHandler()])  # fmt: skip
    transformers_bars_as_lines()
    debug = args.debug or os.environ.get("HF_DEBUG", "").lower() in ("1", "true", "yes")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(getattr(args, "interrupted_message", None) or "interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug or not _is_user_error(exc):
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__  # one line, whatever the exception held
        if hasattr(args, "token"):  # the library's "pass token=" is this command's --token
            message = message.replace("pass token=", "pass --token")
        print(f"error: {message}", file=sys.stderr)
        hint = _hint(exc, args)
        if hint:
            print(f"hint: {hint}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
