"""Evaluation suite: each score is checked against an independent computation (a plain full-sequence forward)."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import random_ids, scrambled_mapper
from hf_kvtransfer.evaluation.evaluate import kv_r2, multi_turn_drift, prefix_perplexity, split_documents, text_windows
from hf_kvtransfer.evaluation.metrics import normalized_retention
from hf_kvtransfer.evaluation.multiple_choice import MultipleChoiceItem, build_continuation_task, load_multiple_choice, multiple_choice
from hf_kvtransfer.commands.reporting import evaluation_markdown as results_to_markdown
from hf_kvtransfer.commands.reporting import plot_evaluation as plot_results


@pytest.fixture(scope="module")
def broken_mapper(identity_mapper):
    return scrambled_mapper(identity_mapper)


def _full_nll(model, ids, start):
    """Mean next-token loss over positions start+1.. of each row from one plain forward (no caches)."""
    logits = model(ids).logits[:, start:-1].float()
    return F.cross_entropy(logits.transpose(1, 2), ids[:, start + 1 :], reduction="none").mean(-1)


def test_normalized_retention_closed_form():
    assert normalized_retention(0.7, 0.9, 0.5) == pytest.approx(0.5)
    assert normalized_retention(0.9, 0.9, 0.5) == pytest.approx(1.0)
    assert normalized_retention(0.5, 0.9, 0.5) == pytest.approx(0.0)
    assert normalized_retention(0.5, 0.5, 0.5) != normalized_retention(0.5, 0.5, 0.5)  # NaN: context worth nothing


def test_prefix_perplexity_matches_plain_forward(qwen3_model, identity_mapper):
    ids = random_ids(6, 40, seed=7)
    res = prefix_perplexity(qwen3_model, qwen3_model, identity_mapper, ids, prefix_len=20, batch_size=4,
                            num_bootstrap=200, progress=False)
    with torch.no_grad():
        own = _full_nll(qwen3_model, ids, 20).mean().item()
        floor = _full_nll(qwen3_model, ids[:, 20:], 0).mean().item()
    assert res["nll"]["target"] == pytest.approx(own, abs=1e-5)
    assert res["nll"]["floor"] == pytest.approx(floor, abs=1e-5)
    # Identity mapping of the model onto itself: transfer == own prefill.
    assert res["nll"]["transfer"] == pytest.approx(own, abs=1e-4)
    assert res["normalized_retention"] == pytest.approx(1.0, abs=1e-2)
    assert res["logit_kl"] < 1e-5 and res["top1_agreement"] == 1.0
    assert len(res["attention_cosine"]) == 3 and min(res["attention_cosine"]) > 0.9999
    lo, hi = res["normalized_retention_ci"]
    assert lo <= res["normalized_retention"] <= hi


def test_prefix_perplexity_recompute_tokens_scores_same_positions(qwen3_model, identity_mapper):
    ids = random_ids(4, 32, seed=8)
    res = prefix_perplexity(qwen3_model, qwen3_model, identity_mapper, ids, num_recompute_tokens=3,
                            num_bootstrap=0, progress=False)
    with torch.no_grad():
        own = _full_nll(qwen3_model, ids, 16).mean().item()
    assert res["nll"]["target"] == pytest.approx(own, abs=1e-5)
    assert res["nll"]["transfer"] == pytest.approx(own, abs=1e-4)


def test_broken_mapper_is_detected(qwen3_model, identity_mapper, broken_mapper):
    ids = random_ids(6, 40, seed=7)
    good = prefix_perplexity(qwen3_model, qwen3_model, identity_mapper, ids, num_bootstrap=0, progress=False)
    bad = prefix_perplexity(qwen3_model, qwen3_model, broken_mapper, ids, num_bootstrap=0, progress=False)
    assert bad["logit_kl"] > 100 * max(good["logit_kl"], 1e-6)
    assert bad["top1_agreement"] < 0.9
    assert min(bad["attention_cosine"]) < 0.99
    r2 = kv_r2(qwen3_model, qwen3_model, broken_mapper, ids, progress=False)
    assert max(r2["key"] + r2["value"]) < 0.5


def test_kv_r2_identity_and_linear_pair(qwen3_model, identity_mapper, linear_models):
    from hf_kvtransfer import fit_mapper

    r2 = kv_r2(qwen3_model, qwen3_model, identity_mapper, random_ids(4, 24, seed=9), progress=False)
    assert min(r2["key"] + r2["value"]) > 0.999
    source, target, true_source_of = linear_models
    mapper = fit_mapper(source, target, random_ids(16, 48, seed=10), top_k=1, ridge_lambda=1e-6, progress=False)
    r2 = kv_r2(source, target, mapper, random_ids(4, 48, seed=11), progress=False)
    for t, s in enumerate(true_source_of):
        if s is not None:  # exactly linear layers are predicted out of sample too
            assert r2["key"][t] > 0.999 and r2["value"][t] > 0.999


def _mc_scores_plain(model, item):
    """Sum log-prob of each choice from a plain forward over context + choice."""
    out = []
    for choice in item.choice_ids:
        ids = torch.tensor([item.context_ids + choice])
        logp = model(ids).logits[0, len(item.context_ids) - 1 : -1].float().log_softmax(-1)
        out.append(logp[torch.arange(len(choice)), torch.tensor(choice)].sum().item())
    return out


def test_multiple_choice_matches_plain_scoring(qwen3_model, identity_mapper, broken_mapper):
    g = torch.Generator().manual_seed(3)
    items = []
    for i in range(12):
        ctx = torch.randint(3, 96, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
        choices = [torch.randint(3, 96, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist() for _ in range(3)]
        items.append(MultipleChoiceItem(ctx, choices, i % 3))
    with torch.no_grad():
        expected = sum(max(range(3), key=lambda c: _mc_scores_plain(qwen3_model, it)[c]) == it.label for it in items)
    res = multiple_choice(qwen3_model, qwen3_model, identity_mapper, items, num_bootstrap=50, progress=False)
    assert res["acc"]["target"] == pytest.approx(expected / len(items))
    assert res["acc"]["transfer"] == res["acc"]["target"]
    assert res["chance"] == pytest.approx(1 / 3)
    # The recompute window is a parameter of the same computation: any W gives the same target scores.
    res3 = multiple_choice(qwen3_model, qwen3_model, identity_mapper, items, num_recompute_tokens=3, num_bootstrap=0,
                           progress=False)
    assert res3["acc"]["target"] == res["acc"]["target"]


def test_multiple_choice_computes_the_exact_layers_it_is_given(qwen3_model, broken_mapper):
    """`num_exact_layers` reaches the transfer (eval's --exact-layers): with every layer exact, even a mapper that
    loses everything scores as the target's own prefill, and the result says what it used."""
    docs = [random_ids(1, 200, seed=s)[0].tolist() for s in range(6)]
    items = build_continuation_task(docs, context_len=24, continuation_len=6, num_items=16)
    layers = qwen3_model.config.num_hidden_layers
    res = multiple_choice(qwen3_model, qwen3_model, broken_mapper, items, num_bootstrap=0, progress=False,
                          num_exact_layers=layers)  # fmt: skip
    assert res["acc"]["transfer"] == res["acc"]["target"] and res["num_exact_layers"] == layers
    default = multiple_choice(qwen3_model, qwen3_model, broken_mapper, items, num_bootstrap=0, progress=False)
    assert default["num_exact_layers"] == broken_mapper.num_exact_layers < layers
    assert default["acc"]["transfer"] != default["acc"]["target"]  # so the first check can fail


def test_continuation_task_structure():
    docs = [list(range(1000 * d, 1000 * d + 300)) for d in range(5)]
    items = build_continuation_task(docs, context_len=20, continuation_len=5, num_choices=4, num_items=30, gap=2, seed=1)
    assert len(items) == 30
    labels = set()
    for item in items:
        true = item.choice_ids[item.label]
        doc = item.context_ids[0] // 1000
        assert true[0] == item.context_ids[-1] + 3  # follows its own context after the gap
        assert all(c[0] // 1000 != doc for i, c in enumerate(item.choice_ids) if i != item.label)
        assert all(len(c) == 5 for c in item.choice_ids)
        labels.add(item.label)
    assert labels == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="documents"):
        build_continuation_task(docs[:2], context_len=20, continuation_len=5, num_choices=4)


def test_continuation_task_needs_the_context(qwen3_model, identity_mapper, broken_mapper):
    # A model that copies: target == source, so context use shows as the own-prefill accuracy.
    docs = [random_ids(1, 200, seed=s)[0].tolist() for s in range(6)]
    items = build_continuation_task(docs, context_len=24, continuation_len=6, num_items=16)
    res = multiple_choice(qwen3_model, qwen3_model, identity_mapper, items, num_bootstrap=0, progress=False)
    assert res["acc"]["transfer"] == res["acc"]["target"]


class _CharTokenizer:
    bos_token_id = 1

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 90 for c in text]}


