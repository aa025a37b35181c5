"""The fit's probe journal (`fitting/probe_journal.py`): an interrupted probe resumes where it stopped and chooses as
an uninterrupted one does; a score is read back only for the same candidate weights, exact layers and items, and only
for the same models; the CLI keeps the scores with the checkpoint, says so, and deletes both once the mapper is
written."""

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from conftest import exact_identity_mapper, random_ids, residual_pair, steady_timings, tiny_model
from hf_kvtransfer.fitting import content_gate, exact_layers
from hf_kvtransfer.fitting.content_gate import ContentGate
from hf_kvtransfer.fitting.probe_journal import ProbeJournal

FAMILY = Path(__file__).resolve().parent.parent / "examples" / "family"
UNTIMED = ("transfer_ms", "transfer_wall_ms", "target_prefill_ms", "target_prefill_wall_ms", "speedup", "timing_rounds")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    if not (FAMILY / "large").is_dir():
        pytest.skip("bundled family not in examples/family")
    return AutoTokenizer.from_pretrained(FAMILY / "large")


class _Scores:
    """Stands in for the probe's scoring functions (repeated spans / cued recall, passage recall / hand-off), counts
    the calls and raises KeyboardInterrupt on call `interrupt_at`. Residual maps at layer 1 and 3 exact layers keep
    the content; everything else loses it. The scores vary by item, so a wrong read-back would change the intervals."""

    def __init__(self, interrupt_at=None):
        self.calls, self.interrupt_at = 0, interrupt_at

    def _count(self):
        self.calls += 1
        if self.calls == self.interrupt_at:
            raise KeyboardInterrupt("interrupted while probing")

    @staticmethod
    def keeps(m, k):
        return k >= 3 or (m.needs_exact_layers and m.config.map_inputs["residual"].layer == 1)

    def retention(self, s, t, m, items, num_exact_layers, **kw):
        self._count()
        n, ret = len(items), 0.99 if self.keeps(m, num_exact_layers) else 0.5
        transfer = [3.0 - 2.0 * ret + 0.01 * (i % 3) for i in range(n)]
        return {"retention": ret, "retention_ci": [ret - 0.02, ret + 0.02], "context_gain": {"mean": 2.0, "ci": [1.5, 2.5]},
                "nll_per_item": {"own": [1.0] * n, "no_context": [3.0] * n, "transfer": transfer}}  # fmt: skip

    def answers(self, source, target, m, items, *, num_exact_layers, **kw):
        self._count()
        keep = self.keeps(m, num_exact_layers)
        transfer = [1.0 if keep or i % 3 else 0.0 for i in range(len(items))]
        return {"correct_per_item": {"own": [1.0] * len(items), "transfer": transfer, "no_context": [0.0] * len(items)}}


def _probe(monkeypatch, pair, tokenizer, scores, journal):
    source, target, _, base, residual = pair
    monkeypatch.setattr(exact_layers, "repeated_span_retention", scores.retention)
    monkeypatch.setattr(content_gate, "passage_recall", scores.answers)
    monkeypatch.setattr(content_gate, "handoff", scores.answers)
    monkeypatch.setattr(exact_layers, "_time_candidates", steady_timings(lambda m, n: 10.0 * n))
    gate = ContentGate(source, target, tokenizer, None, tolerance=0.05, num_items=16, max_items=64, journal=journal)
    stream = random_ids(1, 600, seed=1)[0].tolist()
    return exact_layers.choose_configuration(source, target, base, stream, candidates=residual, gate=gate,
                                             num_items=16, journal=journal)  # fmt: skip


def test_an_interrupted_probe_resumes_where_it_stopped_and_chooses_alike(monkeypatch, tokenizer, tmp_path):
    pair = residual_pair((0, 1))
    whole = _Scores()
    chosen, report = _probe(monkeypatch, pair, tokenizer, whole, None)
    assert chosen.config.map_inputs["residual"].layer == 1 and whole.calls > 6
    context = {"models": "the pair"}
    stop = whole.calls - 3  # three scores short of the end
    with pytest.raises(KeyboardInterrupt):
        _probe(monkeypatch, pair, tokenizer, _Scores(interrupt_at=stop), ProbeJournal(tmp_path / "j.jsonl", context))
    rest = _Scores()
    again, report_again = _probe(monkeypatch, pair, tokenizer, rest, ProbeJournal(tmp_path / "j.jsonl", context))
    assert rest.calls == whole.calls - (stop - 1)  # only what had not been scored
    assert again.config == chosen.config
    strip = lambda rows: [{k: v for k, v in r.items() if k not in UNTIMED} for r in rows]  # noqa: E731
    assert strip(report_again["candidates"]) == strip(report["candidates"])
    # A third run reads everything back.
    last = _Scores()
    _probe(monkeypatch, pair, tokenizer, last, ProbeJournal(tmp_path / "j.jsonl", context))
    assert last.calls == 0


