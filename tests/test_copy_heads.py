"""`research/family_builder/copy_heads.py`, which the docs point to for finding where a target copies from its
context: an ideal induction head scores near 1 and is the layer it reports, other heads near 0; and it runs on any
model folder with its own tokenizer and a text of one's own (copy score alone where the passage-recall items cannot
be built)."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from conftest import HANG_GUARD_S, load_script
from fit_fixtures import save_pair, write_corpus

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "research" / "family_builder" / "copy_heads.py"


def _load():
    return load_script(SCRIPT)


class _InductionModel:
    """3 layers x 2 heads of attention: layer 1 head 0 is an ideal induction head (from each position, all its mass on
    the token after the latest earlier occurrence of the current token), every other head attends uniformly."""

    def __call__(self, ids, output_attentions=True):
        seq = ids[0].tolist()
        n = len(seq)
        uniform = torch.tril(torch.ones(n, n)) / torch.arange(1, n + 1).unsqueeze(1)
        induction = uniform.clone()
        for q in range(n):
            earlier = [j for j in range(q - 1) if seq[j] == seq[q]]
            if earlier:
                induction[q] = 0
                induction[q, earlier[-1] + 1] = 1
        layers = [torch.stack([uniform, uniform])] * 3
        layers[1] = torch.stack([induction, uniform])
        return SimpleNamespace(attentions=tuple(a.unsqueeze(0) for a in layers))


def test_an_ideal_induction_head_scores_near_one_and_names_its_layer():
    heads = _load()
    stream = torch.randperm(4000)[:3000].tolist()  # distinct ids: the repeat is the only earlier occurrence
    items = heads.repeat_items(stream, 8, span=24, gap=200, seed=0)
    scores = heads.copy_scores(_InductionModel(), items, span=24)
    assert scores.shape == (3, 2)
    assert scores[1, 0] > 0.99 and scores[1, 1] < 0.02 and scores[0].max() < 0.02 and scores[2].max() < 0.02
    summary = heads.summary(scores, threshold=0.5)
    assert summary["best_layer"] == 1 and summary["earliest_strong_layer"] == 1 and summary["strong_heads"] == 1


def test_it_scores_any_model_folder_on_a_text_of_ones_own(tmp_path):
    from fit_fixtures import make_tokenizer

    _, target = save_pair(tmp_path / "models", tokenizer=make_tokenizer())
    text = write_corpus(tmp_path / "text.txt", num_paragraphs=200)
    out = tmp_path / "heads.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--model", str(target), "--text", str(text), "--items", "4",
                          "--span", "8", "--gap", "16", "--json", str(out)],  # fmt: skip
                         capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["settings"]["text"] == str(text) and not {"family", "models"} & set(result["settings"])
    model = result["models"][str(target)]
    assert model["num_layers"] == 2 and model["num_heads"] == 2
    assert len(model["copy"]["scores"]) == 2 and 0 <= model["copy"]["summary"]["best_layer"] < 2
    assert len(model["retrieval"]["scores"]) == 2


def test_the_copy_score_alone_where_recall_items_cannot_be_built(tmp_path, monkeypatch, capsys):
    from fit_fixtures import make_tokenizer

    heads = _load()

    def refuse(*args, **kwargs):
        raise ValueError("no single-token numbers")

    monkeypatch.setattr(heads, "passage_recall_items", refuse)
    docs = heads.documents(write_corpus(tmp_path / "text.txt", num_paragraphs=200).read_text())
    args = SimpleNamespace(items=4, span=8, gap=16, seed=0, threshold=0.5)
    result = heads.score_model(_InductionModel(), make_tokenizer(), docs, args)
    assert result["retrieval"] is None and result["num_layers"] == 3 and result["copy"]["summary"]["best_layer"] == 1
    assert "retrieval scores skipped: no single-token numbers" in capsys.readouterr().err
