#!/usr/bin/env python
"""Train the deep family (``examples/family_deep``): an 8-layer source, then a 24-layer target; resumable.

One command trains ``source`` then ``target`` on the same rows (same seeds, same data as the bundled family:
the Python 3.11 reST docs, the bundled tokenizer) and exports each finished model as a bf16 ``save_pretrained``
checkpoint with its tokenizer to ``<export-dir>/<name>/``. Everything that training needs to continue lives in
``<run-dir>/<name>/checkpoint.pt`` (model and optimizer state, every RNG, the data position, the curriculum's
state), written every ``--checkpoint-minutes`` and at the end; running the same command again resumes exactly
from it (an interrupted and resumed run gives the same weights as an uninterrupted one:
``tests/test_train_deep.py``). A model whose export is complete (``<run-dir>/<name>/done.json``) is skipped.

The curriculum is the bundled family's (``train_family.py``) with harder recall, and one auxiliary loss at most:
a previous-token head on layer 0 / head 0 during the copy phase (``--prev-token-layer L`` pins layer L's head 0
instead: the copying head then tends to form after it, a way to put copying at mid-depth on purpose):

- copy phase (first ``--copy-phase`` of the steps): short rows, 90% repeated random spans from a pool of frequent
  tokens that doubles each time copying on it is learned, 10% text;
- then rows of ``--seq-len`` tokens: text 30%, random-span copies 10%, text-span copies 10%, fact documents 25%
  (2-10 facts, distractors of 2-50 lines) and two-hop documents 25% (``tasks.two_hop_document``: alias lines
  point at function facts; the questions ask through an alias or directly).

The previous-token loss is on from the start of the copy phase by default (without it, a smoke run did not copy;
see research/family_builder/README.md); ``--prev-token-fallback F`` switches it on only if the random-span pool has
not grown after a fraction F of the copy phase, ``--prev-token-aux-weight 0`` never. The log says when it is on.

Example (the real run: about 1.4 h for the source and 10 h for the target on one core of a loaded machine)::

    apt-get install -y python3.11-doc
    python research/family_builder/train_deep.py --run-dir runs/deep_family --export-dir examples/family_deep

Smoke run (about a minute)::

    python research/family_builder/train_deep.py --run-dir /tmp/deep_smoke --export-dir /tmp/deep_smoke/export \\
        --models tiny --steps 20 --probe-every 10 --probe-items 8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import train_family as tf  # noqa: E402  (the bundled family's data, rows, probes and export)

ROOT = Path(__file__).resolve().parents[2]

# Same KV geometry (2 KV heads x head_dim 32) in both; the source is a third as deep and three quarters as wide.
PRESETS = {
    "source": dict(arch=dict(num_hidden_layers=8, hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=32, intermediate_size=288), steps=1500, lr=3e-3),
    "target": dict(arch=dict(num_hidden_layers=24, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=32, intermediate_size=384), steps=4500, lr=1.5e-3),
    # for tests and smoke runs only
    "tiny": dict(arch=dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                           head_dim=16, intermediate_size=64), steps=20, lr=3e-3),
}


def deep_mix(progress: float, copy_phase: float) -> dict[str, float]:
    """Row-kind probabilities at training progress in [0, 1): copying first, then text, copies and recall."""
    if progress < copy_phase:
        return {"text": 0.1, "copy": 0.9}
    return {"text": 0.3, "copy": 0.1, "textcopy": 0.1, "facts": 0.25, "twohop": 0.25}


class DeepRowMaker(tf.RowMaker):
    """The bundled family's rows, with more facts and longer distractors, and two-hop fact documents."""

    def _distractor_lines(self, hi: int) -> str:
        lines = self.docs[self.rng.randrange(len(self.docs))].split("\n")
        s = self.rng.randrange(len(lines))
        return "\n".join(lines[s : s + self.rng.randint(2, hi)])

    def _documents(self, make) -> tuple[list[int], list[int]]:
        ids = []
        if self.rng.random() < 0.5:  # start mid-stream sometimes, like packed pretraining data
            ids = self._window(self.rng.randint(1, 120)) + [self.eos]
        while len(ids) < self.n:
            ids += self.tok(make(), add_special_tokens=False)["input_ids"] + [self.eos]
        return ids, list(ids)

    def _row_facts(self, progress, copy_phase):
        from hf_kvtransfer.evaluation.tasks import fact_document

        rng = self.rng
        return self._documents(lambda: fact_document(
            self.facts, self._distractor_lines(50), n_facts=rng.randint(2, 10), n_questions=rng.randint(2, 4)))

    def _row_twohop(self, progress, copy_phase):
        from hf_kvtransfer.evaluation.tasks import two_hop_document

        rng = self.rng

        def make() -> str:
            n_facts = rng.randint(2, 6)
            return two_hop_document(self.facts, self._distractor_lines(40), n_facts=n_facts,
                                    n_aliases=rng.randint(1, min(3, n_facts)), n_questions=rng.randint(2, 4))
        return self._documents(make)


