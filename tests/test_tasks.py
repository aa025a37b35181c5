"""hf_kvtransfer.evaluation.tasks: deterministic, held-out content items (repeated spans, passage recall, hand-off)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hf_kvtransfer.evaluation import tasks
from hf_kvtransfer.evaluation.tasks import (
    FactGenerator,
    answer_values,
    fact_document,
    handoff_items,
    passage_recall_items,
    repeated_span_items,
)

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "examples" / "family" / "tokenizer"


@pytest.fixture(scope="module")
def tok():
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        pytest.skip("examples/family/tokenizer is missing")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def _contains(seq: list[int], sub: list[int]) -> int:
    """Number of (possibly overlapping) occurrences of sub in seq."""
    n = len(sub)
    return sum(seq[i : i + n] == sub for i in range(len(seq) - n + 1))


VALUES = [str(v) for v in range(10, 100)]


def test_fact_generator_is_deterministic_and_split_dependent():
    a = FactGenerator("train", 3, VALUES).fact_set(4)
    b = FactGenerator("train", 3, VALUES).fact_set(4)
    c = FactGenerator("eval", 3, VALUES).fact_set(4)
    d = FactGenerator("train", 4, VALUES).fact_set(4)
    assert a == b
    assert a.passage != c.passage and a.passage != d.passage


def test_fact_set_keys_and_values_are_unique_and_stated_once():
    gen = FactGenerator("eval", 0, VALUES)
    for _ in range(50):
        fs = gen.fact_set(5)
        assert len({f.key for f in fs.facts}) == 5
        assert len({f.value for f in fs.facts}) == 5
        for f in fs.facts:
            assert fs.passage.count(f.statement) == 1
            # the value appears in the passage exactly once, as a ``literal``
            assert fs.passage.count(f"``{f.value}``") == 1


def _identifiers(text: str) -> set[str]:
    # made-up names are lowercase/capitalised/upper words in roles, dotted paths split into parts
    names = set()
    for m in re.finditer(r":(?:func|class|attr|meth|data|mod):`([^`]+)`|``([A-Za-z_][A-Za-z_]*)``", text):
        for part in (m.group(1) or m.group(2)).split("."):
            names.add(part)
    return names


def test_train_and_eval_name_pools_are_disjoint():
    train, evl = set(), set()
    for seed in range(40):
        train |= _identifiers(fact_document(FactGenerator("train", seed, VALUES), n_facts=6))
        evl |= _identifiers(fact_document(FactGenerator("eval", seed, VALUES), n_facts=6))
    # the only shared identifiers allowed are fixed vocabulary, never drawn names
    shared = {n for n in train & evl if n not in {"ValueError"}}
    assert len(train) > 300 and len(evl) > 300
    assert not shared, sorted(shared)[:10]
    assert all(tasks._split_of(n) == "eval" for n in evl - {"ValueError"})
    assert all(tasks._split_of(n) == "train" for n in train - {"ValueError"})


def test_split_of_assigns_names_to_one_pool():
    gen_t, gen_e = FactGenerator("train", 0, VALUES), FactGenerator("eval", 0, VALUES)
    for _ in range(200):
        assert tasks._split_of(gen_t.name("snake")) == "train"
        assert tasks._split_of(gen_e.name("Class")) == "eval"


def test_unknown_split_and_empty_values_fail():
    with pytest.raises(ValueError, match="split"):
        FactGenerator("test", 0, VALUES)
    with pytest.raises(ValueError, match="values"):
        FactGenerator("train", 0, [])


def test_answer_values_are_single_tokens_in_context(tok):
    vals = answer_values(tok)
    assert len(vals) >= 16
    for v in vals:
        ids = tok("A: ``" + v + "``", add_special_tokens=False)["input_ids"]
        prompt = tok("A: ``", add_special_tokens=False)["input_ids"]
        assert ids[: len(prompt)] == prompt
        assert ids[len(prompt)] == tok(v, add_special_tokens=False)["input_ids"][0]


def test_passage_recall_items(tok):
    items = passage_recall_items(tok, 30, seed=1)
    again = passage_recall_items(tok, 30, seed=1)
    other = passage_recall_items(tok, 30, seed=2)
    assert [i.prompt_ids for i in items] == [i.prompt_ids for i in again]
    assert [i.prompt_ids for i in items] != [i.prompt_ids for i in other]
    for it in items:
        assert len(it.answer_ids) == 1
        text = tok.decode(it.prompt_ids)
        value = it.meta["value"]
        # the answer restates the passage line up to the value (a cloze): find that line in the text itself
        line = next(ln for ln in text.split("\n") if f"``{value}``" in ln)
        assert text.endswith("\nA: " + line[: line.index(f"``{value}``") + 2])
        # the answer is stated in the passage exactly once and nowhere else in the prompt
        assert text.count(f"``{value}``") == 1
        passage_end = text.index(f"``{value}``")
        assert "Q:" not in text[:passage_end]
        # and the answer token does not occur at all in the no-passage prompt (distractor + question)
        no_text = tok.decode(it.no_passage_prompt_ids)
        assert it.answer_ids[0] not in it.no_passage_prompt_ids
        assert not re.search(r"\d", no_text)
        assert no_text.endswith(text[text.rindex("Q:"):])
        assert it.answer_ids in it.passage_values
        assert len(it.passage_values) == it.meta["n_facts"]
        # the prompt tokens are a prefix of the tokenization of prompt + answer: scoring the answer token is valid
        full = tok(text + value + "``", add_special_tokens=False)["input_ids"]
        assert full[: len(it.prompt_ids) + 1] == it.prompt_ids + it.answer_ids


def test_recall_items_with_distractor_texts(tok):
    docs = ["first doc line\nthe value ``42`` is here\nmore text\n" * 20, "second doc\n" * 50]
    items = passage_recall_items(tok, 10, seed=0, distractor_texts=docs)
    for it in items:
        no_text = tok.decode(it.no_passage_prompt_ids)
        assert "doc" in no_text and "``N``" in no_text or "second doc" in no_text
        assert not re.search(r"\d", no_text)  # numbers in distractors are masked out


def test_eval_items_do_not_reuse_training_names(tok):
    items = passage_recall_items(tok, 40, seed=0)
    train_text = "\n".join(fact_document(FactGenerator("train", s, answer_values(tok)), n_facts=6) for s in range(200))
    train_names = _identifiers(train_text)
    for it in items:
        key_parts = re.split(r"[./]", it.meta["key"])
        assert not set(key_parts) & train_names, key_parts


def test_handoff_items(tok):
    items = handoff_items(tok, 20, seed=0)
    assert [i.prompt_ids for i in items] == [i.prompt_ids for i in handoff_items(tok, 20, seed=0)]
    for it in items:
        assert it.meta["key1"] != it.meta["key2"]
        whole = it.prompt_ids + it.answer1_ids + it.followup_ids
        text = tok.decode(whole)
        line = next(ln for ln in text.split("\n") if f"``{it.meta['value2']}``" in ln)
        assert text.endswith("\nA: " + line[: line.index(f"``{it.meta['value2']}``") + 2])
        assert text.count("Q:") == 2
        v2 = it.meta["value2"]
        assert text.count(f"``{v2}``") == 1  # only in the passage
        assert tok.decode(it.answer2_ids) == v2 and tok.decode(it.answer1_ids) == it.meta["value1"]


def test_repeated_span_items_random_and_text():
    stream = list(range(100, 100 + 5000))  # distinct ids: every span is identifiable
    for kind in ("random", "text"):
        items = repeated_span_items(8000, stream, 25, seed=5, kind=kind, prefix_len=128, continuation_len=48,
                                    span_len=16, special_ids=[0, 1])
        assert [i.prefix_ids for i in items] == [
            i.prefix_ids for i in repeated_span_items(8000, stream, 25, seed=5, kind=kind, prefix_len=128,
                                                      continuation_len=48, span_len=16, special_ids=[0, 1])]
        for it in items:
            assert len(it.prefix_ids) == len(it.control_prefix_ids) == 128
            assert len(it.continuation_ids) == len(it.repeat_mask) == 48
            span = it.prefix_ids[it.first_start : it.first_start + 16]
            assert it.continuation_ids[8:24] == span
            assert _contains(it.control_prefix_ids, span) == 0  # control has no first occurrence
            assert it.control_prefix_ids[: it.first_start] == it.prefix_ids[: it.first_start]
            assert sum(it.repeat_mask) == 15 and it.repeat_mask[9] and not it.repeat_mask[8]
            assert 0 not in span and 1 not in span
            if kind == "text":
                w0 = it.meta["window_start"]
                src = stream.index(span[0])
                assert stream[src : src + 16] == span and not (w0 <= src < w0 + 176)


def test_repeated_span_items_rejects_bad_layout():
    with pytest.raises(ValueError, match="span_len"):
        repeated_span_items(100, list(range(2000)), 1, span_len=60, prefix_len=64, continuation_len=64)
    with pytest.raises(ValueError, match="kind"):
        repeated_span_items(100, list(range(2000)), 1, kind="other")


def test_cued_recall_items_find_the_value_only_by_its_key():
    from hf_kvtransfer.evaluation.tasks import cued_recall_items

    stream = list(range(100, 100 + 5000))  # distinct ids: every passage is identifiable by where it came from
    kwargs = dict(prefix_len=128, continuation_len=48, num_records=4, key_len=6, cue_len=4, value_len=2)
    items = cued_recall_items(stream, 40, seed=3, **kwargs)
    assert [i.prefix_ids for i in items] == [i.prefix_ids for i in cued_recall_items(stream, 40, seed=3, **kwargs)]
    asked = set()
    for it in items:
        assert len(it.prefix_ids) == len(it.control_prefix_ids) == 128 and len(it.continuation_ids) == 48
        record = it.prefix_ids[it.first_start : it.first_start + 12]
        key, cue, value = record[:6], record[6:10], record[10:]
        # The continuation repeats the asked record; the scored token is its value's first token.
        assert it.continuation_ids[8:20] == record
        assert it.repeat_mask[18] and sum(it.repeat_mask) == 1
        # Every record of the window carries the same cue: the tokens just before the value do not identify it.
        assert sum(it.prefix_ids[i : i + 4] == cue for i in range(125)) == 4
        # The control has the record's key and cue but another value: the value is nowhere in its context.
        assert it.control_prefix_ids[it.first_start : it.first_start + 10] == key + cue
        assert value[0] not in it.control_prefix_ids
        diff = [i for i, (a, b) in enumerate(zip(it.prefix_ids, it.control_prefix_ids)) if a != b]
        assert diff and min(diff) >= it.first_start + 10 and max(diff) < it.first_start + 12
        w0 = it.meta["window_start"]
        assert not any(w0 <= stream.index(tok) < w0 + 176 for tok in record)  # passages from outside the window
        asked.add(it.meta["asked"])
    assert asked == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="records"):
        cued_recall_items(stream, 1, prefix_len=32, num_records=4)


# ------------------------------------------------------------------------------------------- two-hop recall
_ALIAS_LINE = re.compile(r"The :func:`([\w.]+)\.(\w+)` function is an alias of :func:`\1\.(\w+)`\.")
_FUNC_FACT = re.compile(r":func:`[\w.]+\.(\w+)`[^`\n]*``(\d+)``")


def _resolve_two_hop(passage: str, question: str) -> str:
    """Answer a two-hop question from the passage text alone: alias line -> function -> that function's fact."""
    asked = re.search(r":func:`[\w.]+\.(\w+)`", question).group(1)
    aliases = {m.group(2): m.group(3) for m in _ALIAS_LINE.finditer(passage)}
    facts = {}
    for line in passage.split("\n\n"):
        m = _FUNC_FACT.search(line)
        if m and not _ALIAS_LINE.search(line):
            assert m.group(1) not in facts, "a function has two facts"
            facts[m.group(1)] = m.group(2)
    assert asked in aliases and asked not in facts, "the asked alias must be stated only as an alias"
    return facts[aliases[asked]]


