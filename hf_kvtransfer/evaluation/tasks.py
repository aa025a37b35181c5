"""Content tasks that need the context: repeated spans, passage recall, hand-off questions.

Perplexity on ordinary text says little about a KV transfer when the models barely condition on
their context. The items built here can only be scored well by a model that *reads* its context:

- :func:`repeated_span_items`: a span (random tokens, or a passage of real text) occurs in the prefix
  and again in the continuation; the repeat is predictable only by copying.
- :func:`cued_recall_items`: records ``key, cue, value`` of held-out text written into a prefix, all with the
  same cue; the continuation repeats one record's key and cue and is scored on its value, which only a look-up
  by the key several tokens back finds (the shape of a passage-recall question, from any text).
- :func:`passage_recall_items`: a passage of made-up API facts, distractor text, then a question whose
  answer (a number) appears only in the passage; a "no passage" prompt gives the floor.
- :func:`handoff_items`: passage + question 1 + answer 1 (what a source model reads and answers), then
  question 2, also answered only by the passage (what the target answers after a hand-off).
- :func:`needle_recall_items`: passage recall at a chosen context length with the passage (the needle) at a
  chosen depth of held-out text (start, middle, end): where in a long context a transfer loses the content.
- :func:`two_hop_items`: a passage of function facts and alias lines (``a`` is an alias of ``f``); the question
  names an alias, so the answer is found only by following the alias to its function's fact (two look-ups).

Facts are drawn at random from made-up names and values, so no model can have memorised them. The
training script of the bundled family (``research/family_builder/train_family.py``) draws its fact documents from the
same generator with ``split="train"``; evaluation items use ``split="eval"``, a different seed stream
*and* a disjoint name pool (every made-up identifier is assigned to one split by a hash of its text).

Everything is deterministic given ``seed`` and the tokenizer. Only the standard library and a
tokenizer are needed (``torch`` is not imported here).

Example:
    >>> from transformers import AutoTokenizer
    >>> from hf_kvtransfer.evaluation.tasks import passage_recall_items
    >>> tok = AutoTokenizer.from_pretrained("examples/family/large")
    >>> item = passage_recall_items(tok, n=1, seed=0)[0]
    >>> tok.decode(item.prompt_ids)[-40:], tok.decode(item.answer_ids)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import random
import re
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

__all__ = [
    "Fact",
    "FactSet",
    "RepeatedSpanItem",
    "PassageRecallItem",
    "HandoffItem",
    "FactGenerator",
    "fact_document",
    "TwoHopSet",
    "two_hop_document",
    "two_hop_items",
    "repeated_span_items",
    "cued_recall_items",
    "passage_recall_items",
    "needle_recall_items",
    "NEEDLE_POSITIONS",
    "handoff_items",
]

SPLITS = ("train", "eval", "probe")
# One identifier in _EVAL_MOD goes to the eval pool (by crc32 of its text), the rest to train.
_EVAL_MOD = 5
# The fit's content probe (`fitting/content_gate.py`) draws its items from the "probe" split: the eval pool's
# identifiers (the same kind of names as the items `eval` reports) from a seed stream of its own, so the items the
# fit decides on are not the items `eval` then measures.
_NAME_POOL = {"train": "train", "eval": "eval", "probe": "eval"}

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gl", "kr",
           "pl", "st", "tr", "sn", "sp", "fl", "gr", "ch", "sh", "th", "qu", "wh"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou", "ee", "oo", "y"]
_CODAS = ["", "", "", "n", "r", "l", "x", "m", "ck", "sk", "nd", "rt", "st", "b", "g"]
_VERBS = ["open", "close", "read", "write", "get", "set", "make", "load", "dump", "parse", "fetch", "send",
          "spool", "flush", "merge", "split", "wrap", "scan", "pack", "bind", "poll", "sync", "sort", "join"]


def _split_of(name: str) -> str:
    return "eval" if zlib.crc32(name.encode("utf-8")) % _EVAL_MOD == 0 else "train"


def _syllable(rng: random.Random) -> str:
    return rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)


def _word(rng: random.Random, lo: int = 2, hi: int = 3) -> str:
    return "".join(_syllable(rng) for _ in range(rng.randint(lo, hi)))


@dataclass(frozen=True)
class Fact:
    """One made-up API fact: a sentence for the passage, a question, and its (numeric) answer.

    Args:
        key: the identifier the question names (unique within a :class:`FactSet`).
        value: the answer, a decimal number as text.
        statement: the passage sentence stating the fact.
        question: the question text (without the ``Q: `` prefix).
        kind: which template produced it.
    """

    key: str
    value: str
    statement: str
    question: str
    kind: str

    @property
    def answer_prefix(self) -> str:
        """The statement up to the value's opening quotes: how an answer starts (a cloze of the passage line)."""
        quoted = f"``{self.value}``"
        return self.statement[: self.statement.index(quoted) + 2]


