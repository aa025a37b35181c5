"""Offline fixtures for fit tests: a word-level tokenizer built from scratch, tiny saved models, a text corpus."""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import VOCAB, tiny_model

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3 = the tiny models' pad/bos/eos ids
WORDS = [f"w{i}" for i in range(VOCAB - len(SPECIALS))]


def make_tokenizer(words: list[str] = WORDS, specials: list[str] = SPECIALS) -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=specials[3]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=specials[0], bos_token=specials[1], eos_token=specials[2], unk_token=specials[3]
    )


def write_corpus(path: Path, num_paragraphs: int = 60, seed: int = 0) -> Path:
    """Paragraphs of 20-60 random words, separated by blank lines (one document each)."""
    rng = random.Random(seed)
    paragraphs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) for _ in range(num_paragraphs)]
    path.write_text("\n\n".join(paragraphs) + "\n")
    return path


def save_pair(root: Path, tokenizer=None, target_tokenizer=None, source_layers: int = 3, target_layers: int = 2):
    """Save a tiny Qwen3 source/target pair with tokenizers; returns their directories."""
    source = tiny_model("qwen3", num_hidden_layers=source_layers, seed=1)
    target = tiny_model("qwen3", num_hidden_layers=target_layers, seed=2, num_key_value_heads=1, head_dim=8,
                        num_attention_heads=2)  # fmt: skip
    dirs = []
    for name, model, tok in (("source", source, tokenizer), ("target", target, target_tokenizer or tokenizer)):
        d = root / name
        model.save_pretrained(d)
        (tok or make_tokenizer()).save_pretrained(d)
        dirs.append(d)
    return dirs[0], dirs[1]