class DeepProbes(tf.Probes):
    """The bundled probes plus hard recall (8 facts, long distractors) and two-hop recall, on held-out items."""

    def __init__(self, tok, held_stream, held_docs, n_copy: int, n_recall: int):
        from hf_kvtransfer.evaluation.tasks import passage_recall_items, two_hop_items

        super().__init__(tok, held_stream, held_docs, n_copy, n_recall)
        self.hard = passage_recall_items(tok, n_recall, seed=10_000, n_facts=8, distractor_texts=held_docs,
                                         distractor_chars=(900, 1800))
        self.two_hop = two_hop_items(tok, n_recall, seed=10_000, distractor_texts=held_docs)

    def run(self, model) -> dict[str, float]:
        import torch

        out = super().run(model)
        model.eval()
        with torch.no_grad():
            for name, items in (("hard_recall_acc", self.hard), ("two_hop_acc", self.two_hop)):
                hit = sum(int(model(input_ids=torch.tensor([it.prompt_ids]), use_cache=False).logits[0, -1].argmax()
                              == it.answer_ids[0]) for it in items)
                out[name] = hit / len(items)
        model.train()
        return out


@dataclass
class Data:
    tok: object
    maker: DeepRowMaker
    short_maker: DeepRowMaker
    held_windows: object
    probes: DeepProbes


def prepare_data(args, fh) -> Data:
    """Documents, split, tokenizer and row makers: the bundled family's split and tokenizer."""
    from transformers import AutoTokenizer

    sources = Path(args.sources_dir)
    train_f, held_f = tf.split_documents(tf.list_documents(sources), args.heldout_every)
    train_docs = [d for d in (tf.read_doc(f) for f in train_f) if d]
    held_docs = [d for d in (tf.read_doc(f) for f in held_f) if d]
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    t = time.time()
    stream = tf.encode_stream(tok, train_docs).tolist()
    held = tf.encode_stream(tok, held_docs)
    tf.log(f"{len(train_docs)} train / {len(held_docs)} held-out documents; {len(stream):,} / {held.numel():,} tokens "
           f"(encoded in {time.time() - t:.0f}s); tokenizer {args.tokenizer} (vocab {len(tok)})", fh)
    export = Path(args.export_dir)
    export.mkdir(parents=True, exist_ok=True)
    tf.write_sample(export / "heldout.txt", held_docs, args.sample_kb * 1024)
    tf.write_calibration(export / "calibration.txt", train_docs, tok, args.seed, args.calibration_kb * 1024)
    # every model sees the same rows: the makers are seeded identically for each model (see `train_model`)
    maker = DeepRowMaker(tok, stream, train_docs, args.seq_len, args.seed, pool_seed=args.seed)
    short = DeepRowMaker(tok, stream, train_docs, args.copy_seq_len, args.seed + 1, pool_seed=args.seed)
    probes = DeepProbes(tok, held.tolist(), held_docs, args.probe_items, args.probe_items)
    return Data(tok, maker, short, tf.windows_of(held, args.seq_len)[: args.heldout_windows], probes)