@dataclass(frozen=True)
class FactSet:
    """A module's worth of facts: a docs-style passage and its facts in passage order."""

    module: str
    facts: tuple[Fact, ...]
    passage: str


# Templates: (kind, statement, question). {key} is what the question names; {val} the answer.
_TEMPLATES = [
    ("default",
     "The default value of the ``{param}`` parameter of :func:`{mod}.{func}` is ``{val}``.",
     "What is the default value of ``{param}`` in :func:`{mod}.{func}`?"),
    ("attr",
     "The :attr:`{cls}.{attr}` attribute is set to ``{val}`` when the object is created.",
     "What is :attr:`{cls}.{attr}` set to when the object is created?"),
    ("port",
     "By default :func:`{mod}.{func}` connects to port ``{val}``.",
     "Which port does :func:`{mod}.{func}` connect to by default?"),
    ("retries",
     ":meth:`{cls}.{meth}` retries a failed call at most ``{val}`` times.",
     "How many times does :meth:`{cls}.{meth}` retry a failed call?"),
    ("limit",
     "The ``{param}`` argument of :class:`{cls}` must not exceed ``{val}``.",
     "What must the ``{param}`` argument of :class:`{cls}` not exceed?"),
    ("const",
     "The constant :data:`{mod}.{const}` has the value ``{val}``.",
     "What is the value of :data:`{mod}.{const}`?"),
]

_FILLER = [
    "The :mod:`{mod}` module provides helpers for working with {noun} objects.",
    "See also :func:`{mod}.{func}` for a lower-level interface.",
    ":class:`{cls}` objects are not thread-safe; use a lock when sharing them.",
    "This function is a thin wrapper around the platform's {noun} API.",
    ".. versionchanged:: 3.{minor}\n   Added support for {noun} objects.",
    ".. note::\n   The behaviour of :meth:`{cls}.{meth}` depends on the {noun} backend.",
    "Raise :exc:`ValueError` if the {noun} is closed.",
]
_NOUNS = ["buffer", "socket", "stream", "queue", "spool", "record", "token", "channel", "archive", "handle"]


class FactGenerator:
    """Draw made-up API facts from one split's name pool.

    Args:
        split: ``"train"``, ``"eval"`` or ``"probe"``; train and eval use disjoint identifiers, every split its own
            seed stream ("probe": the fit's content probe, eval's identifiers, items of its own).
        seed: the seed of this generator's stream.
        values: the pool answers are drawn from (decimal strings). :func:`answer_values` gives the numbers
            that are a single token after `` ``\u0060\u0060`` `` for a given tokenizer.

    Example:
        >>> gen = FactGenerator("train", seed=0, values=[str(v) for v in range(10, 100)])
        >>> fs = gen.fact_set(n_facts=3)
        >>> len(fs.facts), all(f.statement in fs.passage for f in fs.facts)
        (3, True)
    """

    def __init__(self, split: str, seed: int, values: Sequence[str]):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if not values:
            raise ValueError("values must hold at least one answer string")
        self.split = split
        self.values = list(values)
        # The split name is part of the seed, so train and eval streams differ even for equal seeds.
        self.rng = random.Random(f"hf_kvtransfer.evaluation.tasks:{split}:{seed}")

    def name(self, kind: str = "lower", used: set[str] | None = None) -> str:
        """A made-up identifier of this split's pool (``lower``, ``snake``, ``Class`` or ``CONST``)."""
        for _ in range(1000):
            if kind == "snake":
                n = self.rng.choice(_VERBS) + "_" + _word(self.rng, 1, 2)
            elif kind == "Class":
                n = _word(self.rng, 2, 3).capitalize()
            elif kind == "CONST":
                n = (_word(self.rng, 1, 2) + "_" + _word(self.rng, 1, 2)).upper()
            else:
                n = _word(self.rng, 2, 3)
            if _split_of(n) == _NAME_POOL[self.split] and (used is None or n not in used):
                if used is not None:
                    used.add(n)
                return n
        raise RuntimeError("could not draw a fresh identifier")  # pragma: no cover - 1000 tries

    def fact_set(self, n_facts: int = 4, n_filler: int = 2) -> FactSet:
        """A passage of ``n_facts`` facts (distinct keys and distinct values) plus filler sentences."""
        rng = self.rng
        used: set[str] = set()
        mod = self.name("lower", used) + "." + self.name("lower", used)
        if n_facts > len(self.values):
            raise ValueError(f"n_facts={n_facts} needs at least that many values, got {len(self.values)}")
        vals = rng.sample(self.values, n_facts)
        facts = []
        for val in vals:
            kind, stmt, q = rng.choice(_TEMPLATES)
            names = dict(
                mod=mod, val=val,
                func=self.name("snake", used), param=self.name("lower", used), cls=self.name("Class", used),
                attr=self.name("lower", used), meth=self.name("snake", used), const=self.name("CONST", used),
            )
            # The key is the part of the question that picks this fact out of the passage.
            key = {"default": "{param}/{func}", "attr": "{cls}.{attr}", "port": "{func}", "retries": "{cls}.{meth}",
                   "limit": "{param}/{cls}", "const": "{const}"}[kind].format(**names)
            facts.append(Fact(key=key, value=val, statement=stmt.format(**names), question=q.format(**names), kind=kind))
        fill = [rng.choice(_FILLER).format(
            mod=mod, func=self.name("snake", used), cls=self.name("Class", used), meth=self.name("snake", used),
            noun=rng.choice(_NOUNS), minor=rng.randint(2, 12)) for _ in range(n_filler)]
        # Filler goes between facts, never inside one; facts keep their drawn order.
        body = list(facts) + fill
        order = sorted(range(len(body)), key=lambda i: (rng.random() if i >= n_facts else i / n_facts + rng.random() * 0.5))
        lines = [body[i].statement if isinstance(body[i], Fact) else body[i] for i in order]
        passage = f":mod:`{mod}` --- {_word(rng).capitalize()} {rng.choice(_NOUNS)} utilities\n\n" + "\n\n".join(lines)
        return FactSet(module=mod, facts=tuple(facts), passage=passage)