def test_two_hop_items_are_answered_only_through_the_alias(tok):
    items = tasks.two_hop_items(tok, 40, seed=3)
    assert items == tasks.two_hop_items(tok, 40, seed=3)  # deterministic
    for it in items:
        head, _, rest = tok.decode(it.prompt_ids).partition("\n\nQ: ")  # passage + distractor, question
        resolved = _resolve_two_hop(head, "Q: " + rest)
        assert resolved == it.meta["value"] == tok.decode(it.answer_ids)
        assert it.answer_ids in it.passage_values
        # the value sits on the aliased function's line, which the question never names
        assert it.meta["function"] not in rest
        assert tok.decode(it.prompt_ids[-len(it.no_passage_prompt_ids):]) == tok.decode(it.no_passage_prompt_ids)
    # the asked fact is spread over the passage (not always the first or last line)
    assert len({it.meta["value"] for it in items}) > 10


def test_two_hop_documents_answer_each_question_from_the_passage():
    gen = FactGenerator("train", seed=5, values=VALUES)
    for _ in range(30):
        doc = tasks.two_hop_document(gen, "distractor text", n_facts=5, n_aliases=3, n_questions=4)
        blocks = doc.split("\n\nQ: ")
        passage, qas = blocks[0], blocks[1:]
        assert len(qas) == 4
        for qa in qas:
            q, a = qa.split("\nA: ")
            asked = re.search(r":func:`[\w.]+\.(\w+)`", q).group(1)
            aliases = {m.group(2): m.group(3) for m in _ALIAS_LINE.finditer(passage)}
            target = aliases.get(asked, asked)
            line = next(ln for ln in passage.split("\n\n") if f".{target}`" in ln and not _ALIAS_LINE.search(ln))
            assert re.search(r"``(\d+)``", line).group(1) == re.search(r"``(\d+)``$", a).group(1)


def test_two_hop_rejects_more_aliases_than_facts():
    with pytest.raises(ValueError, match="n_aliases"):
        tasks.two_hop_document(FactGenerator("train", seed=0, values=VALUES), n_facts=2, n_aliases=3)
