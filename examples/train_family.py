#!/usr/bin/env python
"""Train a tiny, deterministic family of Qwen3 models with matched KV geometry.

Two ``Qwen3ForCausalLM`` models ("small" and "large") of different depth and
width are trained from scratch on the same text with one shared byte-level BPE
tokenizer.  Both use ``num_key_value_heads=2`` and ``head_dim=32`` so their
KV caches have the same per-layer shape, which is what the KV-transfer
examples and benchmarks in this repository need.

Data: the reStructuredText sources of the Python 3.11 documentation, as
installed by Debian's ``python3.11-doc`` package (PSF licensed)::

    apt-get install -y python3.11-doc
    # -> /usr/share/doc/python3.11/html/_sources/**/*.rst.txt

The ``*.rst.txt`` files are sorted by relative path; every ``--heldout-every``
-th file (index % N == N - 1) is held out for evaluation, the rest is used for
tokenizer and model training.

Outputs (under ``--output-dir``)::

    small/  large/       save_pretrained checkpoints (bf16 safetensors) + tokenizer
    tokenizer/           the shared tokenizer on its own
    heldout.txt          sample of held-out documents (evaluation text)
    calibration.txt      sample of training documents (for fitting mappers)
    train_log.txt        progress log
    results.json         configs, parameter counts, timings and losses

Example (trains both models with the default settings; ~15-25 min of CPU on 2
cores when the machine is otherwise idle, much longer when it is shared)::

    python examples/train_family.py --output-dir examples/family

The committed checkpoints were trained one model per run (results are bitwise
reproducible for a given ``--threads`` value and software versions)::

    python examples/train_family.py --models small --threads 2 --steps-small 900 --eval-every 0
    python examples/train_family.py --models large --threads 1 --steps-large 1000 --eval-every 0

Verify the saved checkpoints (held-out loss on heldout.txt, greedy samples)::

    python examples/train_family.py --output-dir examples/family --verify

Quick smoke test (a few seconds, writes to /tmp)::

    python examples/train_family.py --output-dir /tmp/family_smoke \\
        --steps-small 5 --steps-large 5 --eval-batches 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

DEFAULT_SOURCES = "/usr/share/doc/python3.11/html/_sources"
EOS = "<|endoftext|>"
PAD = "<|pad|>"

# Family definitions.  KV geometry (num_key_value_heads, head_dim) is shared.
FAMILY = {
    # 4 query heads x 32 on a 64-wide residual stream: GQA like the large one, and clearly weaker than it.
    "small": dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, intermediate_size=192),
    "large": dict(num_hidden_layers=8, hidden_size=192, num_attention_heads=6, intermediate_size=576),
}
KV_HEADS = 2
HEAD_DIM = 32


def log(msg: str, fh=None) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if fh is not None:
        fh.write(line + "\n")
        fh.flush()


# --------------------------------------------------------------------------- data
def list_documents(sources: Path) -> list[Path]:
    files = sorted(sources.rglob("*.rst.txt"), key=lambda p: p.relative_to(sources).as_posix())
    if not files:
        sys.exit(
            f"no *.rst.txt files under {sources}; install them with "
            "`apt-get install -y python3.11-doc` or pass --sources-dir"
        )
    return files


def split_documents(files: list[Path], every: int) -> tuple[list[Path], list[Path]]:
    train = [f for i, f in enumerate(files) if i % every != every - 1]
    held = [f for i, f in enumerate(files) if i % every == every - 1]
    return train, held


def read_doc(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace").strip()


def write_sample(path: Path, docs: list[str], target_bytes: int) -> int:
    """Write whole documents, separated by a line holding only EOS, until ~target_bytes.

    The last document is truncated (at a line boundary) so the file stays near the target.
    """
    out, size = [], 0
    for d in docs:
        enc = len(d.encode("utf-8"))
        if size + enc > target_bytes:
            lines, keep, acc = d.split("\n"), [], 0
            for ln in lines:
                acc += len(ln.encode("utf-8")) + 1
                if size + acc > target_bytes:
                    break
                keep.append(ln)
            if keep:
                out.append("\n".join(keep).rstrip())
            break
        out.append(d)
        size += enc + len(EOS) + 2
    text = f"\n{EOS}\n".join(out) + "\n"
    path.write_text(text, encoding="utf-8")
    return len(text.encode("utf-8"))


# --------------------------------------------------------------------------- tokenizer
def train_tokenizer(train_docs: list[str], vocab_size: int, out_dir: Path, model_max_length: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_docs, trainer=trainer, length=len(train_docs))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=None,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out_dir)
    return fast


def encode_stream(tok, docs: list[str]):
    """Concatenate documents into one token stream, each document followed by EOS."""
    import torch

    ids: list[int] = []
    for enc in tok.backend_tokenizer.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


# --------------------------------------------------------------------------- model
def make_config(name: str, tok, max_pos: int):
    from transformers import Qwen3Config

    spec = FAMILY[name]
    return Qwen3Config(
        vocab_size=len(tok),
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=max_pos,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        attention_dropout=0.0,
        rms_norm_eps=1e-6,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        use_cache=True,
        **spec,
    )


def lm_loss(model, batch):
    import torch.nn.functional as F

    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))


def evaluate(model, windows, batch_size: int, max_batches: int | None) -> float:
    import torch

    model.eval()
    tot, n = 0.0, 0
    with torch.no_grad():
        for bi, i in enumerate(range(0, windows.size(0), batch_size)):
            if max_batches is not None and bi >= max_batches:
                break
            b = windows[i : i + batch_size]
            tot += lm_loss(model, b).item() * b[:, 1:].numel()
            n += b[:, 1:].numel()
    model.train()
    return tot / max(n, 1)


def windows_of(stream, seq_len: int):
    n = (stream.numel() - 1) // seq_len
    # windows of seq_len+1 tokens that overlap by one token (input/target pairs)
    return stream[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len).contiguous()


def train_one(name, args, tok, train_windows, held_windows, out_dir: Path, fh) -> dict:
    import torch
    from transformers import Qwen3ForCausalLM

    steps = args.steps_small if name == "small" else args.steps_large
    lr = args.lr_small if name == "small" else args.lr_large
    torch.manual_seed(args.seed)
    config = make_config(name, tok, args.max_position_embeddings)
    model = Qwen3ForCausalLM(config).float()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.get_input_embeddings().weight.numel()
    log(
        f"[{name}] layers={config.num_hidden_layers} hidden={config.hidden_size} "
        f"heads={config.num_attention_heads} kv_heads={config.num_key_value_heads} "
        f"head_dim={config.head_dim} ffn={config.intermediate_size} params={n_params:,} "
        f"(non-embedding {n_params - n_embed:,}); steps={steps} bs={args.batch_size} lr={lr}",
        fh,
    )

    decay = [p for n_, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n_, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    warmup = max(1, int(args.warmup_frac * steps))

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        prog = (step - warmup) / max(1, steps - warmup)
        return args.min_lr_frac * lr + (1 - args.min_lr_frac) * lr * 0.5 * (1 + math.cos(math.pi * prog))

    # Deterministic data order: a fresh seeded permutation of all windows per epoch.
    gen = torch.Generator().manual_seed(args.seed + 1)
    order, pos, epoch = torch.randperm(train_windows.size(0), generator=gen), 0, 0
    if args.compile:
        # compiled forward+loss (inductor, CPU): ~1.5x faster after a ~1 min warm-up
        loss_fn = torch.compile(lambda b: lm_loss(model, b))
    else:
        loss_fn = lambda b: lm_loss(model, b)  # noqa: E731
    t0, c0 = time.time(), time.process_time()
    t_last, s_last = t0, 0
    ema = None
    for step in range(steps):
        if pos + args.batch_size > order.numel():
            order, pos, epoch = torch.randperm(train_windows.size(0), generator=gen), 0, epoch + 1
        batch = train_windows[order[pos : pos + args.batch_size]]
        pos += args.batch_size
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = loss_fn(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        li = loss.item()
        ema = li if ema is None else 0.98 * ema + 0.02 * li
        if (step + 1) % args.log_every == 0 or step == 0 or step + 1 == steps:
            now = time.time()
            el = now - t0
            tps = (step + 1 - s_last) * args.batch_size * args.seq_len / max(now - t_last, 1e-9)
            t_last, s_last = now, step + 1
            log(
                f"[{name}] step {step + 1}/{steps} ep {epoch} loss {li:.4f} ema {ema:.4f} "
                f"lr {lr_at(step):.2e} {tps:,.0f} tok/s elapsed {el / 60:.1f} min",
                fh,
            )
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 != steps:
            hl = evaluate(model, held_windows, args.batch_size, args.eval_batches)
            log(f"[{name}] step {step + 1} held-out loss {hl:.4f}", fh)
    train_time = time.time() - t0
    train_cpu = time.process_time() - c0
    train_tokens = steps * args.batch_size * args.seq_len

    log(f"[{name}] training done in {train_time / 60:.1f} min wall, {train_cpu / 60:.1f} min CPU; evaluating...", fh)
    held_fp32 = evaluate(model, held_windows, args.batch_size, args.eval_batches)
    # train loss measured on a fixed deterministic subset of training windows (same #windows as held-out)
    sub = torch.randperm(train_windows.size(0), generator=torch.Generator().manual_seed(1234))
    sub = train_windows[sub[: held_windows.size(0)]]
    train_fp32 = evaluate(model, sub, args.batch_size, args.eval_batches)

    dst = out_dir / name
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(dst, safe_serialization=True)
    tok.save_pretrained(dst)
    # loss of the saved (bf16) weights evaluated in fp32
    model.float()
    held_saved = evaluate(model, held_windows, args.batch_size, args.eval_batches)
    train_saved = evaluate(model, sub, args.batch_size, args.eval_batches)
    log(
        f"[{name}] train loss {train_fp32:.4f} held-out loss {held_fp32:.4f} (fp32 weights); "
        f"after bf16 rounding: train {train_saved:.4f} held-out {held_saved:.4f}; saved to {dst}",
        fh,
    )
    return {
        "config": {
            "num_hidden_layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "intermediate_size": config.intermediate_size,
            "vocab_size": config.vocab_size,
            "max_position_embeddings": config.max_position_embeddings,
        },
        "params": n_params,
        "non_embedding_params": n_params - n_embed,
        "steps": steps,
        "epochs_seen": round(train_tokens / (train_windows.numel() - train_windows.size(0)), 3),
        "train_tokens": train_tokens,
        "lr": lr,
        "train_time_s": round(train_time, 1),
        "train_cpu_s": round(train_cpu, 1),
        "threads": args.threads,
        "train_loss_fp32": round(train_fp32, 4),
        "heldout_loss_fp32": round(held_fp32, 4),
        "train_loss_bf16_saved": round(train_saved, 4),
        "heldout_loss_bf16_saved": round(held_saved, 4),
    }


# --------------------------------------------------------------------------- verification
def verify(args) -> None:
    """Reload the saved checkpoints standalone and report held-out loss + greedy samples."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    out = Path(args.output_dir)
    text = (out / "heldout.txt").read_text(encoding="utf-8")
    prompts = ["The :mod:`json` module", "def fibonacci(n):\n", "An exception is raised when"]
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        d = out / name
        tok = AutoTokenizer.from_pretrained(d)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
        print(f"== {name}: {type(model).__name__} {sum(p.numel() for p in model.parameters()):,} params; "
              f"heldout.txt = {ids.numel():,} tokens")
        for T in args.verify_lengths:
            n = (ids.numel() - 1) // T
            w = ids[: n * T + 1].unfold(0, T + 1, T)
            tot = cnt = 0.0
            with torch.no_grad():
                for i in range(0, n, max(1, 4096 // T)):
                    b = w[i : i + max(1, 4096 // T)]
                    logits = model(input_ids=b[:, :-1], use_cache=False).logits
                    tot += F.cross_entropy(logits.reshape(-1, logits.size(-1)), b[:, 1:].reshape(-1), reduction="sum").item()
                    cnt += b[:, 1:].numel()
            print(f"   held-out loss @ T={T}: {tot / cnt:.4f} nats/token ({n} windows)")
        for pr in prompts:
            enc = tok(pr, return_tensors="pt", add_special_tokens=False)
            with torch.no_grad():
                g = model.generate(**enc, max_new_tokens=48, do_sample=False, pad_token_id=tok.pad_token_id)
            print(f"   --- greedy from {pr!r}:\n{tok.decode(g[0])}")


# --------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "example:\n"
            "  apt-get install -y python3.11-doc\n"
            "  python examples/train_family.py --output-dir examples/family\n"
            "  python examples/train_family.py --output-dir /tmp/fam --models small --steps-small 200\n"
            "  python examples/train_family.py --output-dir examples/family --verify\n"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--output-dir", default="examples/family", help="where to write everything (default: %(default)s)")
    p.add_argument("--sources-dir", default=DEFAULT_SOURCES, help="root of the *.rst.txt files (default: %(default)s)")
    p.add_argument("--models", default="small,large", help="comma-separated subset of: small,large (default: %(default)s)")
    p.add_argument("--steps-small", type=int, default=900, help="optimizer steps for the small model (default: %(default)s)")
    p.add_argument("--steps-large", type=int, default=1000, help="optimizer steps for the large model (default: %(default)s)")
    p.add_argument(
        "--epochs",
        type=float,
        default=None,
        help="if given, overrides --steps-*: train each model for this many passes over the training windows",
    )
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=256, help="training sequence length (default: %(default)s)")
    p.add_argument("--lr-small", type=float, default=3e-3, help="peak LR, small model (default: %(default)s)")
    p.add_argument("--lr-large", type=float, default=2e-3, help="peak LR, large model (default: %(default)s)")
    p.add_argument("--min-lr-frac", type=float, default=0.1, help="cosine floor as a fraction of peak (default: %(default)s)")
    p.add_argument("--warmup-frac", type=float, default=0.03, help="warmup fraction of steps (default: %(default)s)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (default: %(default)s)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clip (default: %(default)s)")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (default: %(default)s)")
    p.add_argument("--heldout-every", type=int, default=20, help="hold out every N-th document (default: %(default)s)")
    p.add_argument("--max-position-embeddings", type=int, default=8192, help="config context limit (default: %(default)s)")
    p.add_argument("--sample-kb", type=int, default=300, help="size of heldout.txt / calibration.txt in KB (default: %(default)s)")
    p.add_argument("--eval-every", type=int, default=600, help="held-out eval interval in steps, 0 = off (default: %(default)s)")
    p.add_argument("--eval-batches", type=int, default=None, help="cap on eval batches (default: all held-out windows)")
    p.add_argument("--log-every", type=int, default=50, help="log interval in steps (default: %(default)s)")
    p.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=True,
        help="torch.compile the training forward/backward (default: %(default)s)",
    )
    p.add_argument(
        "--verify", action="store_true",
        help="only reload the saved checkpoints, print held-out loss on heldout.txt and greedy samples",
    )
    p.add_argument(
        "--verify-lengths", type=int, nargs="+", default=[256, 1024, 4096],
        help="context lengths for --verify losses (default: %(default)s)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.verify:
        return verify(args)
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.use_deterministic_algorithms(True)

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    fh = open(out / "train_log.txt", "a", encoding="utf-8")
    log(f"args: {vars(args)}", fh)
    log(f"torch {torch.__version__}, threads {torch.get_num_threads()}", fh)

    sources = Path(args.sources_dir)
    files = list_documents(sources)
    train_f, held_f = split_documents(files, args.heldout_every)
    train_docs = [read_doc(f) for f in train_f]
    held_docs = [read_doc(f) for f in held_f]
    train_docs = [d for d in train_docs if d]
    held_docs = [d for d in held_docs if d]
    log(
        f"{len(files)} documents: {len(train_docs)} train ({sum(map(len, train_docs)) / 1e6:.2f} M chars), "
        f"{len(held_docs)} held-out ({sum(map(len, held_docs)) / 1e6:.2f} M chars)",
        fh,
    )
    (out / "heldout_files.txt").write_text(
        "\n".join(f.relative_to(sources).as_posix() for f in held_f) + "\n", encoding="utf-8"
    )

    n = write_sample(out / "heldout.txt", held_docs, args.sample_kb * 1024)
    # calibration: deterministic sample of training documents (shuffled by a seeded RNG)
    cal_docs = list(train_docs)
    random.Random(args.seed).shuffle(cal_docs)
    m = write_sample(out / "calibration.txt", cal_docs, args.sample_kb * 1024)
    log(f"wrote heldout.txt ({n / 1024:.0f} KB) and calibration.txt ({m / 1024:.0f} KB)", fh)

    t = time.time()
    tok = train_tokenizer(train_docs, args.vocab_size, out / "tokenizer", args.max_position_embeddings)
    log(f"tokenizer: vocab {len(tok)} trained in {time.time() - t:.1f}s", fh)

    t = time.time()
    train_stream = encode_stream(tok, train_docs)
    held_stream = encode_stream(tok, held_docs)
    train_w = windows_of(train_stream, args.seq_len)
    held_w = windows_of(held_stream, args.seq_len)
    chars = sum(map(len, train_docs))
    log(
        f"encoded in {time.time() - t:.1f}s: train {train_stream.numel():,} tokens "
        f"({chars / train_stream.numel():.2f} chars/token) -> {train_w.size(0)} windows; "
        f"held-out {held_stream.numel():,} tokens -> {held_w.size(0)} windows",
        fh,
    )

    results_path = out / "results.json"
    data = {
        "documents": len(files),
        "train_documents": len(train_docs),
        "heldout_documents": len(held_docs),
        "train_tokens": int(train_stream.numel()),
        "heldout_tokens": int(held_stream.numel()),
        "train_windows": int(train_w.size(0)),
        "heldout_windows": int(held_w.size(0)),
        "seq_len": args.seq_len,
        "vocab_size": len(tok),
    }
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        if name not in FAMILY:
            sys.exit(f"unknown model {name!r}; choose from {sorted(FAMILY)}")
        if args.epochs is not None:
            steps = max(1, int(args.epochs * train_w.size(0) / args.batch_size))
            setattr(args, f"steps_{name}", steps)
        res = train_one(name, args, tok, train_w, held_w, out, fh)
        res["command_args"] = " ".join(sys.argv[1:])
        # re-read before writing so separate runs (e.g. --models small / --models large) merge
        results = json.loads(results_path.read_text()) if results_path.exists() else {}
        results["data"], results[name] = data, res
        results_path.write_text(json.dumps(results, indent=2) + "\n")
    log(f"done; results in {results_path}", fh)


if __name__ == "__main__":
    main()
