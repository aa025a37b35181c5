"""Content evaluations (content_eval.py): each score against an independent computation, a plain forward of the
target over the whole sequence; with the model mapped onto itself by an exact identity map, transfer == own."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import VOCAB, exact_identity_mapper, random_ids, scrambled_mapper, tiny_model
from fit_fixtures import SPECIALS, make_tokenizer
from hf_kvtransfer import KVMapper, TransferredCache, prefill
from hf_kvtransfer.commands.cli import main
from hf_kvtransfer.evaluation.evaluate import evaluate
from hf_kvtransfer.evaluation.content import greedy_agreement, handoff, passage_recall, repeated_span_retention
from hf_kvtransfer.evaluation.metrics import gap_recovered_over_items, mean_and_ci, retention_over_items
from hf_kvtransfer.evaluation.tasks import HandoffItem, PassageRecallItem, repeated_span_items


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", num_hidden_layers=2, seed=3)


@pytest.fixture(scope="module")
def identity(model):
    return exact_identity_mapper(model)


@pytest.fixture(scope="module")
def broken(identity):
    return scrambled_mapper(identity)


@torch.no_grad()
def _logp(model, ids):
    """Next-token log-probs `[len(ids), V]` of one plain forward (no cache)."""
    return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _answer(model, context, answer):
    """(NLL of `answer` after `context`, whether greedy decoding writes it), from one plain forward."""
    logp = _logp(model, context + answer[:-1])[len(context) - 1 :]
    nll = -sum(float(logp[j, a]) for j, a in enumerate(answer))
    return nll, all(int(logp[j].argmax()) == a for j, a in enumerate(answer))


# -- score arithmetic ------------------------------------------------------------------------------------


def test_retention_over_items_matches_numpy():
    rng = np.random.default_rng(1)
    own, transfer, none = rng.random(40) + 0.5, rng.random(40) + 0.3, rng.random(40)
    res = retention_over_items(own, transfer, none, num_bootstrap=300, seed=7)
    assert res["retention"] == pytest.approx((transfer.mean() - none.mean()) / (own.mean() - none.mean()))
    # Paired: each resample keeps an item's three scores together (same draws as an independent loop).
    draws = np.random.default_rng(7)
    ratios = []
    for _ in range(300):
        idx = draws.integers(0, 40, 40)
        ratios.append((transfer[idx].mean() - none[idx].mean()) / (own[idx].mean() - none[idx].mean()))
    assert res["retention_ci"] == pytest.approx([np.percentile(ratios, 2.5), np.percentile(ratios, 97.5)])
    assert res["context_gain"]["mean"] == pytest.approx(own.mean() - none.mean())
    assert res["transfer_minus_own"]["mean"] == pytest.approx(transfer.mean() - own.mean())
    # Losses: lower is better, (none - transfer) / (none - own).
    res = retention_over_items(1 - own, 1 - transfer, 2 - none, higher_is_better=False, num_bootstrap=0)
    expected = ((2 - none).mean() - (1 - transfer).mean()) / ((2 - none).mean() - (1 - own).mean())
    assert res["retention"] == pytest.approx(expected) and res["retention_undefined"] is None
    # No gain from the context: no ratio, a reason instead.
    flat = retention_over_items([1.0, 0.0], [0.0, 0.0], [0.0, 1.0], num_bootstrap=10)
    assert flat["retention"] is None and flat["retention_ci"] is None and "undefined" in flat["retention_undefined"]
    alone = retention_over_items([1.0, 1.0], None, [0.0, 1.0])
    assert alone["retention"] is None and "no transfer" in alone["retention_undefined"]
    summary = mean_and_ci([0.25, 0.25, 0.25], num_bootstrap=50)
    assert summary == {"mean": 0.25, "ci": [0.25, 0.25]}


def test_gap_recovered_matches_numpy():
    rng = np.random.default_rng(2)
    own, transfer, alone = rng.random(50) + 0.6, rng.random(50) + 0.4, rng.random(50)
    res = gap_recovered_over_items(own, transfer, alone, num_bootstrap=200, seed=3)
    assert res["gap_recovered"] == pytest.approx((transfer.mean() - alone.mean()) / (own.mean() - alone.mean()))
    draws, ratios = np.random.default_rng(3), []
    for _ in range(200):  # paired: an item's three scores drawn together
        idx = draws.integers(0, 50, 50)
        ratios.append((transfer[idx].mean() - alone[idx].mean()) / (own[idx].mean() - alone[idx].mean()))
    assert res["gap_recovered_ci"] == pytest.approx([np.percentile(ratios, 2.5), np.percentile(ratios, 97.5)])
    assert res["target_minus_source"]["mean"] == pytest.approx(own.mean() - alone.mean())
    # The source as good as the target: nothing to recover, a reason instead of a ratio.
    flat = gap_recovered_over_items([1.0, 0.0], [1.0, 1.0], [0.0, 1.0], num_bootstrap=10)
    assert flat["gap_recovered"] is None and flat["gap_recovered_ci"] is None and "no better" in flat["gap_undefined"]


# -- the four evaluations --------------------------------------------------------------------------------


@pytest.mark.parametrize("recompute", [0, 2])
def test_repeated_spans_match_plain_forward(model, identity, broken, recompute):
    stream = random_ids(1, 400, seed=4)[0].tolist()
    items = repeated_span_items(VOCAB, stream, 5, seed=1, prefix_len=24, continuation_len=12, span_len=6,
                                repeat_offset=2, special_ids=range(len(SPECIALS)))  # fmt: skip
    res = repeated_span_retention(model, model, identity, items, num_recompute_tokens=recompute, batch_size=2,
                                  num_bootstrap=50, progress=False)  # fmt: skip
    for name, prefix in (("own", "prefix_ids"), ("no_context", "control_prefix_ids")):
        expected = []
        for it in items:
            logp = _logp(model, getattr(it, prefix) + it.continuation_ids)
            t = len(it.prefix_ids)
            scored = [-float(logp[t + j - 1, c]) for j, c in enumerate(it.continuation_ids) if it.repeat_mask[j]]
            expected.append(np.mean(scored))
        assert res["nll_per_item"][name] == pytest.approx(expected, abs=1e-4)
    assert res["nll_per_item"]["transfer"] == pytest.approx(res["nll_per_item"]["own"], abs=1e-4)
    assert res["num_items"] == 5 and res["scored_tokens_per_item"] == 5
    json.dumps(res)
    # Another mapper on the same items, reusing the target's own and no-context scores: those stay the plain
    # forward's, the transfer is its own.
    again = repeated_span_retention(model, model, broken, items, num_recompute_tokens=recompute, batch_size=2,
                                    num_bootstrap=50, progress=False, reference=res)  # fmt: skip
    for name in ("own", "no_context"):
        assert again["nll_per_item"][name] == pytest.approx(res["nll_per_item"][name], abs=1e-12)
    assert again["nll_per_item"]["transfer"] != pytest.approx(res["nll_per_item"]["own"], abs=1e-2)
    with pytest.raises(ValueError, match="same items and num_recompute_tokens"):
        repeated_span_retention(model, model, broken, items[:3], num_recompute_tokens=recompute, progress=False,
                                reference=res)  # fmt: skip


def _recall_items(model, count=6):
    g = torch.Generator().manual_seed(5)
    items = []
    for i in range(count):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(6, 16, (1,), generator=g)),), generator=g).tolist()
        alone = torch.randint(3, VOCAB, (5,), generator=g).tolist()
        best = int(_logp(model, prompt)[-1].argmax())
        # Half the answers are what the target predicts (right), half not; one has two tokens.
        answer = [best] if i % 2 == 0 else [3 + (best - 2) % (VOCAB - 3)]
        if i == 4:
            answer = [best, int(_logp(model, prompt + [best])[-1].argmax())]
        values = [answer, [int(torch.randint(3, VOCAB, (1,), generator=g))], [best]]
        items.append(PassageRecallItem(prompt_ids=prompt, answer_ids=answer, no_passage_prompt_ids=alone, passage_values=values))
    return items


@pytest.mark.parametrize("recompute", [1, 3])
def test_passage_recall_matches_plain_forward(model, identity, broken, recompute):
    items = _recall_items(model)
    res = passage_recall(model, model, identity, items, num_recompute_tokens=recompute, num_bootstrap=50, progress=False)
    for name, prompt in (("own", "prompt_ids"), ("no_context", "no_passage_prompt_ids")):
        scored = [_answer(model, getattr(it, prompt), it.answer_ids) for it in items]
        assert res["answer_nll_per_item"][name] == pytest.approx([nll for nll, _ in scored], abs=1e-4)
        assert res["correct_per_item"][name] == [float(ok) for _, ok in scored]
        values = [any(_answer(model, getattr(it, prompt), v)[1] for v in it.passage_values) for it in items]
        assert res["passage_value_rate"][name]["mean"] == pytest.approx(np.mean(values))
    assert res["correct_per_item"]["own"] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]  # by construction of the items
    assert res["correct_per_item"]["transfer"] == res["correct_per_item"]["own"]
    assert res["answer_nll_per_item"]["transfer"] == pytest.approx(res["answer_nll_per_item"]["own"], abs=1e-4)
    lost = passage_recall(model, model, broken, items, num_recompute_tokens=recompute, num_bootstrap=0, progress=False)
    assert max(abs(a - b) for a, b in zip(lost["answer_nll_per_item"]["transfer"], res["answer_nll_per_item"]["own"])) > 1e-2
    assert lost["answer_nll_per_item"]["own"] == res["answer_nll_per_item"]["own"]
    alone = passage_recall(None, model, None, items, num_recompute_tokens=recompute, num_bootstrap=0, progress=False)
    assert "transfer" not in alone["accuracy"] and alone["correct_per_item"]["own"] == res["correct_per_item"]["own"]
    assert "source_alone" not in alone["accuracy"] and "gap_recovered" not in alone


def test_source_alone_is_the_source_answering_itself(model, identity):
    """Recall and hand-off score the source answering on its own (a plain forward of the source), and the gap
    recovered is computed from the per-item scores."""
    source = tiny_model("qwen3", num_hidden_layers=2, seed=11)  # same KV geometry: the identity map applies
    items = _recall_items(model)
    res = passage_recall(source, model, identity, items, num_recompute_tokens=2, num_bootstrap=20, progress=False)
    scored = [_answer(source, it.prompt_ids, it.answer_ids) for it in items]
    assert res["answer_nll_per_item"]["source_alone"] == pytest.approx([nll for nll, _ in scored], abs=1e-4)
    assert res["correct_per_item"]["source_alone"] == [float(ok) for _, ok in scored]
    own, transfer, alone = (np.array(res["correct_per_item"][k]) for k in ("own", "transfer", "source_alone"))
    if own.mean() > alone.mean():
        assert res["gap_recovered"] == pytest.approx((transfer.mean() - alone.mean()) / (own.mean() - alone.mean()))
    else:
        assert res["gap_recovered"] is None and res["gap_undefined"]
    again = passage_recall(source, model, identity, items, num_recompute_tokens=2, num_bootstrap=0, progress=False,
                           reference=res)  # the source's answers do not depend on the transfer: reused
    assert again["correct_per_item"]["source_alone"] == res["correct_per_item"]["source_alone"]
    dialogue = HandoffItem(prompt_ids=items[0].prompt_ids, answer1_ids=[5], followup_ids=[7, 8, 9], answer2_ids=[4])
    out = handoff(source, model, identity, [dialogue] * 2, num_recompute_tokens=2, num_bootstrap=0, progress=False)
    said = out["answer1_per_item"][0]  # the source answers question 1, then goes on alone
    nll, ok = _answer(source, dialogue.prompt_ids + said + dialogue.followup_ids, dialogue.answer2_ids)
    assert out["answer_nll_per_item"]["source_alone"] == pytest.approx([nll, nll], abs=1e-4)
    assert out["correct_per_item"]["source_alone"] == [float(ok)] * 2


@pytest.mark.parametrize("recompute", [0, 2])
def test_handoff_matches_plain_forward(model, identity, broken, recompute):
    g = torch.Generator().manual_seed(6)
    items = []
    for i in range(4):
        prompt = torch.randint(3, VOCAB, (10 + i,), generator=g).tolist()
        said = int(_logp(model, prompt)[-1].argmax())  # what the answerer (source == target) writes
        followup = torch.randint(3, VOCAB, (4,), generator=g).tolist()
        best2 = int(_logp(model, prompt + [said] + followup)[-1].argmax())
        items.append(HandoffItem(prompt_ids=prompt, answer1_ids=[said if i < 3 else (said % 90) + 4],
                                 followup_ids=followup, answer2_ids=[best2 if i % 2 == 0 else (best2 % 90) + 4]))  # fmt: skip
    res = handoff(model, model, identity, items, num_recompute_tokens=recompute, num_bootstrap=50, progress=False)
    assert res["q1_correct_per_item"] == [1.0, 1.0, 1.0, 0.0]
    own = [_answer(model, it.prompt_ids + [int(_logp(model, it.prompt_ids)[-1].argmax())] + it.followup_ids, it.answer2_ids)
           for it in items]  # fmt: skip
    none = [_answer(model, it.followup_ids, it.answer2_ids) for it in items]
    for name, expected in (("own", own), ("no_context", none)):
        assert res["answer_nll_per_item"][name] == pytest.approx([nll for nll, _ in expected], abs=1e-4)
        assert res["correct_per_item"][name] == [float(ok) for _, ok in expected]
    assert res["correct_per_item"]["own"] == [1.0, 0.0, 1.0, 0.0]
    assert res["answer_nll_per_item"]["transfer"] == pytest.approx(res["answer_nll_per_item"]["own"], abs=1e-4)
    lost = handoff(model, model, broken, items, num_recompute_tokens=recompute, num_bootstrap=0, progress=False)
    assert max(abs(a - b) for a, b in zip(lost["answer_nll_per_item"]["transfer"], res["answer_nll_per_item"]["own"])) > 1e-2


@torch.no_grad()
def test_greedy_agreement(model, identity, broken):
    ids = random_ids(6, 12, seed=9)
    same = greedy_agreement(model, model, identity, ids, max_new_tokens=4, batch_size=4, num_bootstrap=20, progress=False)
    assert same["all_tokens_agreement"]["mean"] == 1.0 and same["agreeing_tokens_per_item"] == [4.0] * 6
    lost = greedy_agreement(model, model, broken, ids, max_new_tokens=4, num_recompute_tokens=1, batch_size=4,
                            num_bootstrap=20, progress=False)  # fmt: skip
    # First tokens, computed without generate: own = plain forward; transfer = the last prompt token on the cache.
    own_first = model(ids).logits[:, -1].argmax(-1)
    cache = TransferredCache(prefill(model, ids), broken, num_recompute_tokens=1, model=model)
    transfer_first = model(ids[:, -1:], cache=cache).logits[:, -1].argmax(-1)
    assert lost["first_token_agreement_per_item"] == (own_first == transfer_first).double().tolist()
    assert lost["all_tokens_agreement"]["mean"] < 1.0


@torch.no_grad()
def test_greedy_agreement_numeric_reference(model, identity):
    ids = random_ids(16, 12, seed=11)
    # float8 rounds coarsely enough to flip some first tokens of this random model: the reference must see it.
    res = greedy_agreement(model, model, identity, ids, max_new_tokens=4, num_recompute_tokens=1,
                           reference_dtype=torch.float8_e4m3fn, batch_size=8, num_bootstrap=20, progress=False)  # fmt: skip
    assert res["all_tokens_agreement"]["mean"] == 1.0  # the exact transfer itself
    own_first = model(ids).logits[:, -1].argmax(-1)
    cache = prefill(model, ids[:, :-1])
    for layer in cache.layers:  # rounded here independently of the library
        layer.keys = layer.keys.to(torch.float8_e4m3fn).float()
        layer.values = layer.values.to(torch.float8_e4m3fn).float()
    rounded_first = model(ids[:, -1:], cache=cache).logits[:, -1].argmax(-1)
    expected = (own_first == rounded_first).double().tolist()
    assert 0.0 in expected, "float8 rounding should flip at least one first token here"
    reference = res["reference"]
    assert reference["dtype"] == "float8_e4m3fn" and reference["first_token_agreement_per_item"] == expected
    assert reference["all_tokens_agreement"]["mean"] <= reference["first_token_agreement"]["mean"]
    # bf16 is the default; a target already computing in it has nothing to round, and None skips the reference.
    bf16 = tiny_model("qwen3", num_hidden_layers=2, seed=3).to(torch.bfloat16)
    skipped = greedy_agreement(bf16, bf16, exact_identity_mapper(bf16), ids[:2], max_new_tokens=2, num_bootstrap=0, progress=False)
    assert "already bfloat16" in skipped["reference"]["skipped"]
    assert "reference" not in greedy_agreement(model, model, identity, ids[:2], max_new_tokens=2, reference_dtype=None,
                                               num_bootstrap=0, progress=False)  # fmt: skip


def test_transfer_needs_source_and_mapper(model, identity):
    with pytest.raises(ValueError, match="both source and mapper"):
        passage_recall(None, model, identity, _recall_items(model, 1), progress=False)
    with pytest.raises(ValueError, match="num_recompute_tokens >= 1"):
        passage_recall(model, model, identity, _recall_items(model, 1), num_recompute_tokens=0, progress=False)


# -- through `hf-kvtransfer eval` ------------------------------------------------------------------------


def _number_tokenizer():
    """A word-level tokenizer of the tiny vocabulary whose numbers 10..59 are single tokens (recall answers)."""
    words = ["A", "Q", ":", "``", "?", ".", "the", "of", "is", "What", "value"] + [str(n) for n in range(10, 60)]
    words += [f"w{i}" for i in range(VOCAB - len(SPECIALS) - len(words))]
    return make_tokenizer(words)


def test_eval_cli_recall(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "eval.json"
    args = [*_eval_setup(tmp_path), "--tasks", "recall", "--items", "4", "--json", str(out),
            "--plot", str(tmp_path / "eval.png")]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "| passage recall accuracy | 4 |" in printed
    # What the transfers computed themselves: said first, and in the table and the JSON.
    said = "every transfer with 1 of 2 target layers exact (TransferredCache's default for a mapper that records none)"
    assert printed.splitlines()[0].startswith(f"eval: {said}")
    assert "Every transfer: 1 of 2 target layers exact" in printed
    # ... and what the mapped layer reads (this mapper: layer 1 from source layer 1 alone).
    assert printed.splitlines()[0].endswith("; what the mapped layers read: source layer 1's K/V")
    results = json.loads(out.read_text())
    assert results["config"]["tasks"] == ["recall"] and "prefix_perplexity" not in results
    assert results["config"]["num_exact_layers"] == 1 and results["config"]["num_target_layers"] == 2
    assert results["config"]["num_recompute_tokens_used"] == {"passage_recall": results["passage_recall"]["num_recompute_tokens"]}
    recall = results["passage_recall"]
    assert recall["num_items"] == 4 and recall["correct_per_item"]["transfer"] == recall["correct_per_item"]["own"]
    assert (tmp_path / "eval.png").read_bytes()[:4] == b"\x89PNG"
    # A mistyped task is one line before anything loads (the model paths here do not even exist).
    assert main(["eval", "--source", "nowhere", "--target", "nowhere", "--mapper", "nowhere",
                 "--text", str(tmp_path / "text.txt"), "--tasks", "recall,recal"]) == 1  # fmt: skip
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: unknown task(s) 'recal'") and err[1].startswith("hint:")


def test_retention_difference_is_paired_and_matches_the_retentions():
    from hf_kvtransfer.evaluation.metrics import retention_difference, retention_over_items

    rng = np.random.default_rng(3)
    own, none_ = rng.normal(1.0, 0.3, 200), rng.normal(3.0, 0.3, 200)
    a = own + rng.normal(0.4, 0.2, 200)
    b = a - rng.normal(0.1, 0.02, 200)  # the same items: a candidate close to the reference
    d = retention_difference(own, none_, a, b, higher_is_better=False, num_bootstrap=500, seed=1)
    ra, rb = (retention_over_items(own, x, none_, higher_is_better=False, num_bootstrap=500, seed=1) for x in (a, b))
    assert d["difference"] == pytest.approx(ra["retention"] - rb["retention"], abs=1e-12)
    # Paired: the interval of the difference is narrower than either retention's own interval.
    width = d["difference_ci"][1] - d["difference_ci"][0]
    assert width < ra["retention_ci"][1] - ra["retention_ci"][0]
    # Against the target's own prefill (reference None): the retention's own interval, shifted by 1.
    d1 = retention_difference(own, none_, a, None, higher_is_better=False, num_bootstrap=500, seed=1)
    assert d1["difference"] == pytest.approx(ra["retention"] - 1, abs=1e-12)
    np.testing.assert_allclose(d1["difference_ci"], np.asarray(ra["retention_ci"]) - 1, atol=1e-12)
    assert retention_difference(own, own, a, b)["difference"] is None  # the context is worth nothing


def test_evaluate_takes_an_eval_config_or_its_fields_as_keywords():
    """`evaluate(config=EvalConfig(...))` and the same options as keywords run the task the options name, with the
    numbers of that task run by itself on the same windows; an unknown option is one line."""
    from hf_kvtransfer.evaluation.evaluate import EvalConfig, evaluate, prefix_perplexity, text_windows

    model = tiny_model("qwen3", num_hidden_layers=2, seed=4)
    tok, mapper = _number_tokenizer(), exact_identity_mapper(model)
    words = [f"w{i}" for i in range(30)] + ["the", "of", "is", "value", "."]
    text = " ".join(np.random.default_rng(1).choice(words, 200))
    options = dict(tasks="perplexity", prefix_len=12, max_windows=3, num_bootstrap=0, progress=False, batch_size=2)
    by_config = evaluate(model, model, mapper, tok, text, EvalConfig(**options))
    by_keywords = evaluate(model, model, mapper, tok, text, **options)
    windows = text_windows([tok(text, add_special_tokens=False)["input_ids"]], 24, 3)
    alone = prefix_perplexity(model, model, mapper, windows, 12, None, 2, num_bootstrap=0, progress=False)
    for res in (by_config, by_keywords):
        assert res["config"]["tasks"] == ["perplexity"]
        assert json.dumps(res["prefix_perplexity"], sort_keys=True) == json.dumps(alone, sort_keys=True)
    with pytest.raises(TypeError, match="unknown option.*prefix_lenn"):
        evaluate(model, model, mapper, tok, text, prefix_lenn=3)


def test_every_eval_task_has_a_step():
    from hf_kvtransfer.evaluation.evaluate import _TASKS, EVAL_TASKS

    assert tuple(_TASKS) == EVAL_TASKS  # the steps run in the order the tasks are listed (and reported)


def _eval_setup(tmp_path):
    """`eval`'s arguments on a saved tiny pair (one model as both: its transfer is exact), its mapper and a text."""
    if not (tmp_path / "model").is_dir():
        model = tiny_model("qwen3", num_hidden_layers=2, seed=4)
        model.save_pretrained(tmp_path / "model")
        _number_tokenizer().save_pretrained(tmp_path / "model")
        exact_identity_mapper(model).save_pretrained(tmp_path / "mapper")
        words = [f"w{i}" for i in range(30)] + ["the", "of", "is", "value", "."]
        rng = np.random.default_rng(0)
        (tmp_path / "text.txt").write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(40)) + "\n")
    return ["eval", "--source", str(tmp_path / "model"), "--target", str(tmp_path / "model"), "--mapper",
            str(tmp_path / "mapper"), "--text", str(tmp_path / "text.txt")]  # fmt: skip