# Two-hop passages: facts about functions, and alias lines that point an alias at one of those functions. Each
# template names the function alone, so a question about an alias can be answered only through its alias line.
_FUNC_TEMPLATES = [
    _TEMPLATES[2],  # port
    ("timeout",
     ":func:`{mod}.{func}` gives up after ``{val}`` seconds.",
     "After how many seconds does :func:`{mod}.{func}` give up?"),
    ("workers",
     ":func:`{mod}.{func}` starts ``{val}`` worker threads.",
     "How many worker threads does :func:`{mod}.{func}` start?"),
]
_ALIAS = "The :func:`{mod}.{alias}` function is an alias of :func:`{mod}.{func}`."


@dataclass(frozen=True)
class TwoHopSet:
    """A passage of function facts and alias lines, with one two-hop question per alias.

    Args:
        module: the module the passage documents.
        facts: the function facts, in passage order (each also answerable in one hop).
        questions: one per alias, in passage order of the alias lines: `Fact.key` is the alias, `Fact.value` the
            value of the aliased function's fact, and `statement` / `question` name the alias, not the function.
        aliases: alias -> function name (both without the module).
        passage: the docs-style text.
    """

    module: str
    facts: tuple[Fact, ...]
    questions: tuple[Fact, ...]
    aliases: dict[str, str]
    passage: str


def _two_hop_set(gen: FactGenerator, n_facts: int, n_aliases: int, n_filler: int) -> TwoHopSet:
    """Draw a :class:`TwoHopSet` from `gen` (own RNG draws only: `FactGenerator.fact_set` streams are unaffected)."""
    if not 1 <= n_aliases <= n_facts or n_facts > len(gen.values):
        raise ValueError(f"need 1 <= n_aliases <= n_facts <= {len(gen.values)} values, got {n_aliases}, {n_facts}")
    rng, used = gen.rng, set()
    mod = gen.name("lower", used) + "." + gen.name("lower", used)
    facts, questions, lines, aliases = [], [], [], {}
    for val in rng.sample(gen.values, n_facts):
        kind, stmt, q = rng.choice(_FUNC_TEMPLATES)
        names = dict(mod=mod, val=val, func=gen.name("snake", used))
        key = names["func"]
        facts.append(Fact(key, val, stmt.format(**names), q.format(**names), kind))
        lines.append((facts[-1].statement, names, kind, stmt, q))
    alias_lines = []
    for i in rng.sample(range(n_facts), n_aliases):
        _, names, kind, stmt, q = lines[i]
        alias = gen.name("snake", used)
        aliases[alias] = names["func"]
        via = dict(names, func=alias)
        alias_lines.append(_ALIAS.format(mod=mod, alias=alias, func=names["func"]))
        questions.append(Fact(alias, names["val"], stmt.format(**via), q.format(**via), "two_hop_" + kind))
    fill = [rng.choice(_FILLER).format(
        mod=mod, func=gen.name("snake", used), cls=gen.name("Class", used), meth=gen.name("snake", used),
        noun=rng.choice(_NOUNS), minor=rng.randint(2, 12)) for _ in range(n_filler)]
    body = [ln[0] for ln in lines] + alias_lines + fill
    rng.shuffle(body)  # an alias line may come before or after the fact it points at
    passage = f":mod:`{mod}` --- {_word(rng).capitalize()} {rng.choice(_NOUNS)} utilities\n\n" + "\n\n".join(body)
    by_line = {a: body.index(ln) for a, ln in zip(aliases, alias_lines)}
    order = sorted(range(n_aliases), key=lambda j: by_line[questions[j].key])
    return TwoHopSet(mod, tuple(facts), tuple(questions[j] for j in order), aliases, passage)