def test_load_multiple_choice_formats(tmp_path):
    rows = [
        {"context": "The sky is", "choices": ["blue", "green"], "label": 0},
        {"ctx": "He opened the", "endings": ["door", "sky", "idea", "why"], "label": "2"},
        {"question": "2+2?", "choices": {"text": ["3", "4"], "label": ["A", "B"]}, "answerKey": "B"},
        {"goal": "boil water", "sol1": "use a pot", "sol2": "use a sieve", "label": 0},
        {"sentence": "The cup fell off the table because _ was wobbly.", "option1": "the cup", "option2": "the table",
         "answer": "2"},
    ]
    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tok = _CharTokenizer()
    items = load_multiple_choice(path, tok)
    assert [it.label for it in items] == [0, 2, 1, 0, 1]
    assert items[0].choice_ids[0] == tok(" blue")["input_ids"]
    assert items[4].context_ids == tok("The cup fell off the table because")["input_ids"]
    assert items[4].choice_ids[1] == tok(" the table was wobbly.")["input_ids"]
    assert len(load_multiple_choice(path, tok, limit=2)) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "answers": []}) + "\n")
    with pytest.raises(ValueError, match="line 1: unknown multiple-choice record"):
        load_multiple_choice(bad, tok)


def test_multi_turn_identity_has_no_drift_and_broken_mapper_drifts(qwen3_model, identity_mapper, broken_mapper):
    ids = random_ids(3, 48, seed=12)
    res = multi_turn_drift(qwen3_model, qwen3_model, identity_mapper, identity_mapper, ids, num_turns=4,
                           progress=False)
    assert [t["model"] for t in res["turns"]] == ["source", "target", "source", "target"]
    assert all(t["logit_kl"] < 1e-5 and t["top1_agreement"] == 1.0 for t in res["turns"])
    with torch.no_grad():  # turn 3's standalone loss from a plain forward
        own = F.cross_entropy(qwen3_model(ids).logits[:, 36:47].transpose(1, 2), ids[:, 37:48]).item()
    assert res["turns"][3]["nll_standalone"] == pytest.approx(own, abs=1e-5)
    bad = multi_turn_drift(qwen3_model, qwen3_model, broken_mapper, identity_mapper, ids, num_turns=4, progress=False)
    assert bad["turns"][0]["logit_kl"] < 1e-6  # nothing mapped before the first switch
    assert bad["turns"][1]["logit_kl"] > 1e-3
    assert bad["turns"][2]["logit_kl"] > 1e-3  # the error is carried across the next switch