def test_an_interrupted_eval_resumes_with_its_finished_tasks(tmp_path, capsys, monkeypatch):
    """Ctrl-C after the first task: that task's results are kept beside --json and the same command reads them back
    instead of running it again; the results equal an uninterrupted run's, and the journal is gone once they are
    written. Another option (more items) runs every task afresh."""
    from hf_kvtransfer.evaluation import evaluate as evaluate_module

    args = [*_eval_setup(tmp_path), "--tasks", "repeat,recall", "--items", "6"]
    assert main([*args, "--json", str(tmp_path / "whole.json")]) == 0
    whole = json.loads((tmp_path / "whole.json").read_text())
    calls = {"repeat": 0, "recall": 0}
    run_repeat, run_recall = evaluate_module.repeated_span_retention, evaluate_module.passage_recall

    def repeat(*a, **k):
        calls["repeat"] += 1
        return run_repeat(*a, **k)

    def interrupted_recall(*a, **k):
        calls["recall"] += 1
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate_module, "repeated_span_retention", repeat)
    monkeypatch.setattr(evaluate_module, "passage_recall", interrupted_recall)
    out = tmp_path / "resumed.json"
    capsys.readouterr()
    assert main([*args, "--json", str(out)]) == 130
    err = capsys.readouterr().err
    journal = tmp_path / "resumed.json.journal.jsonl"
    assert f"1 finished task(s) are kept in {journal}" in err and "run the same command again" in err, err
    assert journal.is_file() and not out.exists() and calls == {"repeat": 1, "recall": 1}
    monkeypatch.setattr(evaluate_module, "passage_recall", run_recall)
    assert main([*args, "--json", str(out)]) == 0
    assert calls == {"repeat": 1, "recall": 1}  # the repeat task was read back, not run
    assert "1 finished task(s) read back from" in capsys.readouterr().out
    resumed = json.loads(out.read_text())
    assert resumed == whole and not journal.exists()
    # Another option: nothing read back (the journal of the interrupted run is for 6 items).
    monkeypatch.setattr(evaluate_module, "passage_recall", interrupted_recall)
    assert main([*args, "--json", str(out)]) == 130
    capsys.readouterr()
    monkeypatch.setattr(evaluate_module, "passage_recall", run_recall)
    assert main([*args[:-1], "5", "--json", str(out)]) == 0
    assert calls["repeat"] == 3 and json.loads(out.read_text())["repeated_span"]["num_items"] != whole["repeated_span"]["num_items"]
    # A run that stops before any task finished leaves no journal behind (Ctrl-C in the first task, or an error).
    monkeypatch.setattr(evaluate_module, "repeated_span_retention", interrupted_recall)
    assert main([*args, "--json", str(out)]) == 130
    assert "before a task finished" in capsys.readouterr().err and not journal.exists()