def two_hop_document(gen: FactGenerator, distractor: str = "", n_facts: int = 4, n_aliases: int = 2,
                     n_questions: int = 3) -> str:
    """A training document: a two-hop passage, distractor text, then questions with answers.

    Questions are drawn from the two-hop questions and the one-hop facts together (each at most once), so a model
    cannot tell from the question form alone whether an alias must be followed.
    """
    ts = _two_hop_set(gen, n_facts, n_aliases, n_filler=2)
    pool = list(ts.questions) + list(ts.facts)
    asked = gen.rng.sample(pool, min(n_questions, len(pool)))
    qa = "\n\n".join(_qa(f) + f.value + "``" for f in asked)
    parts = [ts.passage] + ([distractor.strip()] if distractor.strip() else []) + [qa]
    return "\n\n".join(parts)


def fact_document(gen: FactGenerator, distractor: str = "", n_facts: int = 4, n_questions: int = 3) -> str:
    """A training document: passage, distractor text, then ``n_questions`` questions with answers.

    The questions ask facts of the passage in a random order (each at most once).
    """
    fs = gen.fact_set(n_facts)
    asked = gen.rng.sample(list(fs.facts), min(n_questions, n_facts))
    qa = "\n\n".join(_qa(f) + f.value + "``" for f in asked)
    parts = [fs.passage] + ([distractor.strip()] if distractor.strip() else []) + [qa]
    return "\n\n".join(parts)


def _qa(f: Fact) -> str:
    # The answer restates the passage line up to the value, which it leaves for the model: a cloze. The value is
    # still only in the passage, so the no-passage floor stays at chance, but a small model can answer by finding
    # the sentence (induction over the key) instead of also learning to map each question form to its statement.
    return f"Q: {f.question}\nA: {f.answer_prefix}"


# ------------------------------------------------------------------------------------------- tokenizers
def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def answer_values(tokenizer, lo: int = 2, hi: int = 999) -> list[str]:
    """Numbers in ``[lo, hi]`` that are one token after `` ``\u0060\u0060`` `` and keep the prompt's tokens intact.

    With these, "the answer" is one token: accuracy is exact match of that token.
    """
    probe = _encode(tokenizer, "A: ``")
    cands = [str(v) for v in range(lo, hi + 1)]
    # one batched call: this runs once per item list, and per-string calls are slow on a busy CPU
    alone = tokenizer(cands, add_special_tokens=False)["input_ids"]
    ctx = tokenizer(["A: ``" + s + "``\n" for s in cands], add_special_tokens=False)["input_ids"]
    out = []
    for s, a, ids in zip(cands, alone, ctx):
        if len(a) == 1 and ids[: len(probe)] == probe and len(ids) > len(probe) and ids[len(probe)] == a[0]:
            out.append(s)
    if len(out) < 16:
        raise ValueError(f"only {len(out)} single-token numbers in [{lo}, {hi}] for this tokenizer; widen the range")
    return out


# ------------------------------------------------------------------------------------------- items
@dataclass
class RepeatedSpanItem:
    """A window whose continuation repeats a span of its prefix.

    Args:
        prefix_ids: the prefix (context) tokens; the span's first occurrence is at ``first_start``.
        continuation_ids: the tokens scored after the prefix.
        repeat_mask: one bool per continuation token: ``True`` where that token is part of the repeat
            and predictable by copying (the repeat's first token is excluded: nothing announces it).
        control_prefix_ids: the same prefix with the first occurrence replaced by other tokens of the same
            length (same source kind): NLL of the repeat under it is the "without the first occurrence" score.
        kind: ``"random"`` (uniform random token ids) or ``"text"`` (a passage of the given text).
        meta: span length, positions, seed.
    """

    prefix_ids: list[int]
    continuation_ids: list[int]
    repeat_mask: list[bool]
    control_prefix_ids: list[int]
    kind: str
    first_start: int
    span_len: int
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class PassageRecallItem:
    """Passage + distractor + question; the answer is in the passage only.

    Args:
        prompt_ids: passage, distractor, the question and the answer's start (`Fact.answer_prefix`): ends right before the value.
        answer_ids: the answer tokens (one token with :func:`answer_values`).
        no_passage_prompt_ids: the same prompt without the passage (distractor + question): the floor.
        passage_values: the answers of all facts in the passage (for the "guess any passage value" baseline).
        meta: fact kind, key, position of the fact, number of facts, seed.
    """

    prompt_ids: list[int]
    answer_ids: list[int]
    no_passage_prompt_ids: list[int]
    passage_values: list[list[int]]
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class HandoffItem:
    """Passage + question 1 + answer 1, then question 2 (both answered by the passage).

    Args:
        prompt_ids: passage + distractor + question 1 and its answer's start (what the source reads).
        answer1_ids: answer to question 1.
        followup_ids: closing of answer 1 and question 2 up to its answer (what is appended after the answer).
        answer2_ids: answer to question 2.
        meta: keys, kinds, seed.
    """

    prompt_ids: list[int]
    answer1_ids: list[int]
    followup_ids: list[int]
    answer2_ids: list[int]
    meta: dict[str, Any] = field(default_factory=dict)


