"""Calibration data: local files and Hub ids -> deterministic packed token sequences."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fit_fixtures import make_tokenizer, write_corpus
from hf_kvtransfer.fitting.calibration import build_calibration, iter_documents, sample_hash


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def _expected_ids(paragraphs, tokenizer, n, seq_len):
    # Independent of the packer: word -> id through the vocabulary, EOS after every document.
    vocab = tokenizer.get_vocab()
    stream = []
    for p in paragraphs:
        stream += [vocab[w] for w in p.split()] + [tokenizer.eos_token_id]
    return torch.tensor(stream[: n * seq_len]).reshape(n, seq_len)


def test_txt_packing_matches_manual_tokenization(tmp_path, tokenizer):
    path = write_corpus(tmp_path / "c.txt", num_paragraphs=30)
    paragraphs = path.read_text().strip().split("\n\n")
    ids, info = build_calibration(tokenizer, path, num_sequences=7, seq_len=50)
    assert torch.equal(ids, _expected_ids(paragraphs, tokenizer, 7, 50))
    assert info["num_sequences"] == 7 and info["seq_len"] == 50 and info["text_field"] == "text"
    assert info["sample_sha256"] == sample_hash(ids)
    # deterministic: the same call gives the same sample; a different size a different hash
    assert build_calibration(tokenizer, path, num_sequences=7, seq_len=50)[1]["sample_sha256"] == info["sample_sha256"]
    assert build_calibration(tokenizer, path, num_sequences=6, seq_len=50)[1]["sample_sha256"] != info["sample_sha256"]


def test_jsonl_parquet_and_directory_give_the_same_sample(tmp_path, tokenizer):
    paragraphs = write_corpus(tmp_path / "c.txt", num_paragraphs=30).read_text().strip().split("\n\n")
    ref, _ = build_calibration(tokenizer, tmp_path / "c.txt", num_sequences=5, seq_len=40)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"body": p, "id": i}) + "\n" for i, p in enumerate(paragraphs)))
    pq.write_table(pa.table({"body": paragraphs}), tmp_path / "d.parquet")
    for name in ("d.jsonl", "d.parquet"):
        ids, _ = build_calibration(tokenizer, tmp_path / name, text_field="body", num_sequences=5, seq_len=40)
        assert torch.equal(ids, ref), name
    # a directory reads its files in sorted path order: a.txt (first half) then b.txt (second half)
    d = tmp_path / "dir"
    d.mkdir()
    (d / "b.txt").write_text("\n\n".join(paragraphs[15:]))
    (d / "a.txt").write_text("\n\n".join(paragraphs[:15]))
    ids, _ = build_calibration(tokenizer, d, num_sequences=5, seq_len=40)
    assert torch.equal(ids, ref)


def test_missing_text_field_names_the_fields(tmp_path, tokenizer):
    (tmp_path / "d.jsonl").write_text(json.dumps({"content": "w1 w2"}) + "\n")
    with pytest.raises(ValueError, match=r"no text field 'text' \(fields: \['content'\]\)"):
        build_calibration(tokenizer, tmp_path / "d.jsonl", num_sequences=1, seq_len=4)


def test_unreadable_datasets_give_clear_errors(tmp_path, tokenizer, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_calibration(tokenizer, tmp_path / "missing.txt", num_sequences=1, seq_len=4)
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1 is not valid JSON"):
        build_calibration(tokenizer, tmp_path / "bad.jsonl", num_sequences=1, seq_len=4)
    (tmp_path / "short.txt").write_text("w1 w2 w3")
    with pytest.raises(ValueError, match="no full sequence of 64 tokens"):
        build_calibration(tokenizer, tmp_path / "short.txt", num_sequences=1, seq_len=64)

    import datasets

    import hf_kvtransfer.fitting.calibration as calibration

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    # datasets' own failure (the one-request existence check before it is tested in test_cli_errors.py)
    monkeypatch.setattr(calibration, "_check_hub_dataset", lambda dataset: None)
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(OSError, match="could not stream dataset 'org/corpus'.*local .txt"):
        build_calibration(tokenizer, "org/corpus", num_sequences=1, seq_len=4)


def test_hub_dataset_is_streamed_with_config_and_split(tokenizer, monkeypatch):
    import datasets

    calls = []

    def fake_load(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        return iter([{"text": "w1 w2 w3 w4"}, {"text": "w5 w6 w7"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    checked = []
    monkeypatch.setattr("hf_kvtransfer.fitting.calibration._check_hub_dataset", checked.append)  # no network in tests
    ids, info = build_calibration(tokenizer, "org/corpus", "cfg", "validation", num_sequences=2, seq_len=4)
    assert calls == [("org/corpus", "cfg", "validation", True)] and checked == ["org/corpus"]
    assert ids.tolist() == [[5, 6, 7, 8], [2, 9, 10, 11]]  # EOS (2) between the documents
    assert (info["dataset"], info["config"], info["split"]) == ("org/corpus", "cfg", "validation")


def test_running_out_of_data_warns_and_keeps_what_there_is(tmp_path, tokenizer, caplog):
    write_corpus(tmp_path / "c.txt", num_paragraphs=4)
    with caplog.at_level(logging.WARNING):
        ids, info = build_calibration(tokenizer, tmp_path / "c.txt", num_sequences=1000, seq_len=16)
    assert 0 < ids.shape[0] < 1000 and info["num_sequences"] == ids.shape[0]
    assert "ran out" in caplog.text
    assert list(iter_documents(tmp_path / "c.txt"))[0].startswith("w")


def test_documents_longer_than_the_model_are_packed_without_the_tokenizer_warning(tmp_path, tokenizer, caplog):
    # Documents are cut into sequences after tokenizing, so transformers' "longer than the specified maximum
    # sequence length" warning would be spurious (issue 12: the demo printed it on every run).
    import logging

    from transformers.utils import logging as hf_logging

    short = make_tokenizer()  # fresh: the tokenizer warns once per instance
    short.model_max_length = 16
    path = write_corpus(tmp_path / "c.txt", num_paragraphs=30)  # 20-60 words each: all longer than 16 tokens
    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            ids, _ = build_calibration(short, path, num_sequences=7, seq_len=50)
    finally:
        hf_logging.disable_propagation()
    paragraphs = path.read_text().strip().split("\n\n")
    assert torch.equal(ids, _expected_ids(paragraphs, tokenizer, 7, 50))
    assert not [r for r in caplog.records if "Token indices sequence length" in r.getMessage()]
