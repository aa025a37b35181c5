#!/usr/bin/env python
"""Train a tiny, deterministic family of Qwen3 models that reads its context.

Two ``Qwen3ForCausalLM`` models ("small" and "large") of different depth and width are trained from
scratch on the same data with one shared byte-level BPE tokenizer. Both use ``num_key_value_heads=2``
and ``head_dim=32``, so their KV caches have the same per-layer shape (what the KV-transfer examples and
benchmarks in this repository need). ``small_kv4`` (small's shape with 4 KV heads of dimension 16; committed,
see research/family_builder/README.md) and ``large_kv4`` (4 KV heads; not trained) give pairs with different KV geometry.

Training rows are ``--seq-len`` (512) tokens drawn from a mix that rewards reading the context:

- ``text``:     windows of the Python 3.11 reST docs (Debian ``python3.11-doc``, PSF licensed);
- ``copy``:     random-token spans that repeat (induction); early rows are periodic, later rows embed
                the spans in text with gaps. Loss on a span's first occurrence is masked (unpredictable);
- ``textcopy``: a text window in which an earlier chunk of the window is repeated later;
- ``facts``:    passage of made-up API facts + distractor text + questions answered only by the passage
                (``hf_kvtransfer.evaluation.tasks.fact_document``, split "train"; evaluation uses split "eval").

The mix follows a curriculum (``--copy-phase``): periodic copy rows first, then the full mix. In the copy
phase layer 0 / head 0 is also trained to attend to position t-1 (``--prev-token-aux``), which ends the induction
plateau, and random spans come from the most frequent tokens, a pool that doubles (``--copy-vocab`` 256 -> all)
each time the copy rows' loss falls below ``--copy-grow-below``. Copy, text-span copy and passage-recall probes
on held-out items are logged while training runs.

Data split: the ``*.rst.txt`` files are sorted by relative path; every ``--heldout-every``-th file
(index % N == N - 1) is held out for evaluation, the rest is training text.

Outputs (under ``--output-dir``)::

    small/  large/  [large_kv4/]  save_pretrained checkpoints (bf16 safetensors) + tokenizer
    tokenizer/           the shared tokenizer (reused if present; --train-tokenizer re-trains it)
    heldout.txt          held-out documents (evaluation text)
    calibration.txt      training documents + generated fact/copy documents (for fitting mappers)
    train_log.txt        progress log (appended)
    results.json         configs, parameter counts, timings, losses, probes

The committed ``examples/family`` checkpoints were made with this recipe in stages, warm-started from the
earlier text-only models (``small``: 2000 steps; ``large``: 1000 + 1500 steps); both answer 77% of held-out
passage-recall questions. The exact commands are in research/family_builder/README.md ("Stages 1-2"), e.g.::

    apt-get install -y python3.11-doc
    python research/family_builder/train_family.py --output-dir /tmp/fam_new --models small --init-from /tmp/oldfam \\
        --steps 2000 --copy-phase 0.3 --batch-size 4 --seq-len 512 --copy-batch-size 16 --copy-seq-len 128 --lr 3e-3

Quick smoke test (a few seconds, writes to /tmp)::

    python research/family_builder/train_family.py --output-dir /tmp/family_smoke --models small --steps 4 \\
        --probe-every 2

Verify saved checkpoints (held-out loss at several lengths, greedy samples)::

    python research/family_builder/train_family.py --verify
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections import Counter
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

DEFAULT_SOURCES = "/usr/share/doc/python3.11/html/_sources"
EOS = "<|endoftext|>"
PAD = "<|pad|>"

# Family definitions. The main pair shares its KV geometry (2 KV heads x head_dim 32); large_kv4 does not.
# Narrow models: on 2 CPU cores more steps beat more width (see research/family_builder/README.md).
FAMILY = {
    # 4 query heads x 32 on a 64-wide residual stream: GQA like the large one, and clearly weaker than it.
    "small": dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  intermediate_size=192),
    "large": dict(num_hidden_layers=8, hidden_size=192, num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                  intermediate_size=576),
    # same as large but 4 KV heads: a pair with a different KV geometry (optional)
    "large_kv4": dict(num_hidden_layers=8, hidden_size=192, num_attention_heads=6, num_key_value_heads=4, head_dim=32,
                      intermediate_size=576),
    # small's shape with 4 KV heads of dimension 16: paired with large, both the KV head count and head_dim differ
    "small_kv4": dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                      intermediate_size=192),
}
LR = {"small": 3e-3, "large": 2e-3, "large_kv4": 2e-3, "small_kv4": 3e-3}


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



# --------------------------------------------------------------------------- data mix
MIX_KINDS = ("text", "copy", "textcopy", "facts")


def mix_at(progress: float, copy_phase: float) -> dict[str, float]:
    """Row-type probabilities at training progress in [0, 1): copying first, then the full mix."""
    if progress < copy_phase:
        return {"text": 0.1, "copy": 0.9, "textcopy": 0.0, "facts": 0.0}
    return {"text": 0.3, "copy": 0.15, "textcopy": 0.15, "facts": 0.4}


class RowMaker:
    """Builds training rows (input ids and labels, ``seq_len + 1`` tokens) of each kind, from one seeded RNG."""

    def __init__(self, tok, stream: list[int], docs: list[str], seq_len: int, seed: int, pool_seed: int):
        from hf_kvtransfer.evaluation.tasks import FactGenerator, answer_values

        self.tok, self.stream, self.docs, self.n = tok, stream, docs, seq_len + 1
        self.rng = random.Random(f"train_family.rows:{seed}")
        self.facts = FactGenerator("train", seed, answer_values(tok))
        specials = set(tok.all_special_ids)
        self.vocab = [t for t in range(len(tok)) if t not in specials]
        # Random-span tokens come from the first `copy_vocab` ids of a seeded permutation. The pool starts small
        # and doubles whenever copying is learned on it (see train_one): with the full vocabulary from the start
        # a 64-wide model stays on the induction plateau for thousands of steps.
        # Most frequent training tokens first: text and fact documents are made of them, so the copying they need
        # is learned first (the seed only breaks ties).
        counts = Counter(stream)
        self.pool = sorted(self.vocab, key=lambda t: (-counts.get(t, 0), random.Random(f"{pool_seed}:{t}").random()))
        self.copy_vocab = len(self.pool)
        self.eos = tok.eos_token_id

    def _window(self, n: int) -> list[int]:
        s = self.rng.randrange(len(self.stream) - n)
        return self.stream[s : s + n]

    def row(self, kind: str, progress: float, copy_phase: float) -> tuple[list[int], list[int]]:
        ids, lab = getattr(self, "_row_" + kind)(progress, copy_phase)
        return ids[: self.n], lab[: self.n]

    def _row_text(self, progress, copy_phase):
        ids = self._window(self.n)
        return ids, list(ids)

    def _row_copy(self, progress, copy_phase):
        rng, ids, lab = self.rng, [], []
        early = progress < copy_phase
        if early or rng.random() < 0.4:
            # periodic row: one random span repeated to the end (most tokens are copies)
            L = rng.randint(4, 16) if early else rng.randint(4, 48)
            span = [rng.choice(self.pool[: self.copy_vocab]) for _ in range(L)]
            while len(ids) < self.n:
                first = not ids
                ids += span
                lab += [-100] * L if first else [-100] + span[1:]
            return ids, lab
        # spans embedded in text: each random span appears 2-3 times with text gaps between occurrences
        spans, pending = [], []
        while len(ids) < self.n:
            r = rng.random()
            if pending and r < 0.45:
                span = pending.pop(rng.randrange(len(pending)))
                ids += span
                lab += [-100] + span[1:]
            elif r < 0.7:
                L = rng.randint(4, 40)
                span = [rng.choice(self.pool[: self.copy_vocab]) for _ in range(L)]
                spans.append(span)
                pending += [span] * rng.randint(1, 2)
                ids += span
                lab += [-100] * L
            else:
                gap = self._window(rng.randint(4, 80))
                ids += gap
                lab += gap
        return ids, lab

    def _row_textcopy(self, progress, copy_phase):
        rng = self.rng
        ids = self._window(self.n)
        L = rng.randint(8, min(96, self.n // 4))
        a = rng.randrange(0, self.n // 2 - L)
        b = rng.randrange(a + L, self.n - L)
        ids = ids[:b] + ids[a : a + L] + ids[b + L :]
        return ids, list(ids)

    def _row_facts(self, progress, copy_phase):
        from hf_kvtransfer.evaluation.tasks import fact_document

        rng, ids = self.rng, []
        if rng.random() < 0.5:  # start mid-stream sometimes, like packed pretraining data
            ids = self._window(rng.randint(1, 120)) + [self.eos]
        while len(ids) < self.n:
            doc = self.docs[rng.randrange(len(self.docs))]
            lines = doc.split("\n")
            s = rng.randrange(len(lines))
            dis = "\n".join(lines[s : s + rng.randint(2, 25)])
            text = fact_document(self.facts, dis, n_facts=rng.randint(2, 6), n_questions=rng.randint(2, 4))
            ids += self.tok(text, add_special_tokens=False)["input_ids"] + [self.eos]
        return ids, list(ids)


def make_batch(maker: RowMaker, kinds: list[str], progress: float, copy_phase: float):
    import torch

    rows = [maker.row(k, progress, copy_phase) for k in kinds]
    ids = torch.tensor([r[0] for r in rows], dtype=torch.long)
    lab = torch.tensor([r[1] for r in rows], dtype=torch.long)
    return ids, lab


# --------------------------------------------------------------------------- model
def make_config(name: str, tok, max_pos: int):
    from transformers import Qwen3Config

    spec = dict(FAMILY[name])
    return Qwen3Config(
        vocab_size=len(tok),
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


def lm_loss(model, ids, labels):
    import torch.nn.functional as F

    logits = model(input_ids=ids[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1), ignore_index=-100)


def train_loss(model, ids, labels, prev_token_weight: float, prev_token_layer: int = 0):
    """Mean LM loss, the per-row mean losses (detached) and the previous-token auxiliary term.

    The auxiliary term is the NLL of head 0 of layer `prev_token_layer` (default 0) attending to position t-1. An induction head needs a
    previous-token head *and* a head matching on its output; each one's gradient is proportional to the other's
    strength, hence the long plateau. Supervising the first one for the copy phase breaks that symmetry (measured
    on periodic random rows, 256-token pool: repeat NLL 0.1 after 200 steps with it, 4.3 after 300 without).
    """
    import torch
    import torch.nn.functional as F

    out = model(input_ids=ids[:, :-1], use_cache=False, output_attentions=prev_token_weight > 0)
    tgt = labels[:, 1:]
    tok_loss = F.cross_entropy(out.logits.float().transpose(1, 2), tgt, ignore_index=-100, reduction="none")
    valid = (tgt != -100).float()
    loss = (tok_loss * valid).sum() / valid.sum().clamp(min=1)
    rows = ((tok_loss * valid).sum(1) / valid.sum(1).clamp(min=1)).detach()
    aux = torch.zeros(())
    if prev_token_weight > 0:
        att = out.attentions[prev_token_layer][:, 0]  # (batch, T, T): that layer's head 0
        t = torch.arange(1, att.shape[-1])
        aux = -(att[:, t, t - 1] + 1e-6).log().mean()
        loss = loss + prev_token_weight * aux
    return loss, rows, aux.detach()


def evaluate(model, windows, batch_size: int) -> float:
    import torch

    model.eval()
    tot, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, windows.size(0), batch_size):
            b = windows[i : i + batch_size]
            tot += lm_loss(model, b, b).item() * b[:, 1:].numel()
            n += b[:, 1:].numel()
    model.train()
    return tot / max(n, 1)


def windows_of(stream, seq_len: int):
    n = (stream.numel() - 1) // seq_len
    return stream[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len).contiguous()


class Probes:
    """Copy probe (random spans in held-out text) and passage-recall probe (held-out facts), logged in training."""

    def __init__(self, tok, held_stream: list[int], held_docs: list[str], n_copy: int, n_recall: int):
        from hf_kvtransfer.evaluation.tasks import passage_recall_items, repeated_span_items

        # seeds 10_000+: disjoint from the item seeds research/family_builder/family_context.py reports on
        self.copy = repeated_span_items(tok, held_stream, n_copy, seed=10_000, kind="random",
                                        prefix_len=256, continuation_len=64, span_len=24)
        self.text_copy = repeated_span_items(tok, held_stream, n_copy, seed=10_000, kind="text",
                                             prefix_len=256, continuation_len=64, span_len=24)
        self.recall = passage_recall_items(tok, n_recall, seed=10_000, distractor_texts=held_docs)

    def run(self, model) -> dict[str, float]:
        import torch
        import torch.nn.functional as F

        model.eval()
        out = {}
        with torch.no_grad():
            for items, prefix in ((self.copy, "copy"), (self.text_copy, "text_copy")):
                for name, attr in ((f"{prefix}_nll", "prefix_ids"), (f"{prefix}_nll_control", "control_prefix_ids")):
                    ids = torch.tensor([getattr(it, attr) + it.continuation_ids for it in items])
                    logits = model(input_ids=ids[:, :-1], use_cache=False).logits.float()
                    nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
                    P = len(items[0].prefix_ids)
                    mask = torch.tensor([it.repeat_mask for it in items])
                    out[name] = nll[:, P - 1 :][mask].mean().item()
            hit = 0
            for it in self.recall:
                logits = model(input_ids=torch.tensor([it.prompt_ids]), use_cache=False).logits[0, -1]
                hit += int(logits.argmax().item() == it.answer_ids[0])
            out["recall_acc"] = hit / len(self.recall)
        model.train()
        return out


def train_one(name, args, tok, maker: RowMaker, short_maker: RowMaker, held_windows, probes: Probes, out_dir: Path,
              fh) -> dict:
    import torch
    from transformers import Qwen3ForCausalLM

    steps = args.steps
    lr = args.lr if args.lr is not None else LR[name]
    torch.manual_seed(args.seed)
    if args.init_from:
        # warm start: continue from an existing checkpoint of this model (same config)
        model = Qwen3ForCausalLM.from_pretrained(Path(args.init_from) / name, dtype=torch.float32)
        config = model.config
        log(f"[{name}] warm start from {Path(args.init_from) / name}", fh)
    else:
        config = make_config(name, tok, args.max_position_embeddings)
        model = Qwen3ForCausalLM(config).float()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.get_input_embeddings().weight.numel()
    log(
        f"[{name}] layers={config.num_hidden_layers} hidden={config.hidden_size} "
        f"heads={config.num_attention_heads} kv_heads={config.num_key_value_heads} "
        f"head_dim={config.head_dim} ffn={config.intermediate_size} params={n_params:,} "
        f"(non-embedding {n_params - n_embed:,}); steps={steps} bs={args.batch_size} T={args.seq_len} lr={lr}",
        fh,
    )
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8,
    )
    warmup = max(1, int(args.warmup_frac * steps))

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        prog = (step - warmup) / max(1, steps - warmup)
        return args.min_lr_frac * lr + (1 - args.min_lr_frac) * lr * 0.5 * (1 + math.cos(math.pi * prog))

    # Eager attention in the copy phase: the previous-token auxiliary loss reads layer 0's attention weights.
    model.config._attn_implementation = "eager" if args.prev_token_aux > 0 else "sdpa"
    embed = model.get_input_embeddings().weight
    if args.embed_std and not args.init_from:
        with torch.no_grad():
            embed.normal_(0.0, args.embed_std / math.sqrt(config.hidden_size))
    embed.requires_grad_(not args.freeze_embeddings)
    short_maker.copy_vocab = maker.copy_vocab = min(args.copy_vocab, len(maker.pool))
    kind_rng = random.Random(f"train_family.kinds:{args.seed}")
    t0, c0 = time.time(), time.process_time()
    t_last, s_last, ema, copy_ema = t0, 0, None, None
    history, tokens_seen, in_copy_phase = [], 0, True
    for step in range(steps):
        progress = step / steps
        if in_copy_phase and progress >= args.copy_phase:
            in_copy_phase = False
            model.config._attn_implementation = "sdpa"
            embed.requires_grad_(True)
            log(f"[{name}] step {step}: copy phase over (pool {maker.copy_vocab} ids); full mix at T={args.seq_len}", fh)
        mix = mix_at(progress, args.copy_phase)
        short = in_copy_phase  # copy phase: many short rows (cheap steps), then full length
        bs = args.copy_batch_size if short else args.batch_size
        kinds = kind_rng.choices(list(mix), weights=list(mix.values()), k=bs)
        ids, labels = make_batch(short_maker if short else maker, kinds, progress, args.copy_phase)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        tokens_seen += ids.numel()
        loss, row_loss, aux = train_loss(model, ids, labels, args.prev_token_aux if in_copy_phase else 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        copy_rows = [r for r, k in zip(row_loss.tolist(), kinds) if k == "copy"]
        if copy_rows:
            c = sum(copy_rows) / len(copy_rows)
            copy_ema = c if copy_ema is None else 0.9 * copy_ema + 0.1 * c
            # Adaptive pool: double the random-span vocabulary once copying on the current pool is learned.
            if copy_ema < args.copy_grow_below and maker.copy_vocab < len(maker.pool):
                short_maker.copy_vocab = maker.copy_vocab = min(len(maker.pool), 2 * maker.copy_vocab)
                log(f"[{name}] step {step + 1}: copy loss {copy_ema:.3f} -> random-span pool {maker.copy_vocab} ids", fh)
                copy_ema = None
        li = loss.item()
        ema = li if ema is None else 0.98 * ema + 0.02 * li
        if (step + 1) % args.log_every == 0 or step == 0 or step + 1 == steps:
            now = time.time()
            tps = (step + 1 - s_last) * ids.numel() / max(now - t_last, 1e-9)
            t_last, s_last = now, step + 1
            log(f"[{name}] step {step + 1}/{steps} loss {li:.4f} ema {ema:.4f} copy {copy_ema or 0:.3f} "
                f"prev-token {aux.item():.3f} pool {maker.copy_vocab} lr {lr_at(step):.2e} "
                f"{tps:,.0f} tok/s elapsed {(now - t0) / 60:.1f} min", fh)
        if args.probe_every and ((step + 1) % args.probe_every == 0 or step + 1 == steps):
            pr = probes.run(model)
            history.append({"step": step + 1, **{k: round(v, 4) for k, v in pr.items()}})
            log(f"[{name}] probe step {step + 1}: copy NLL {pr['copy_nll']:.3f} (control {pr['copy_nll_control']:.3f}, "
                f"uniform {math.log(len(tok)):.2f}) text-span copy NLL {pr['text_copy_nll']:.3f} "
                f"(control {pr['text_copy_nll_control']:.3f}) recall acc {pr['recall_acc']:.3f} "
                f"(n={len(probes.recall)}, chance {1 / len(maker.facts.values):.3f})", fh)
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 != steps:
            save_model(model, tok, out_dir / name)
    train_time, train_cpu = time.time() - t0, time.process_time() - c0
    log(f"[{name}] training done in {train_time / 60:.1f} min wall, {train_cpu / 60:.1f} min CPU; evaluating...", fh)
    held_fp32 = evaluate(model, held_windows, args.batch_size)
    dst = out_dir / name
    save_model(model, tok, dst)
    model.float()
    held_saved = evaluate(model, held_windows, args.batch_size)
    pr = probes.run(model)
    log(f"[{name}] held-out text loss @T={args.seq_len} {held_fp32:.4f} (fp32), {held_saved:.4f} (saved bf16); "
        f"final probes {pr}; saved to {dst}", fh)
    c = config
    return {
        "config": {k: getattr(c, k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                               "num_key_value_heads", "head_dim", "intermediate_size",
                                               "vocab_size", "max_position_embeddings")},
        "params": n_params,
        "non_embedding_params": n_params - n_embed,
        "steps": steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "train_tokens": tokens_seen,
        "copy_seq_len": args.copy_seq_len,
        "copy_batch_size": args.copy_batch_size,
        "init_from": args.init_from,
        "lr": lr,
        "copy_phase": args.copy_phase,
        "train_time_s": round(train_time, 1),
        "train_cpu_s": round(train_cpu, 1),
        "threads": args.threads,
        "heldout_text_loss_fp32": round(held_fp32, 4),
        "heldout_text_loss_bf16_saved": round(held_saved, 4),
        "final_probes_bf16_saved": {k: round(v, 4) for k, v in pr.items()},
        "probe_history": history,
    }


def save_model(model, tok, dst: Path) -> None:
    import torch

    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(dst, safe_serialization=True)
    tok.save_pretrained(dst)
    model.float()


# --------------------------------------------------------------------------- verification
def verify(args) -> None:
    """Reload the saved checkpoints standalone and report held-out loss + greedy samples."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    out = Path(args.output_dir)
    text = (out / "heldout.txt").read_text(encoding="utf-8")
    prompts = ["The :mod:`json` module", "An exception is raised when"]
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        d = out / name
        if not (d / "model.safetensors").is_file():
            continue
        tok = AutoTokenizer.from_pretrained(d)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
        print(f"== {name}: {sum(p.numel() for p in model.parameters()):,} params; heldout.txt = {ids.numel():,} tokens")
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