def _distractor(rng: random.Random, texts: Sequence[str] | None, gen: FactGenerator, n_chars: tuple[int, int]) -> str:
    """Distractor text: a random chunk of ``texts`` (cut at line boundaries) or generated filler."""
    lo, hi = n_chars
    want = rng.randint(lo, hi)
    if texts:
        t = rng.choice([x for x in texts if x.strip()])
        lines = t.split("\n")
        start = rng.randrange(len(lines))
        out, size = [], 0
        for ln in lines[start:] + lines[:start]:
            out.append(ln)
            size += len(ln) + 1
            if size >= want:
                break
        return _strip_numbers("\n".join(out).strip())
    fill = []
    while sum(map(len, fill)) < want:
        fill.append(gen.fact_set(0, n_filler=3).passage)
    return _strip_numbers("\n\n".join(fill))


def _strip_numbers(text: str) -> str:
    # Answers are numbers: the distractor holds none, so an answer token can only come from the passage.
    return re.sub(r"\d+", "N", text)


def passage_recall_items(
    tokenizer,
    n: int,
    seed: int = 0,
    *,
    n_facts: int = 4,
    distractor_texts: Sequence[str] | None = None,
    distractor_chars: tuple[int, int] = (300, 900),
    split: str = "eval",
) -> list[PassageRecallItem]:
    """Build ``n`` passage-recall items.

    Args:
        tokenizer: a ``transformers`` tokenizer (no special tokens are added).
        n: number of items.
        seed: seed of the item stream (items are a pure function of ``seed``, ``split`` and the tokenizer).
        n_facts: facts per passage (distinct keys and values); one of them is asked.
        distractor_texts: documents to cut the distractor from (e.g. held-out docs); default generated filler.
        distractor_chars: distractor length range in characters.
        split: name pool and seed stream; ``"eval"`` (default) never shares identifiers with ``"train"``;
            ``"probe"`` is what the fit's content probe decides on (other items than ``"eval"``'s).

    Returns:
        list of :class:`PassageRecallItem`.
    """
    values = answer_values(tokenizer)
    gen = FactGenerator(split, seed, values)
    rng = random.Random(f"hf_kvtransfer.evaluation.tasks.recall:{split}:{seed}")
    items = []
    for i in range(n):
        fs = gen.fact_set(n_facts)
        qi = rng.randrange(n_facts)
        f = fs.facts[qi]
        dis = _distractor(rng, distractor_texts, gen, distractor_chars)
        head = fs.passage + "\n\n" + dis + "\n\n"
        prompt = _encode(tokenizer, head + _qa(f))
        items.append(PassageRecallItem(
            prompt_ids=prompt,
            answer_ids=_encode(tokenizer, f.value),
            no_passage_prompt_ids=_encode(tokenizer, dis + "\n\n" + _qa(f)),
            passage_values=[_encode(tokenizer, g.value) for g in fs.facts],
            meta=dict(index=i, seed=seed, split=split, kind=f.kind, key=f.key, value=f.value, fact_index=qi,
                      n_facts=n_facts, module=fs.module),
        ))
    return items


NEEDLE_POSITIONS = {"start": 0.0, "middle": 0.5, "end": 1.0}  # the share of the haystack before the needle


def _haystack(rng: random.Random, tokenizer, texts: Sequence[str] | None, gen: FactGenerator, n_tokens: int) -> list[int]:
    """`n_tokens` tokens of number-free distractor text (chunks of `texts`, or generated filler)."""
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids += _encode(tokenizer, _distractor(rng, texts, gen, (600, 1200)) + "\n\n")
    return ids[:n_tokens]