# --------------------------------------------------------------------------- state and checkpoints
def fresh_state(args, data: Data, steps: int) -> dict:
    seed = args.seed
    data.maker.rng.seed(f"train_family.rows:{seed}")
    data.short_maker.rng.seed(f"train_family.rows:{seed + 1}")
    for m in (data.maker, data.short_maker):
        m.facts.rng.seed(f"hf_kvtransfer.evaluation.tasks:train:{seed if m is data.maker else seed + 1}")
        m.copy_vocab = min(args.copy_vocab, len(m.pool))
    return dict(step=0, steps=steps, tokens=0, ema=None, copy_ema=None, pool_grown=0, aux_on=False,
                kind_rng=random.Random(f"train_family.kinds:{seed}").getstate(), history=[], wall_s=0.0)


def save_checkpoint(path: Path, model, opt, state: dict, data: Data) -> None:
    """Write everything `load_checkpoint` needs, atomically (a kill mid-write leaves the previous one)."""
    import torch

    blob = dict(model=model.state_dict(), opt=opt.state_dict(), state=state, torch_rng=torch.get_rng_state(),
                rngs=[data.maker.rng.getstate(), data.short_maker.rng.getstate(), data.maker.facts.rng.getstate(),
                      data.short_maker.facts.rng.getstate()],
                copy_vocab=data.maker.copy_vocab)
    tmp = path.with_suffix(".tmp")
    torch.save(blob, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, model, opt, data: Data) -> dict:
    import torch

    blob = torch.load(path, weights_only=False)
    model.load_state_dict(blob["model"])
    opt.load_state_dict(blob["opt"])
    torch.set_rng_state(blob["torch_rng"])
    for rng, st in zip((data.maker.rng, data.short_maker.rng, data.maker.facts.rng, data.short_maker.facts.rng),
                       blob["rngs"]):
        rng.setstate(st)
    data.maker.copy_vocab = data.short_maker.copy_vocab = blob["copy_vocab"]
    return blob["state"]


# --------------------------------------------------------------------------- training
def on_device(model, device: str):
    """Move `model` to `device`; its inputs follow it there and, outside training, its logits come back to the CPU.

    The bundled family's data, probes and held-out loss build CPU tensors; the hooks keep them unchanged.
    """
    model.to(device)
    if device == "cpu":
        return model

    def inputs_to_device(module, args, kwargs):
        move = lambda v: v.to(device) if hasattr(v, "to") and hasattr(v, "device") else v  # noqa: E731
        return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}

    def logits_to_cpu(module, args, kwargs, out):
        if not module.training:
            out.logits = out.logits.cpu()
        return out

    model.register_forward_pre_hook(inputs_to_device, with_kwargs=True)
    model.register_forward_hook(logits_to_cpu, with_kwargs=True)
    return model


def build(name: str, args, tok):
    import torch
    from transformers import Qwen3ForCausalLM

    tf.FAMILY.setdefault(name, PRESETS[name]["arch"])
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(tf.make_config(name, tok, args.max_position_embeddings)).float()
    with torch.no_grad():  # embedding std 1/sqrt(hidden), as the bundled family (faster escape from the plateau)
        model.get_input_embeddings().weight.normal_(0.0, 1.0 / math.sqrt(model.config.hidden_size))
    on_device(model, args.device)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=1.0, betas=(0.9, 0.95), eps=1e-8)
    return model, opt


def lr_at(step: int, steps: int, peak: float, args) -> float:
    warmup = max(1, int(args.warmup_frac * steps))
    if step < warmup:
        return peak * (step + 1) / warmup
    prog = (step - warmup) / max(1, steps - warmup)
    return args.min_lr_frac * peak + (1 - args.min_lr_frac) * peak * 0.5 * (1 + math.cos(math.pi * prog))