def test_text_helpers():
    text = "doc one\nline\n<|endoftext|>\ndoc two\n<|endoftext|>\n\n"
    assert split_documents(text) == ["doc one\nline", "doc two"]
    assert split_documents("no separator") == ["no separator"]
    windows = text_windows([list(range(10)), list(range(100, 125))], 8)
    assert windows.tolist() == [list(range(8)), list(range(100, 108)), list(range(108, 116)), list(range(116, 124))]
    assert text_windows([list(range(100))], 8, max_windows=3).shape == (3, 8)
    with pytest.raises(ValueError, match="no document has 64 tokens"):
        text_windows([list(range(10))], 64)


def test_report_markdown_and_plot(tmp_path, qwen3_model, identity_mapper):
    pytest.importorskip("matplotlib")
    ids = random_ids(4, 32, seed=13)
    results = {
        "config": {"source": "a", "target": "b", "top_k": 1, "ridge_lambda": 0.01},
        "prefix_perplexity": prefix_perplexity(qwen3_model, qwen3_model, identity_mapper, ids, num_bootstrap=20,
                                               progress=False),
        "kv_r2": kv_r2(qwen3_model, qwen3_model, identity_mapper, ids, progress=False),
        "multi_turn": multi_turn_drift(qwen3_model, qwen3_model, identity_mapper, identity_mapper, ids, 2,
                                       progress=False),
    }
    md = results_to_markdown(results)
    assert "prefix-conditioned perplexity" in md and "| 2 |" in md and "Multi-turn" in md
    json.dumps(results)  # JSON-serializable as is
    plot_results(results, tmp_path / "eval.png")
    assert (tmp_path / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- lm-evaluation-harness adapter (optional dependency) ---------------------------------------------------


class _CharTokenizerWithDecode(_CharTokenizer):
    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i - 3 + 32) if i >= 3 else "" for i in ids)