def needle_recall_items(
    tokenizer,
    n: int,
    context_tokens: int,
    position: str | float,
    seed: int = 0,
    *,
    n_facts: int = 4,
    distractor_texts: Sequence[str] | None = None,
    split: str = "eval",
) -> list[PassageRecallItem]:
    """Passage-recall items of a given length with the passage at a given depth: the needle in a haystack.

    Each prompt is `context_tokens` tokens of haystack and passage (a fact set, as in :func:`passage_recall_items`),
    then the question; `position` is how much of the haystack comes before the passage: ``"start"`` (none),
    ``"middle"`` (half), ``"end"`` (all), or a fraction in [0, 1]. The no-passage prompt is the same haystack
    without the passage (the floor). Items are a pure function of the arguments and the tokenizer.

    Raises:
        ValueError: when `context_tokens` cannot hold the passage, or `position` is unknown.
    """
    frac = NEEDLE_POSITIONS.get(position, position) if isinstance(position, str) else float(position)
    if isinstance(frac, str) or not 0.0 <= frac <= 1.0:
        raise ValueError(f"position must be one of {sorted(NEEDLE_POSITIONS)} or a fraction in [0, 1], got {position!r}")
    values = answer_values(tokenizer)
    # Every cell of a length x position grid asks the same facts; the positions of one length share a haystack.
    gen, filler = FactGenerator(split, seed + 3_000_003, values), FactGenerator(split, seed + 4_000_003, values)
    ask = random.Random(f"hf_kvtransfer.evaluation.tasks.needle:{split}:{seed}")
    rng = random.Random(f"hf_kvtransfer.evaluation.tasks.needle:{split}:{seed}:{context_tokens}")
    items = []
    for i in range(n):
        fs = gen.fact_set(n_facts)
        qi = ask.randrange(n_facts)
        f = fs.facts[qi]
        needle = _encode(tokenizer, fs.passage + "\n\n")
        fill = context_tokens - len(needle)
        if fill < 0:
            raise ValueError(f"context_tokens={context_tokens} cannot hold a passage of {len(needle)} tokens with this "
                             f"tokenizer; use context lengths well above {len(needle)} (--depth-lengths)")
        hay = _haystack(rng, tokenizer, distractor_texts, filler, fill)
        before = round(frac * fill)
        question = _encode(tokenizer, "\n\n" + _qa(f))
        items.append(PassageRecallItem(
            prompt_ids=hay[:before] + needle + hay[before:] + question,
            answer_ids=_encode(tokenizer, f.value),
            no_passage_prompt_ids=hay + question,
            passage_values=[_encode(tokenizer, g.value) for g in fs.facts],
            meta=dict(index=i, seed=seed, split=split, kind=f.kind, key=f.key, value=f.value, fact_index=qi,
                      n_facts=n_facts, context_tokens=context_tokens, position=frac, needle_start=before,
                      question=f.question, answer_prefix=f.answer_prefix),
        ))  # fmt: skip
    return items


def needle_grid(
    tokenizer,
    lengths: Sequence[int],
    positions: Sequence[str | float],
    n: int,
    seed: int = 0,
    *,
    distractor_texts: Sequence[str] | None = None,
) -> list[tuple[int, str | float, list[PassageRecallItem]]]:
    """`needle_recall_items` for every (length, position), lengths first: `[(length, position, items), ...]`.

    Built at once, before any model runs, so that a length too short for a passage fails before any cell is scored.
    """
    return [(length, position, needle_recall_items(tokenizer, n, length, position, seed, distractor_texts=distractor_texts))
            for length in lengths for position in positions]  # fmt: skip


def handoff_items(
    tokenizer,
    n: int,
    seed: int = 0,
    *,
    n_facts: int = 4,
    distractor_texts: Sequence[str] | None = None,
    distractor_chars: tuple[int, int] = (300, 900),
    split: str = "eval",
) -> list[HandoffItem]:
    """Build ``n`` hand-off items: the source answers question 1, the target answers question 2.

    The two questions ask different facts of the same passage; answer 2 is in the passage only.
    ``prompt_ids + answer1_ids + followup_ids`` is exactly the token sequence of the whole dialogue up to
    answer 2.
    """
    values = answer_values(tokenizer)
    gen = FactGenerator(split, seed + 1_000_003, values)
    rng = random.Random(f"hf_kvtransfer.evaluation.tasks.handoff:{split}:{seed}")
    items = []
    for i in range(n):
        fs = gen.fact_set(n_facts)
        q1, q2 = rng.sample(range(n_facts), 2)
        f1, f2 = fs.facts[q1], fs.facts[q2]
        dis = _distractor(rng, distractor_texts, gen, distractor_chars)
        head = fs.passage + "\n\n" + dis + "\n\n" + _qa(f1)
        full1 = head + f1.value + "``\n\n" + _qa(f2)
        p = _encode(tokenizer, head)
        a1 = _encode(tokenizer, f1.value)
        whole = _encode(tokenizer, full1)
        if whole[: len(p) + len(a1)] != p + a1:
            raise ValueError("tokenization of the dialogue does not split at the answer; use answer_values()")
        items.append(HandoffItem(
            prompt_ids=p, answer1_ids=a1, followup_ids=whole[len(p) + len(a1):],
            answer2_ids=_encode(tokenizer, f2.value),
            meta=dict(index=i, seed=seed, split=split, key1=f1.key, key2=f2.key, kind1=f1.kind, kind2=f2.kind,
                      value1=f1.value, value2=f2.value, n_facts=n_facts, module=fs.module),
        ))
    return items


