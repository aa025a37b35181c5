"""Recall by depth: needle items built as documented, and the grid scored against independent computations (an
exact identity map must give the target's own answer in every cell)."""

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import exact_identity_mapper
from hf_kvtransfer.commands.reporting import evaluation_markdown, plot_evaluation
from hf_kvtransfer.evaluation.content import recall_by_depth
from hf_kvtransfer.evaluation.tasks import needle_recall_items

FAMILY = Path(__file__).resolve().parents[1] / "examples" / "family"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(FAMILY / "small")


@pytest.fixture(scope="module")
def texts():
    return [t for t in (FAMILY / "heldout.txt").read_text(encoding="utf-8").split("\n\n\n") if t.strip()][:30]


@pytest.mark.parametrize("length", [300, 640])
def test_needle_items_put_the_passage_where_asked(tokenizer, texts, length):
    cells = {pos: needle_recall_items(tokenizer, 5, length, pos, distractor_texts=texts)
             for pos in ("start", "middle", "end", 0.25)}  # fmt: skip
    for pos, items in cells.items():
        for a, b in zip(items, cells["start"]):
            assert a.answer_ids == b.answer_ids and a.meta["key"] == b.meta["key"]  # same facts in every cell
            assert a.no_passage_prompt_ids == b.no_passage_prompt_ids  # one haystack per length
            needle = len(a.prompt_ids) - len(a.no_passage_prompt_ids)
            question = tokenizer("\n\nQ: " + a.meta["question"] + "\nA: " + a.meta["answer_prefix"],
                                 add_special_tokens=False)["input_ids"]
            assert a.prompt_ids[-len(question):] == question
            assert len(a.prompt_ids) - len(question) == length  # context tokens before the question
            hay = length - needle
            start = a.meta["needle_start"]
            assert start == round({"start": 0, "middle": 0.5, "end": 1, 0.25: 0.25}[pos] * hay)
            # Taking the needle out of the prompt gives the no-passage prompt.
            assert a.prompt_ids[:start] + a.prompt_ids[start + needle :] == a.no_passage_prompt_ids
            assert a.answer_ids[0] in a.prompt_ids[start : start + needle]  # the answer is in the needle
    with pytest.raises(ValueError, match="position must be"):
        needle_recall_items(tokenizer, 1, length, "top")
    with pytest.raises(ValueError, match="cannot hold a passage"):
        needle_recall_items(tokenizer, 1, 20, "start")


def test_identity_transfer_matches_own_in_every_cell(tokenizer, texts, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(FAMILY / "small", dtype="float32").eval()
    mapper = exact_identity_mapper(model)
    res = recall_by_depth(model, model, mapper, tokenizer, lengths=(300, 400), positions=("start", "end"), items=4,
                          distractor_texts=texts, num_bootstrap=20, progress=False)  # fmt: skip
    assert [(c["context_tokens"], c["position"]) for c in res["cells"]] == [(300, "start"), (300, "end"), (400, "start"),
                                                                           (400, "end")]  # fmt: skip
    for cell in res["cells"]:
        acc = cell["accuracy"]
        assert acc["transfer"]["mean"] == acc["own"]["mean"] == acc["source_alone"]["mean"]
        assert cell["transfer_minus_own"]["mean"] == 0
    text = evaluation_markdown({"config": {}, "recall_by_depth": res})
    assert "| 300 |" in text and "| 400 |" in text and "start | end" in text
    plot_evaluation({"config": {}, "recall_by_depth": res}, tmp_path / "depth.png")
    assert (tmp_path / "depth.png").stat().st_size > 1000


def test_eval_scores_depth_only_when_asked(tokenizer, texts):
    """`evaluate(tasks="depth")` scores the grid (an exact identity map: the target's own answer in each cell);
    the default task list leaves it out."""
    from hf_kvtransfer.evaluation.evaluate import evaluate, resolve_tasks

    assert "depth" not in resolve_tasks(None) and resolve_tasks("recall,depth") == ["recall", "depth"]
    model = AutoModelForCausalLM.from_pretrained(FAMILY / "small", dtype="float32").eval()
    text = (FAMILY / "heldout.txt").read_text(encoding="utf-8")
    res = evaluate(model, model, exact_identity_mapper(model), tokenizer, text, tasks="depth", depth_lengths=(256,),
                   depth_items=3, num_bootstrap=20, progress=False)  # fmt: skip
    assert set(res) == {"config", "recall_by_depth"}
    cells = res["recall_by_depth"]["cells"]
    assert [(c["context_tokens"], c["position"]) for c in cells] == [(256, "start"), (256, "middle"), (256, "end")]
    for cell in cells:
        assert cell["accuracy"]["transfer"]["mean"] == cell["accuracy"]["own"]["mean"]


def test_a_depth_too_short_for_a_passage_fails_before_any_task_runs(tokenizer):
    """`evaluate` builds the depth grid with the other tasks' items, before any model runs: a length that cannot hold
    a passage stops it at once, naming the option to change (no model forward is made)."""
    from hf_kvtransfer.evaluation.evaluate import evaluate

    model = AutoModelForCausalLM.from_pretrained(FAMILY / "small", dtype="float32").eval()
    mapper = exact_identity_mapper(model)
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    text = (FAMILY / "heldout.txt").read_text(encoding="utf-8")
    with pytest.raises(ValueError, match="cannot hold a passage .*--depth-lengths"):
        evaluate(model, model, mapper, tokenizer, text, tasks="recall,depth", depth_lengths=(512, 20), num_content_items=4,
                 depth_items=3, num_bootstrap=20, progress=False)  # fmt: skip
    assert calls == []