def test_lm_eval_adapter_local_task(tmp_path, qwen3_model, identity_mapper):
    pytest.importorskip("lm_eval", reason="lm_eval not installed (pip install 'hf-kvtransfer[lm-eval]')")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from hf_kvtransfer.integrations.lm_eval_harness import KVTransferLM

    g = torch.Generator().manual_seed(5)
    letters = "abcdefghijklmnopqrstuvwxyz"
    rows = []
    for i in range(8):
        word = lambda n: "".join(letters[int(j)] for j in torch.randint(0, 26, (n,), generator=g))  # noqa: E731
        rows.append({"context": word(12), "choices": [word(3), word(4), word(2)], "label": i % 3})
    data = tmp_path / "toy.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "toy.yaml").write_text(
        "task: toy_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n"
        "metric_list:\n  - metric: acc\n"
    )
    tok = _CharTokenizerWithDecode()
    lm = KVTransferLM(source=qwen3_model, target=qwen3_model, mapper=identity_mapper, tokenizer=tok)
    out = lm_eval.simple_evaluate(model=lm, tasks=["toy_mc"], task_manager=TaskManager(include_path=str(tmp_path)))
    acc = out["results"]["toy_mc"]["acc,none"]
    items = [MultipleChoiceItem(tok(r["context"])["input_ids"], [tok(" " + c)["input_ids"] for c in r["choices"]],
                                r["label"]) for r in rows]
    with torch.no_grad():  # independent: plain forward over context + " " + choice
        expected = sum(max(range(3), key=lambda c: _mc_scores_plain(qwen3_model, it)[c]) == it.label for it in items)
    assert acc == pytest.approx(expected / len(items))
    assert lm.generate_until([type("R", (), {"args": ("abc", {"until": ["\n"], "max_gen_toks": 4})})()])[0] is not None


# -- the quality bar on the bundled family -----------------------------------------------------------------