def two_hop_items(
    tokenizer,
    n: int,
    seed: int = 0,
    *,
    n_facts: int = 4,
    n_aliases: int = 2,
    distractor_texts: Sequence[str] | None = None,
    distractor_chars: tuple[int, int] = (300, 900),
    split: str = "eval",
) -> list[PassageRecallItem]:
    """Build ``n`` two-hop recall items: the question names an alias, the answer is its function's value.

    The passage holds ``n_facts`` function facts (distinct values) and ``n_aliases`` alias lines, each pointing at a
    different function; the asked alias's function is the only one whose fact answers it. Items are
    :class:`PassageRecallItem` (score them with `content.passage_recall`); ``passage_values`` holds every fact's
    value, ``meta["function"]`` the aliased function.
    """
    values = answer_values(tokenizer)
    gen = FactGenerator(split, seed + 2_000_003, values)
    rng = random.Random(f"hf_kvtransfer.evaluation.tasks.two_hop:{split}:{seed}")
    items = []
    for i in range(n):
        ts = _two_hop_set(gen, n_facts, n_aliases, n_filler=2)
        f = ts.questions[rng.randrange(n_aliases)]
        dis = _distractor(rng, distractor_texts, gen, distractor_chars)
        items.append(PassageRecallItem(
            prompt_ids=_encode(tokenizer, ts.passage + "\n\n" + dis + "\n\n" + _qa(f)),
            answer_ids=_encode(tokenizer, f.value),
            no_passage_prompt_ids=_encode(tokenizer, dis + "\n\n" + _qa(f)),
            passage_values=[_encode(tokenizer, g.value) for g in ts.facts],
            meta=dict(index=i, seed=seed, split=split, kind=f.kind, key=f.key, value=f.value,
                      function=ts.aliases[f.key], n_facts=n_facts, n_aliases=n_aliases, module=ts.module),
        ))
    return items


def _text_passage(rng: random.Random, text_ids: list[int], length: int, avoid: tuple[int, int]) -> list[int]:
    """`length` consecutive tokens of `text_ids` that do not overlap `[avoid[0], avoid[1])` (the item's window)."""
    while True:
        s = rng.randrange(len(text_ids) - length)
        if s + length <= avoid[0] or s >= avoid[1]:
            return text_ids[s : s + length]


def repeated_span_items(
    tokenizer_or_vocab_size,
    text_ids: Sequence[int],
    n: int,
    seed: int = 0,
    *,
    prefix_len: int = 256,
    continuation_len: int = 64,
    span_len: int = 24,
    kind: str = "random",
    repeat_offset: int = 8,
    special_ids: Sequence[int] = (),
) -> list[RepeatedSpanItem]:
    """Windows of held-out text where a span of the prefix is repeated in the continuation.

    Each window is ``prefix_len + continuation_len`` tokens of ``text_ids`` (a token stream, e.g. a held-out
    document set). A span of ``span_len`` tokens is written into the prefix at a random position and again
    into the continuation at ``repeat_offset``. For ``kind="random"`` the span is uniform random token ids;
    for ``kind="text"`` it is a passage taken from elsewhere in ``text_ids`` (not from the window).
    The control prefix replaces the first occurrence with a different span of the same kind and length.

    Args:
        tokenizer_or_vocab_size: a tokenizer (its length and special ids are used) or an int vocabulary size.
        text_ids: the token stream windows and text spans are cut from.
        n: number of items.
        seed: item stream seed.
        prefix_len, continuation_len: window layout.
        span_len: repeated span length (``< prefix_len`` and ``<= continuation_len - repeat_offset``).
        kind: ``"random"`` or ``"text"``.
        repeat_offset: where the repeat starts in the continuation.
        special_ids: token ids never drawn for random spans (a tokenizer's special ids are added).

    Returns:
        list of :class:`RepeatedSpanItem`; ``repeat_mask`` marks continuation positions
        ``repeat_offset + 1 .. repeat_offset + span_len - 1``.
    """
    _check_span(kind, span_len, prefix_len, continuation_len, repeat_offset)
    allowed = _drawable_ids(tokenizer_or_vocab_size, special_ids)
    W = prefix_len + continuation_len
    text_ids = _token_stream(text_ids, W, span_len)
    rng = random.Random(f"hf_kvtransfer.evaluation.tasks.repeat:{kind}:{seed}")

    def draw_span(avoid: tuple[int, int]) -> list[int]:
        if kind == "random":
            return [rng.choice(allowed) for _ in range(span_len)]
        return _text_passage(rng, text_ids, span_len, avoid)

    items = []
    for i, (w0, window) in enumerate(_windows(rng, text_ids, W, n)):
        span = draw_span((w0, w0 + W))
        other = draw_span((w0, w0 + W))
        first = rng.randrange(0, prefix_len - span_len)
        mask = [repeat_offset < j < repeat_offset + span_len for j in range(continuation_len)]
        items.append(RepeatedSpanItem(
            prefix_ids=_spliced(window[:prefix_len], first, span),
            continuation_ids=_spliced(window[prefix_len:], repeat_offset, span), repeat_mask=mask,
            control_prefix_ids=_spliced(window[:prefix_len], first, other), kind=kind, first_start=first,
            span_len=span_len, meta=dict(index=i, seed=seed, window_start=w0, distance=prefix_len - first + repeat_offset),
        ))
    return items


def _check_span(kind: str, span_len: int, prefix_len: int, continuation_len: int, repeat_offset: int) -> None:
    """`repeated_span_items`' span: of a known kind, in the prefix and in the continuation after `repeat_offset`."""
    if kind not in ("random", "text"):
        raise ValueError(f"kind must be 'random' or 'text', got {kind!r}")
    if span_len >= prefix_len or repeat_offset + span_len > continuation_len or span_len < 2:
        raise ValueError(
            f"span_len={span_len} must be in [2, prefix_len) and fit the continuation "
            f"(repeat_offset={repeat_offset}, continuation_len={continuation_len})"
        )