def train_step(model, opt, state: dict, data: Data, args, peak: float) -> dict:
    """One optimizer step; updates `state` (data position, curriculum) and returns what the log shows."""
    import torch

    step, steps = state["step"], state["steps"]
    in_copy = step / steps < args.copy_phase
    if in_copy and not state["aux_on"] and state["pool_grown"] == 0 and args.prev_token_aux_weight > 0 \
            and step >= args.prev_token_fallback * args.copy_phase * steps:
        state["aux_on"] = True  # copying has not formed: pin a previous-token head (head 0 of --prev-token-layer)
    aux_w = args.prev_token_aux_weight if (in_copy and state["aux_on"]) else 0.0
    model.config._attn_implementation = "eager" if aux_w > 0 else "sdpa"
    mix = deep_mix(step / steps, args.copy_phase)
    kind_rng = random.Random()
    kind_rng.setstate(state["kind_rng"])
    bs = args.copy_batch_size if in_copy else args.batch_size
    kinds = kind_rng.choices(list(mix), weights=list(mix.values()), k=bs)
    state["kind_rng"] = kind_rng.getstate()
    ids, labels = tf.make_batch(data.short_maker if in_copy else data.maker, kinds, step / steps, args.copy_phase)
    for g in opt.param_groups:
        g["lr"] = lr_at(step, steps, peak, args)
    loss, row_loss, aux = tf.train_loss(model, ids.to(args.device), labels.to(args.device), aux_w, args.prev_token_layer)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    opt.step()
    _update_curriculum(state, data, [r for r, k in zip(row_loss.tolist(), kinds) if k == "copy"], args)
    li = loss.item()
    state["ema"] = li if state["ema"] is None else 0.98 * state["ema"] + 0.02 * li
    state["step"], state["tokens"] = step + 1, state["tokens"] + ids.numel()
    return dict(loss=li, aux=aux.item(), tokens=ids.numel(), in_copy=in_copy)


def _update_curriculum(state: dict, data: Data, copy_rows: list[float], args) -> None:
    """Double the random-span pool once the copy rows' loss (EMA) is below `--copy-grow-below`."""
    if not copy_rows:
        return
    c = sum(copy_rows) / len(copy_rows)
    state["copy_ema"] = c if state["copy_ema"] is None else 0.9 * state["copy_ema"] + 0.1 * c
    if state["copy_ema"] < args.copy_grow_below and data.maker.copy_vocab < len(data.maker.pool):
        data.maker.copy_vocab = data.short_maker.copy_vocab = min(len(data.maker.pool), 2 * data.maker.copy_vocab)
        state["copy_ema"], state["pool_grown"] = None, state["pool_grown"] + 1


def train_model(name: str, args, data: Data, fh) -> bool:
    """Train (or resume) one model; export it when done. Returns False when stopped early (`--stop-after`)."""
    spec = PRESETS[name]
    run = Path(args.run_dir) / name
    run.mkdir(parents=True, exist_ok=True)
    ckpt, steps, peak = run / "checkpoint.pt", args.steps or spec["steps"], args.lr or spec["lr"]
    model, opt = build(name, args, data.tok)
    state = fresh_state(args, data, steps)
    if ckpt.is_file() and not args.fresh:
        state = load_checkpoint(ckpt, model, opt, data)
        tf.log(f"[{name}] resumed from {ckpt} at step {state['step']}/{state['steps']}", fh)
    n = sum(p.numel() for p in model.parameters())
    tf.log(f"[{name}] {spec['arch']} params={n:,} steps={state['steps']} peak lr={peak} "
           f"T={args.seq_len} x {args.batch_size} (copy phase {args.copy_seq_len} x {args.copy_batch_size})", fh)
    done = _loop(name, model, opt, state, data, args, peak, ckpt, fh)
    if done:
        finish(name, model, state, data, args, fh)
    return done