# The bundled family reads its context (issue 12): the large model's own passage recall is far above its score
# without the passage, and its own prefix lowers its loss by ~0.26 nats/token. Measured with exactly this fast fit
# (64 x 256 calibration tokens, top_k=4 = every source layer), small -> large, on these 64 windows / 100 items:
# context gain 0.261; floor-normalized retention 0.19 [0.15, 0.25] with 1 exact layer (0, 2 or 3 exact layers give
# 0.16-0.19) and 0.95 [0.93, 0.97] with the target's first 4 layers computed exactly (its layer 3 is the one the
# ridge map cannot reproduce: held-out key R^2 0.42); recall own 0.79, no passage 0.01, transfer 0.02 with 1 exact
# layer. The fit's content probe (repeated spans, a different task from recall) chooses those 4 layers itself
# (probe retention -5% with 1-3 exact layers, 97% with 4); with them recall is 81% (retention 1.03) and with 3 it is
# back at 0.01 retention.
# These numbers transfer the whole prefix (perplexity) and all but the last prompt token (recall), not the default's
# last 32 (exact, they would lift every row): the test is about the mapped layers.
# The computation is deterministic, so the CIs are not run-to-run noise. The floors leave float/thread-count margin
# and still fail on a RoPE / layer-order / exact-layer bug (retention at or below 0) or a family that stopped
# reading its context.
FAMILY_ONE_EXACT_RETENTION_FLOOR = 0.10
FAMILY_CHOSEN_RETENTION_FLOOR = 0.85