def write_calibration(path: Path, train_docs: list[str], tok, seed: int, target_bytes: int) -> int:
    """Training documents interleaved with generated fact documents (split "train") and copy documents."""
    from hf_kvtransfer.evaluation.tasks import FactGenerator, answer_values, fact_document

    rng = random.Random(seed)
    docs = list(train_docs)
    rng.shuffle(docs)
    gen = FactGenerator("train", seed + 7, answer_values(tok))
    mixed = []
    for i, d in enumerate(docs):
        if i % 2 == 0:
            lines = d.split("\n")
            s = rng.randrange(len(lines))
            mixed.append(fact_document(gen, "\n".join(lines[s : s + 15]), n_facts=4, n_questions=3))
        if i % 4 == 1:
            # a text passage that recurs later in the same document (natural copying)
            lines = [ln for ln in d.split("\n") if ln.strip()]
            if len(lines) > 12:
                a = rng.randrange(len(lines) - 6)
                lines.insert(min(len(lines), a + rng.randint(8, 30)), "\n".join(lines[a : a + 4]))
                d = "\n".join(lines)
        mixed.append(d)
    return write_sample(path, mixed, target_bytes)


# --------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "example:\n"
            "  apt-get install -y python3.11-doc\n"
            "  python research/family_builder/train_family.py --models small --steps 2400 --threads 1\n"
            "  python research/family_builder/train_family.py --output-dir /tmp/fam --models small --steps 4 --probe-every 2\n"
            "  python research/family_builder/train_family.py --verify\n"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--output-dir", default="examples/family", help="where to write everything (default: %(default)s)")
    p.add_argument("--sources-dir", default=DEFAULT_SOURCES, help="root of the *.rst.txt files (default: %(default)s)")
    p.add_argument("--models", default="small,large", help=f"comma-separated subset of {sorted(FAMILY)} (default: %(default)s)")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps per model (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=512, help="training sequence length (default: %(default)s)")
    p.add_argument("--lr", type=float, default=None, help=f"peak LR (default: per model {LR})")
    p.add_argument("--copy-phase", type=float, default=0.2,
                   help="fraction of steps in the copy-heavy phase; the next equal fraction is a transition (default: %(default)s)")
    p.add_argument("--copy-seq-len", type=int, default=128, help="row length in the copy phase (default: %(default)s)")
    p.add_argument("--copy-batch-size", type=int, default=8, help="rows per step in the copy phase (default: %(default)s)")
    p.add_argument("--copy-vocab", type=int, default=256,
                   help="random-span pool size at the start; doubles when copying on it is learned (default: %(default)s)")
    p.add_argument("--copy-grow-below", type=float, default=1.0,
                   help="double the pool when the copy rows' loss (EMA) is below this (default: %(default)s)")
    p.add_argument("--prev-token-aux", type=float, default=0.3,
                   help="weight of the previous-token attention loss on layer 0 / head 0 in the copy phase, 0 = off "
                        "(default: %(default)s)")
    p.add_argument("--embed-std", type=float, default=1.0,
                   help="token embedding init std times 1/sqrt(hidden); 0 = transformers' default (default: %(default)s)")
    p.add_argument("--freeze-embeddings", action="store_true",
                   help="keep the token embeddings at their init during the copy phase")
    p.add_argument("--init-from", default=None,
                   help="warm start: directory holding <model>/ checkpoints to continue from (default: fresh init)")
    p.add_argument("--min-lr-frac", type=float, default=0.1, help="cosine floor as a fraction of peak (default: %(default)s)")
    p.add_argument("--warmup-frac", type=float, default=0.03, help="warmup fraction of steps (default: %(default)s)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (default: %(default)s)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clip (default: %(default)s)")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size with --train-tokenizer (default: %(default)s)")
    p.add_argument("--train-tokenizer", action="store_true",
                   help="train a new tokenizer instead of reusing <output-dir>/tokenizer (the committed family reuses it)")
    p.add_argument("--heldout-every", type=int, default=20, help="hold out every N-th document (default: %(default)s)")
    p.add_argument("--max-position-embeddings", type=int, default=8192, help="config context limit (default: %(default)s)")
    p.add_argument("--sample-kb", type=int, default=300, help="size of heldout.txt in KB (default: %(default)s)")
    p.add_argument("--calibration-kb", type=int, default=2048,
                   help="size of calibration.txt in KB; 2048 covers fit_mapper's default 500 x 1024 tokens "
                        "(default: %(default)s)")
    p.add_argument("--probe-every", type=int, default=100, help="copy/recall probe interval in steps, 0 = off (default: %(default)s)")
    p.add_argument("--probe-items", type=int, default=48, help="items per probe (default: %(default)s)")
    p.add_argument("--save-every", type=int, default=200, help="save the checkpoint every N steps, 0 = only at the end (default: %(default)s)")
    p.add_argument("--log-every", type=int, default=50, help="log interval in steps (default: %(default)s)")
    p.add_argument("--verify", action="store_true",
                   help="only reload the saved checkpoints, print held-out loss on heldout.txt and greedy samples")
    p.add_argument("--verify-lengths", type=int, nargs="+", default=[256, 512, 1024],
                   help="context lengths for --verify losses (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.verify:
        return verify(args)
    import numpy as np
    import torch
    from transformers import AutoTokenizer

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
    train_docs = [d for d in (read_doc(f) for f in train_f) if d]
    held_docs = [d for d in (read_doc(f) for f in held_f) if d]
    log(f"{len(files)} documents: {len(train_docs)} train ({sum(map(len, train_docs)) / 1e6:.2f} M chars), "
        f"{len(held_docs)} held-out ({sum(map(len, held_docs)) / 1e6:.2f} M chars)", fh)
    (out / "heldout_files.txt").write_text(
        "\n".join(f.relative_to(sources).as_posix() for f in held_f) + "\n", encoding="utf-8"
    )

    if args.train_tokenizer or not (out / "tokenizer" / "tokenizer.json").is_file():
        t = time.time()
        tok = train_tokenizer(train_docs, args.vocab_size, out / "tokenizer", args.max_position_embeddings)
        log(f"tokenizer: vocab {len(tok)} trained in {time.time() - t:.1f}s", fh)
    else:
        tok = AutoTokenizer.from_pretrained(out / "tokenizer")
        log(f"tokenizer: reusing {out / 'tokenizer'} (vocab {len(tok)})", fh)

    n = write_sample(out / "heldout.txt", held_docs, args.sample_kb * 1024)
    m = write_calibration(out / "calibration.txt", train_docs, tok, args.seed, args.calibration_kb * 1024)
    log(f"wrote heldout.txt ({n / 1024:.0f} KB) and calibration.txt ({m / 1024:.0f} KB)", fh)

    t = time.time()
    train_stream = encode_stream(tok, train_docs)
    held_stream = encode_stream(tok, held_docs)
    held_w = windows_of(held_stream, args.seq_len)
    log(f"encoded in {time.time() - t:.1f}s: train {train_stream.numel():,} tokens, held-out {held_stream.numel():,} "
        f"tokens -> {held_w.size(0)} windows of {args.seq_len}", fh)
    probes = Probes(tok, held_stream.tolist(), held_docs, args.probe_items, args.probe_items)

    results_path = out / "results.json"
    data = {
        "documents": len(files),
        "train_documents": len(train_docs),
        "heldout_documents": len(held_docs),
        "train_text_tokens": int(train_stream.numel()),
        "heldout_tokens": int(held_stream.numel()),
        "heldout_windows": int(held_w.size(0)),
        "vocab_size": len(tok),
        "mix": {f"{p:.2f}": mix_at(p, args.copy_phase) for p in (0.0, args.copy_phase, 2 * args.copy_phase)},
    }
    stream_list = train_stream.tolist()
    for name in [m_.strip() for m_ in args.models.split(",") if m_.strip()]:
        if name not in FAMILY:
            sys.exit(f"unknown model {name!r}; choose from {sorted(FAMILY)}")
        # every model sees the same rows: the row maker is re-seeded per model
        maker = RowMaker(tok, stream_list, train_docs, args.seq_len, args.seed, pool_seed=args.seed)
        short_maker = RowMaker(tok, stream_list, train_docs, args.copy_seq_len, args.seed + 1, pool_seed=args.seed)
        res = train_one(name, args, tok, maker, short_maker, held_w, probes, out, fh)
        res["command_args"] = " ".join(sys.argv[1:])
        # re-read before writing so separate runs (--models small / --models large) merge
        results = json.loads(results_path.read_text()) if results_path.exists() else {}
        results = {k: v for k, v in results.items() if k in FAMILY or k == "data"}
        results["data"], results[name] = data, res
        results_path.write_text(json.dumps(results, indent=2) + "\n")
    log(f"done; results in {results_path}", fh)


if __name__ == "__main__":
    main()