def _loop(name, model, opt, state, data, args, peak, ckpt, fh) -> bool:
    t_save = t_log = t_start = time.time()
    tok_log, ran, was_aux = 0, 0, state["aux_on"]
    while state["step"] < state["steps"]:
        t = time.time()
        info = train_step(model, opt, state, data, args, peak)
        state["wall_s"] += time.time() - t
        tok_log, ran, step = tok_log + info["tokens"], ran + 1, state["step"]
        if args.time_budget_min and ran == BUDGET_PROBE_STEPS:
            fit_steps_to_budget(name, model, state, ran, time.time() - t_start, args, fh)
        if state["aux_on"] and not was_aux:
            was_aux = True
            tf.log(f"[{name}] step {step}: previous-token loss on layer {args.prev_token_layer} / head 0 switched on "
                   f"for the rest of the copy phase (pool not grown after {args.prev_token_fallback:.0%} of it)", fh)
        if step % args.log_every == 0 or step == 1:
            now = time.time()
            tf.log(f"[{name}] step {step}/{state['steps']} loss {info['loss']:.4f} ema {state['ema']:.4f} "
                   f"copy {state['copy_ema'] or 0:.3f} pool {data.maker.copy_vocab} prev-token {info['aux']:.3f} "
                   f"lr {lr_at(step - 1, state['steps'], peak, args):.2e} "
                   f"{tok_log / max(now - t_log, 1e-9):,.0f} tok/s "
                   f"train time {state['wall_s'] / 3600:.2f} h", fh)
            t_log, tok_log = now, 0
        if args.probe_every and (step % args.probe_every == 0 or step == state["steps"]):
            pr = {k: round(v, 4) for k, v in data.probes.run(model).items()}
            state["history"].append({"step": step, **pr})
            tf.log(f"[{name}] probe step {step}: {json.dumps(pr)}", fh)
        stop = args.stop_after and ran >= args.stop_after
        if time.time() - t_save >= args.checkpoint_minutes * 60 or step == state["steps"] or stop:
            save_checkpoint(ckpt, model, opt, state, data)
            t_save = time.time()
        if stop and step < state["steps"]:
            tf.log(f"[{name}] stopped after {ran} steps at step {step} (--stop-after); checkpoint {ckpt}", fh)
            return False
    return True


BUDGET_PROBE_STEPS = 50


def fit_steps_to_budget(name: str, model, state: dict, ran: int, elapsed_s: float, args, fh) -> None:
    """Set the run's total steps so the rest ends within `--time-budget-min` (85% of what is left, for probes).

    Called once, early in the warmup (the schedule's fractions all read `state['steps']`, so the cosine and the
    copy phase then fit the new length). Copy-phase steps cost what the steps so far cost; a step after the copy
    phase is timed on a full-size batch (forward and backward, gradients dropped, weights untouched) plus 15% for
    making its rows. Never more than the steps asked for.
    """
    copy_s, text_s = elapsed_s / ran, 1.15 * text_step_seconds(model, args)
    left = args.time_budget_min * 60 - (time.time() - args.t0)
    done = state["step"]
    total = int((0.85 * left + done * copy_s) / (args.copy_phase * copy_s + (1 - args.copy_phase) * text_s))
    steps = max(done + 1, min(state["steps"], total))
    tf.log(f"[{name}] {copy_s * 1000:.0f} ms per copy-phase step, {text_s * 1000:.0f} ms per later step; "
           f"{left:.0f} s of the {args.time_budget_min} min budget left: {steps} steps (asked {state['steps']})", fh)
    state["steps"] = steps