# Slow (a fit with the content probe, 64 perplexity windows and 100 recall items twice each: about 90 s on 2 cores;
# .ci/run runs it).
@pytest.mark.slow
def test_bundled_family_reads_its_context_and_transfers_it():
    from hf_kvtransfer.commands.demo import find_family

    try:
        family = find_family(Path(__file__).resolve().parent.parent / "examples" / "family")
    except FileNotFoundError:
        pytest.skip("bundled family not in examples/family (python research/family_builder/train_family.py --output-dir examples/family)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_kvtransfer import fit_mapper
    from hf_kvtransfer.fitting.calibration import build_calibration
    from hf_kvtransfer.evaluation.content import passage_recall
    from hf_kvtransfer.evaluation.tasks import passage_recall_items

    tok = AutoTokenizer.from_pretrained(family / "large")
    small = AutoModelForCausalLM.from_pretrained(family / "small", dtype=torch.float32).eval()
    large = AutoModelForCausalLM.from_pretrained(family / "large", dtype=torch.float32).eval()
    calibration, _ = build_calibration(tok, family / "calibration.txt", num_sequences=64, seq_len=256)
    mapper = fit_mapper(small, large, calibration, top_k=4, residual_inputs="off", progress=False)  # the source-only probe
    docs = split_documents((family / "heldout.txt").read_text(encoding="utf-8"), tok.eos_token)
    windows = text_windows([tok(d, verbose=False)["input_ids"] for d in docs], 256, max_windows=64)
    mapped = dict(diagnostics=False, num_bootstrap=0, progress=False, num_recompute_tokens=0)
    res = prefix_perplexity(small, large, mapper, windows, num_exact_layers=1, **mapped)
    assert res["context_gain_nats"] > 0.15, f"the family barely uses its context (measured: 0.261 nats/token): {res}"
    assert res["normalized_retention"] > FAMILY_ONE_EXACT_RETENTION_FLOOR, res
    chosen = mapper.config.num_exact_layers
    assert chosen is not None and 2 <= chosen < 8, mapper.report["exact_layers"]
    default = prefix_perplexity(small, large, mapper, windows, **mapped)
    assert default["num_exact_layers"] == chosen and default["normalized_retention"] > FAMILY_CHOSEN_RETENTION_FLOOR, default
    items = passage_recall_items(tok, 100, seed=0, distractor_texts=docs)
    recall = passage_recall(small, large, mapper, items, num_recompute_tokens=1, num_bootstrap=0, progress=False)
    own, alone = recall["accuracy"]["own"]["mean"], recall["accuracy"]["no_context"]["mean"]
    assert own > 0.6 and alone < 0.1, f"the large model no longer answers from the passage: {recall['accuracy']}"
    # The probe's choice carries over to recall: with it the transfer answers as the target does, with one
    # layer fewer it does not.
    assert recall["retention"] > 0.85, recall["accuracy"]
    fewer = passage_recall(small, large, mapper, items, num_recompute_tokens=1, num_exact_layers=chosen - 1,
                           num_bootstrap=0, progress=False)  # fmt: skip
    assert fewer["retention"] < 0.5, fewer["accuracy"]


def test_pair_with_other_kv_geometry_gets_its_own_exact_layers():
    # large (2 KV heads x 32) -> small_kv4 (4 KV heads x 16): the mapper reshapes heads, and the fit's content
    # probe must find this target's own copy layer, layer 1 (small's is layer 3). Measured with exactly this fit
    # (64 x 256 calibration tokens): probe retention -6% with 1 exact layer, 99% with 2 (its choice); on these 48
    # held-out spans (context gain 1.94 nats/token) retention 1.00 with 2 exact layers and 0.04 with 1.
    family = Path(__file__).resolve().parent.parent / "examples" / "family"
    if not (family / "small_kv4" / "model.safetensors").is_file():
        pytest.skip("examples/family/small_kv4 not present (python research/family_builder/train_family.py --models small_kv4)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_kvtransfer import fit_mapper
    from hf_kvtransfer.fitting.calibration import build_calibration
    from hf_kvtransfer.evaluation.content import repeated_span_retention
    from hf_kvtransfer.evaluation.tasks import repeated_span_items

    tok = AutoTokenizer.from_pretrained(family / "large")
    large = AutoModelForCausalLM.from_pretrained(family / "large", dtype=torch.float32).eval()
    small = AutoModelForCausalLM.from_pretrained(family / "small_kv4", dtype=torch.float32).eval()
    calibration, _ = build_calibration(tok, family / "calibration.txt", num_sequences=64, seq_len=256)
    mapper = fit_mapper(large, small, calibration, residual_inputs="off", progress=False)  # the source-only probe
    source, target = mapper.source_layout, mapper.target_layout
    assert (source.num_kv_heads, source.head_dim, target.num_kv_heads, target.head_dim) == (2, 32, 4, 16)
    chosen = mapper.config.num_exact_layers
    assert chosen is not None and 1 <= chosen < 4, mapper.report["exact_layers"]
    stream = tok((family / "heldout.txt").read_text(encoding="utf-8"), verbose=False)["input_ids"]
    items = repeated_span_items(tok, stream, 48, seed=5, prefix_len=256, kind="text")
    spans = dict(num_recompute_tokens=1, num_bootstrap=0, progress=False)
    kept = repeated_span_retention(large, small, mapper, items, **spans)
    assert kept["context_gain"]["mean"] > 1.0 and kept["retention"] > 0.85, kept["nll"]
    fewer = repeated_span_retention(large, small, mapper, items, num_exact_layers=chosen - 1, reference=kept, **spans)
    assert fewer["retention"] < 0.5, fewer["nll"]


@pytest.mark.parametrize("name", ["eval_source_to_target.json", "eval_tolerance_8_source_to_target.json"])
def test_report_gives_the_paired_difference_of_each_content_task(name):
    """eval's content table shows transfer minus own on the same items, in points: the mean of the per-item
    differences of a saved eval, inside its interval."""
    results = json.loads((Path(__file__).parents[1] / "research/family_builder/results/deep_pair" / name).read_text())
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in results_to_markdown(results).splitlines()}
    header = rows["task"]
    column = next(i for i, cell in enumerate(header) if cell.startswith("transfer - own"))
    for key, label in (("passage_recall", "passage recall accuracy"), ("handoff", "hand-off question 2 accuracy")):
        per_item = results[key]["correct_per_item"]
        diff = 100 * sum(t - o for t, o in zip(per_item["transfer"], per_item["own"])) / len(per_item["own"])
        row = next(cells for name_, cells in rows.items() if name_.startswith(label))
        mean, low, high = (float(x) for x in row[column].replace("[", "").replace(",", "").replace("]", "").split())
        assert mean == pytest.approx(diff, abs=0.05) and low <= mean <= high