def test_a_score_is_read_back_only_for_the_same_candidate_layers_and_items(tmp_path):
    _, _, _, base, _ = residual_pair((0,))
    journal = ProbeJournal(tmp_path / "j.jsonl", {"models": "the pair"})
    calls = []

    def compute(value=0.5):
        calls.append(value)
        return {"retention": value, "per_item": [0.1, 0.2], "ci": [0.4, 0.6], "undefined": None}

    items = [[1, 2, 3], [4, 5]]
    first = journal.score("repeated spans", base, 1, items, compute)
    assert journal.score("repeated spans", base, 1, items, compute) == first and len(calls) == 1
    nudged = copy.deepcopy(base)
    with torch.no_grad():
        next(iter(nudged.parameters())).view(-1)[0] += 1e-6
    journal.score("repeated spans", nudged, 1, items, compute)  # other weights
    journal.score("repeated spans", base, 2, items, compute)  # other exact layers
    journal.score("repeated spans", base, 1, [[1, 2, 3], [4, 6]], compute)  # other items
    journal.score("cued recall", base, 1, items, compute)  # another probe
    assert len(calls) == 5
    # What cannot come back from JSON as it was (a tuple) is not kept: it is scored again after a restart. A NaN (the
    # interval of a score taken without a bootstrap, as the content gate's are) comes back as a NaN.
    journal.score("nan", base, 1, items, lambda: {"retention": float("nan"), "ci": [float("nan"), 1.0]})
    journal.score("tuple", base, 1, items, lambda: {"ci": (0.1, 0.2)})
    reread = ProbeJournal(tmp_path / "j.jsonl", {"models": "the pair"})
    assert reread.score("repeated spans", base, 1, items, lambda: pytest.fail("scored again")) == first
    nan = reread.score("nan", base, 1, items, lambda: pytest.fail("scored again"))
    assert math.isnan(nan["retention"]) and math.isnan(nan["ci"][0]) and nan["ci"][1] == 1.0
    assert len(reread.entries) == 6
    # A line cut short by a kill mid-write is dropped; the rest is read.
    with (tmp_path / "j.jsonl").open("a") as f:
        f.write('{"key": "abc", "result": {"retent')
    resumed = ProbeJournal(tmp_path / "j.jsonl", {"models": "the pair"})
    assert len(resumed.entries) == 6
    # and the next score goes on a line of its own, read back after another restart
    resumed.score("after the cut", base, 1, items, compute)
    assert len(ProbeJournal(tmp_path / "j.jsonl", {"models": "the pair"}).entries) == 7


def test_a_journal_of_other_models_is_started_afresh(tmp_path):
    source, target, _, base, _ = residual_pair((0,))
    journal = ProbeJournal.for_fit(tmp_path, source, target)
    journal.score("repeated spans", base, 1, [[1, 2]], lambda: {"retention": 0.9})
    assert len(ProbeJournal.for_fit(tmp_path, source, target).entries) == 1
    retrained = tiny_model("qwen3", num_hidden_layers=3, seed=7)  # same shapes, other weights
    assert ProbeJournal.for_fit(tmp_path, source, retrained).entries == {}
    header = json.loads((tmp_path / "probe-journal-rank0-of-1.jsonl").read_text().splitlines()[0])
    assert header["context"]["target"]["weights_sample"] != ProbeJournal.for_fit(tmp_path, source, target).context[
        "target"]["weights_sample"]  # fmt: skip


def test_the_content_gates_own_scores_come_back_from_the_journal(tokenizer, tmp_path, monkeypatch):
    # The gate scores without a bootstrap, so its results hold NaN intervals: they must still be journaled, or an
    # interrupted fit scores every gate verdict again. Real scoring on the bundled model first; then a fresh gate on
    # the same journal decides alike with no model run.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(FAMILY / "small", dtype=torch.float32).eval()
    exact = exact_identity_mapper(model)
    context = {"models": "small"}

    def gate(journal):
        return ContentGate(model, model, tokenizer, None, tolerance=0.05, num_items=8, max_items=8, journal=journal)

    with torch.no_grad():
        first = gate(ProbeJournal(tmp_path / "j.jsonl", context))
        checked, verdict = first.check_context(), first.judge(exact, 1)

    def never(*args, **kwargs):
        raise AssertionError("scored again")

    monkeypatch.setattr(content_gate, "passage_recall", never)
    monkeypatch.setattr(content_gate, "handoff", never)
    again = gate(ProbeJournal(tmp_path / "j.jsonl", context))
    assert again.check_context() == checked
    assert json.dumps(again.judge(exact, 1), sort_keys=True) == json.dumps(verdict, sort_keys=True)