def text_step_seconds(model, args, repeats: int = 3) -> float:
    """Median seconds of a forward and backward pass on a `--batch-size` x `--seq-len` batch of random ids."""
    import torch

    ids = torch.randint(0, model.config.vocab_size, (args.batch_size, args.seq_len),
                        generator=torch.Generator().manual_seed(0)).to(args.device)
    sync = torch.cuda.synchronize if str(args.device).startswith("cuda") else (lambda: None)
    attn, model.config._attn_implementation = model.config._attn_implementation, "sdpa"
    times = []
    for _ in range(repeats):
        sync()
        t = time.time()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        sync()
        times.append(time.time() - t)
        model.zero_grad(set_to_none=True)
    model.config._attn_implementation = attn
    return sorted(times)[len(times) // 2]


def finish(name: str, model, state: dict, data: Data, args, fh) -> None:
    """Held-out loss, final probes, bf16 export to `<export-dir>/<name>/`, and `done.json` in the run dir."""
    dst = Path(args.export_dir) / name
    held_fp32 = tf.evaluate(model, data.held_windows, args.batch_size)
    tf.save_model(model, data.tok, dst)
    import torch

    model.to(torch.bfloat16).float()  # score what was saved: the bf16 weights
    res = dict(name=name, arch=PRESETS[name]["arch"], params=sum(p.numel() for p in model.parameters()),
               steps=state["steps"], train_tokens=state["tokens"], train_hours=round(state["wall_s"] / 3600, 3),
               prev_token_aux_used=state["aux_on"], pool_grown=state["pool_grown"],
               heldout_windows=int(data.held_windows.size(0)), heldout_loss_fp32=round(held_fp32, 4),
               heldout_loss_bf16=round(tf.evaluate(model, data.held_windows, args.batch_size), 4),
               final_probes_bf16=data.probes.run(model), probe_history=state["history"],
               args={k: v for k, v in vars(args).items()})
    (Path(args.run_dir) / name / "done.json").write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    tf.log(f"[{name}] done: held-out loss {res['heldout_loss_bf16']} (bf16), probes {res['final_probes_bf16']}; "
           f"exported to {dst}", fh)


def snapshot(name: str, args, fh) -> None:
    """Export `name`'s latest checkpoint (bf16 + tokenizer) to `<snapshot>/<name>/` without training: a run that
    spans sessions can be scored mid-way (e.g. `copy_heads.py --model <snapshot>/<name>`)."""
    import torch
    from transformers import AutoTokenizer

    ckpt = Path(args.run_dir) / name / "checkpoint.pt"
    if not ckpt.is_file():
        sys.exit(f"no checkpoint at {ckpt}: train first (the same command without --snapshot)")
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    model, _ = build(name, args, tok)
    blob = torch.load(ckpt, weights_only=False)
    model.load_state_dict(blob["model"])
    dst = Path(args.snapshot) / name
    tf.save_model(model.eval().to("cpu"), tok, dst)
    (dst / "snapshot.json").write_text(json.dumps({k: blob["state"][k] for k in ("step", "steps", "tokens", "wall_s",
                                                   "aux_on", "pool_grown", "history")}, indent=2) + "\n")  # fmt: skip
    tf.log(f"[{name}] checkpoint at step {blob['state']['step']}/{blob['state']['steps']} exported to {dst}", fh)


# --------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=(
        "example:\n  python research/family_builder/train_deep.py --run-dir runs/deep_family "
        "--export-dir examples/family_deep\n  (run it again to resume; --fresh starts over; --snapshot DIR exports "
        "where a run stands)"),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--run-dir", default="runs/deep_family", help="checkpoints, train_log.txt, done.json (default: %(default)s)")
    a("--export-dir", default="examples/family_deep", help="bf16 checkpoints + data files (default: %(default)s)")
    a("--models", default="source,target",
      help=f"comma-separated, in order, from {sorted(PRESETS)} (default: %(default)s)")
    a("--steps", type=int, default=None, help="optimizer steps per model (default: the preset's)")
    a("--lr", type=float, default=None, help="peak learning rate (default: the preset's)")
    a("--fresh", action="store_true", help="ignore an existing checkpoint and start over")
    a("--stop-after", type=int, default=0, help="stop (after checkpointing) once this many steps ran in this call")
    a("--checkpoint-minutes", type=float, default=10.0, help="checkpoint interval (default: %(default)s)")
    a("--sources-dir", default=tf.DEFAULT_SOURCES, help="root of the *.rst.txt files (default: %(default)s)")
    a("--tokenizer", default=str(ROOT / "examples" / "family" / "tokenizer"), help="the bundled family's tokenizer")
    a("--heldout-every", type=int, default=20, help="hold out every N-th document (default: %(default)s)")
    a("--seq-len", type=int, default=1024, help="row length after the copy phase (default: %(default)s)")
    a("--batch-size", type=int, default=2, help="rows per step after the copy phase (default: %(default)s)")
    a("--copy-phase", type=float, default=0.3, help="fraction of steps in the copy phase (default: %(default)s)")
    a("--copy-seq-len", type=int, default=128, help="row length in the copy phase (default: %(default)s)")
    a("--copy-batch-size", type=int, default=16, help="rows per step in the copy phase (default: %(default)s)")
    a("--copy-vocab", type=int, default=256, help="random-span pool at the start; doubles (default: %(default)s)")
    a("--copy-grow-below", type=float, default=1.0, help="copy-row loss that doubles the pool (default: %(default)s)")
    a("--prev-token-fallback", type=float, default=0.0,
      help="if the pool has not grown after this fraction of the copy phase, add a previous-token loss on layer 0 / "
           "head 0 for the rest of the copy phase; 0 = from the start (default: %(default)s)")
    a("--prev-token-aux-weight", type=float, default=0.3,
      help="its weight; 0 = no auxiliary loss at all (default: %(default)s)")
    a("--prev-token-layer", type=int, default=0,
      help="the layer whose head 0 the loss pins (default: %(default)s); the copying head then tends to form just "
           "after it, so a deeper one puts copying deeper, as a stand-in for pretrained models that copy at mid-depth")
    a("--min-lr-frac", type=float, default=0.1, help="cosine floor as a fraction of peak (default: %(default)s)")
    a("--warmup-frac", type=float, default=0.02, help="warmup fraction of steps (default: %(default)s)")
    a("--weight-decay", type=float, default=0.1, help="AdamW weight decay on matrices (default: %(default)s)")
    a("--grad-clip", type=float, default=1.0, help="gradient norm clip (default: %(default)s)")
    a("--max-position-embeddings", type=int, default=8192, help="config context limit (default: %(default)s)")
    a("--probe-every", type=int, default=250, help="probe interval in steps, 0 = off (default: %(default)s)")
    a("--probe-items", type=int, default=32, help="items per probe (default: %(default)s)")
    a("--heldout-windows", type=int, default=150, help="held-out windows for the final loss (default: %(default)s)")
    a("--log-every", type=int, default=25, help="log interval in steps (default: %(default)s)")
    a("--sample-kb", type=int, default=300, help="size of heldout.txt in KB (default: %(default)s)")
    a("--calibration-kb", type=int, default=2048, help="size of calibration.txt in KB (default: %(default)s)")
    a("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    a("--device", default="cpu", help="torch device to train on, e.g. cuda (default: %(default)s)")
    a("--time-budget-min", type=float, default=0.0,
      help="fit each model's step count to this wall-clock budget, measured from the start of the command, after "
           f"{BUDGET_PROBE_STEPS} steps (0 = the steps asked for; default: %(default)s)")
    a("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    a("--snapshot", metavar="DIR", help="export each model's latest checkpoint to DIR/<model> (bf16 + tokenizer, "
                                        "snapshot.json: step, probes so far) and exit, without training")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in PRESETS]
    if unknown:
        sys.exit(f"unknown model(s) {unknown}; choose from {sorted(PRESETS)}")
    shallow = [m for m in names if not 0 <= args.prev_token_layer < PRESETS[m]["arch"]["num_hidden_layers"]]
    if shallow:
        sys.exit(f"--prev-token-layer {args.prev_token_layer} is not a layer of {shallow}: "
                 f"choose 0 to {min(PRESETS[m]['arch']['num_hidden_layers'] for m in shallow) - 1}")
    torch.set_num_threads(args.threads)
    args.t0 = time.time()
    # CPU runs are bit-reproducible (and resumable to the same weights); on CUDA some kernels have no deterministic
    # version, so there it is best effort
    torch.use_deterministic_algorithms(True, warn_only=args.device != "cpu")
    if args.device != "cpu":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    Path(args.run_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(args.run_dir) / "train_log.txt", "a", encoding="utf-8") as fh:
        tf.log(f"train_deep.py {' '.join(sys.argv[1:])}; torch {torch.__version__}, "
               f"threads {torch.get_num_threads()}", fh)
        if args.snapshot:
            for name in names:
                snapshot(name, args, fh)
            return 0
        data = None
        for name in names:
            if (Path(args.run_dir) / name / "done.json").is_file() and not args.fresh:
                tf.log(f"[{name}] already done ({Path(args.run_dir) / name / 'done.json'}); skipped", fh)
                continue
            data = data or prepare_data(args, fh)
            if not train_model(name, args, data, fh):
                return 0
        tf.log("all models done", fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