class _RecordingConfig:
    """An `EvalConfig` that records which of its fields are read."""

    def __init__(self, cfg):
        self._cfg, self.read = cfg, set()

    def __getattr__(self, name):
        self.read.add(name)
        return getattr(self._cfg, name)


def test_each_task_reads_only_the_options_its_journal_key_holds(tmp_path, monkeypatch):
    """An eval journal keys a task by the options it declares (`_TASKS`), so a rerun with another value of any other
    option reads it back: every task, run with a config that records what it reads, reads no other option."""
    from hf_kvtransfer.evaluation import evaluate as evaluate_module
    from hf_kvtransfer.evaluation.multiple_choice import MultipleChoiceItem

    _eval_setup(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    mapper = KVMapper.from_pretrained(tmp_path / "mapper")
    reads: dict[str, set[str]] = {}

    def recorded(run, name):
        recording = _RecordingConfig(run.cfg)
        out: dict = {}
        evaluate_module._TASKS[name].step(dataclasses.replace(run, cfg=recording), out)
        reads[name] = recording.read - {"progress"}  # progress bars change no result
        return out

    monkeypatch.setattr(evaluate_module, "_task_results", recorded)
    choices = [MultipleChoiceItem(context_ids=[5, 6, 7, 8], choice_ids=[[9], [10]], label=0)] * 2
    lines = (tmp_path / "text.txt").read_text().splitlines()
    text = f"\n{tokenizer.eos_token}\n".join("\n".join(lines[i : i + 10]) for i in range(0, len(lines), 10))  # 4 documents
    evaluate(model, model, mapper, tokenizer, text, tasks=list(evaluate_module._TASKS), multiple_choice_items=choices,
             reverse_mapper=mapper, num_content_items=4, num_items=4, context_len=16, continuation_len=4, num_choices=2,
             prefix_len=32, max_windows=4, num_turns=2, turn_len=16, depth_lengths=(256,), depth_items=2, max_conversations=2,
             num_bootstrap=10, progress=False)  # fmt: skip
    assert set(reads) == set(evaluate_module._TASKS)
    for name, task in evaluate_module._TASKS.items():
        assert reads[name] <= set(task.options), (name, reads[name] - set(task.options))


def test_a_rerun_with_another_depth_option_reads_the_other_tasks_back(tmp_path, capsys, monkeypatch):
    """`--depth-lengths` changes the depth task alone: a rerun with another value reads recall back from the journal
    of an interrupted run and runs the depth task again."""
    from hf_kvtransfer.evaluation import evaluate as evaluate_module

    args = [*_eval_setup(tmp_path), "--tasks", "recall,depth", "--items", "6", "--depth-items", "2"]
    out = tmp_path / "eval.json"
    calls = {"recall": 0}
    run_recall, run_depth = evaluate_module.passage_recall, evaluate_module.recall_by_depth

    def recall(*a, **k):
        calls["recall"] += 1
        return run_recall(*a, **k)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate_module, "passage_recall", recall)
    monkeypatch.setattr(evaluate_module, "recall_by_depth", interrupted)
    assert main([*args, "--depth-lengths", "256", "--json", str(out)]) == 130
    monkeypatch.setattr(evaluate_module, "recall_by_depth", run_depth)
    capsys.readouterr()
    assert main([*args, "--depth-lengths", "320", "--json", str(out)]) == 0
    assert calls["recall"] == 1 and "1 finished task(s) read back from" in capsys.readouterr().out
    assert json.loads(out.read_text())["recall_by_depth"]["lengths"] == [320]


def test_an_interrupted_depth_task_resumes_from_its_finished_cells(tmp_path, capsys, monkeypatch):
    """Ctrl-C in the third of six cells of the depth task: the two finished cells are kept, the rerun scores only the
    four others and says so, and its results equal an uninterrupted run's."""
    from hf_kvtransfer.evaluation import content

    args = [*_eval_setup(tmp_path), "--tasks", "depth", "--depth-lengths", "256", "320", "--depth-items", "2"]
    assert main([*args, "--json", str(tmp_path / "whole.json")]) == 0
    whole = json.loads((tmp_path / "whole.json").read_text())
    real, calls = content.passage_recall, []

    def interrupted_third(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(content, "passage_recall", interrupted_third)
    out = tmp_path / "resumed.json"
    capsys.readouterr()
    assert main([*args, "--json", str(out)]) == 130
    assert "2 depth cell(s) are kept in" in capsys.readouterr().err
    calls.clear()
    monkeypatch.setattr(content, "passage_recall", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert main([*args, "--json", str(out)]) == 0
    assert len(calls) == 4 and "2 depth cell(s) read back from" in capsys.readouterr().out
    assert json.loads(out.read_text()) == whole