def _drawable_ids(tokenizer_or_vocab_size, special_ids: Sequence[int]) -> list[int]:
    """The vocabulary's ids (a tokenizer's length, or the int given) but `special_ids` and a tokenizer's own."""
    if isinstance(tokenizer_or_vocab_size, int):
        vocab, specials = tokenizer_or_vocab_size, set(special_ids)
    else:
        vocab = len(tokenizer_or_vocab_size)
        specials = set(special_ids) | set(getattr(tokenizer_or_vocab_size, "all_special_ids", []) or [])
    return [t for t in range(vocab) if t not in specials]


def _token_stream(text_ids: Sequence[int], window: int, span: int) -> list[int]:
    """`text_ids` as a list, checked to hold two windows of `window` tokens and a passage of `span`."""
    text_ids = list(text_ids)
    if len(text_ids) < 2 * window + span:
        raise ValueError(f"text_ids has {len(text_ids)} tokens; need at least {2 * window + span}")
    return text_ids


def _windows(rng: random.Random, text_ids: list[int], size: int, n: int) -> Iterator[tuple[int, list[int]]]:
    """`n` windows of `size` tokens at random starts in `text_ids`, as `(start, tokens)`, drawn one at a time."""
    for _ in range(n):
        w0 = rng.randrange(len(text_ids) - size)
        yield w0, text_ids[w0 : w0 + size]


def _spliced(tokens: list[int], start: int, span: list[int]) -> list[int]:
    """`tokens` with `span` written over them from `start` (in place; returned)."""
    tokens[start : start + len(span)] = span
    return tokens


def cued_recall_items(
    text_ids: Sequence[int],
    n: int,
    seed: int = 0,
    *,
    prefix_len: int = 256,
    continuation_len: int = 64,
    num_records: int = 4,
    key_len: int = 8,
    cue_len: int = 4,
    value_len: int = 2,
    repeat_offset: int = 8,
) -> list[RepeatedSpanItem]:
    """Windows of held-out text holding `num_records` records `key + cue + value`; the continuation asks one back.

    Every token is text cut from `text_ids` (a held-out stream) outside the window: each record's key and value
    are passages of their own, the cue is one passage shared by all records of the window. The continuation
    repeats one record's key and cue at `repeat_offset`, then its value; only the value's **first** token is scored
    (`repeat_mask`). The tokens right before it (the cue) are the same in every record, so copying from the last
    few tokens cannot tell which value comes: the model must find the record by its key, `cue_len` and more
    tokens back, as a passage-recall question finds its fact. The control prefix has that record's value replaced
    by other text (the floor: the value is nowhere in the context).

    Returns:
        list of :class:`RepeatedSpanItem` of kind ``"cued"`` (scored with `repeated_span_retention`).
    """
    record_len = key_len + cue_len + value_len
    if num_records * record_len > prefix_len or repeat_offset + record_len > continuation_len or min(key_len, cue_len, value_len) < 1:
        raise ValueError(
            f"{num_records} records of {record_len} tokens must fit the prefix ({prefix_len}) and one the "
            f"continuation after repeat_offset={repeat_offset} ({continuation_len})"
        )
    W = prefix_len + continuation_len
    text_ids = _token_stream(text_ids, W, record_len)
    rng = random.Random(f"hf_kvtransfer.evaluation.tasks.cued:{seed}")
    passage = functools.partial(_text_passage, rng, text_ids)  # (length, avoid)

    items = []
    for i, (w0, window) in enumerate(_windows(rng, text_ids, W, n)):
        avoid = (w0, w0 + W)
        cue = passage(cue_len, avoid)
        records = [passage(key_len, avoid) + cue + passage(value_len, avoid) for _ in range(num_records)]
        # Non-overlapping record slots spread over the prefix, in random order.
        slot = prefix_len // num_records
        starts = [k * slot + rng.randrange(0, slot - record_len + 1) for k in range(num_records)]
        asked = rng.randrange(num_records)
        prefix = window[:prefix_len]
        for start, record in zip(starts, records):
            _spliced(prefix, start, record)
        value_at = starts[asked] + key_len + cue_len
        control = _spliced(list(prefix), value_at, passage(value_len, avoid))
        cont = _spliced(window[prefix_len:], repeat_offset, records[asked])
        scored = repeat_offset + key_len + cue_len
        items.append(RepeatedSpanItem(
            prefix_ids=prefix, continuation_ids=cont, repeat_mask=[j == scored for j in range(continuation_len)],
            control_prefix_ids=control, kind="cued", first_start=starts[asked], span_len=record_len,
            meta=dict(index=i, seed=seed, window_start=w0, asked=asked, num_records=num_records,
                      distance=prefix_len - value_at + scored),
        ))  # fmt: skip
    return items
