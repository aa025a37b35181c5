"""Calibration data: documents from a Hub dataset or local files -> deterministic packed token sequences.

Documents are read in a fixed order (the dataset's stream order; local files sorted by path), tokenized
without special tokens, concatenated with the EOS token between documents and cut into `seq_len`-token
sequences (the tail that does not fill a sequence is dropped). Same data + same tokenizer -> the same
`[num_sequences, seq_len]` tensor, whose SHA-256 is recorded in the mapper config so a fit can be
reproduced and a resumed run can check it continues the same sample.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads inside the functions: fit_config (and `hf-kvtransfer --help`) import this module
    import torch

logger = logging.getLogger(__name__)

# The paper's calibration set: 500 FineWeb-Edu sequences of 1,024 tokens.
DEFAULT_DATASET = "HuggingFaceFW/fineweb-edu"
DEFAULT_DATASET_CONFIG = "sample-10BT"
DEFAULT_SPLIT = "train"
DEFAULT_TEXT_FIELD = "text"
DEFAULT_NUM_SEQUENCES = 500
DEFAULT_SEQ_LEN = 1024

LOCAL_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
_TOKENIZE_CHUNK = 64  # documents per tokenizer call (fast tokenizers batch in Rust)


def _local_files(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix not in LOCAL_SUFFIXES:
            raise ValueError(
                f"cannot read calibration file {path}: unsupported suffix {path.suffix!r}; use one of {LOCAL_SUFFIXES}"
            )
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in LOCAL_SUFFIXES)
    if not files:
        raise ValueError(f"calibration directory {path} has no {'/'.join(LOCAL_SUFFIXES)} files")
    return files


def _txt_documents(path: Path) -> Iterator[str]:
    """Blank-line separated paragraphs, streamed (a multi-GB file is never read at once)."""
    lines: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                lines.append(line)
            elif lines:
                yield "".join(lines).rstrip("\n")
                lines = []
    if lines:
        yield "".join(lines).rstrip("\n")


def _field(row: dict, text_field: str, where: str) -> str:
    if text_field not in row:
        raise ValueError(
            f"{where} has no text field {text_field!r} (fields: {sorted(row)}); pass --text-field / text_field="
        )
    value = row[text_field]
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {text_field!r} holds {type(value).__name__}, expected text")
    return value


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no} is not valid JSON ({exc}); expected one JSON object per line") from exc
            yield _field(row, text_field, f"{path}:{line_no}")


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    if text_field not in parquet.schema_arrow.names:
        raise ValueError(
            f"{path} has no column {text_field!r} (columns: {parquet.schema_arrow.names}); pass --text-field"
        )
    for batch in parquet.iter_batches(columns=[text_field], batch_size=256):
        yield from (t for t in batch.column(0).to_pylist() if t)


@contextlib.contextmanager
def _quiet_retries():
    """huggingface_hub logs every HTTP retry of `datasets` as a warning; the error that follows says it all."""
    loggers = [logging.getLogger(name) for name in ("huggingface_hub.utils._http", "datasets.utils.file_utils")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _check_hub_dataset(dataset: str) -> None:
    """One request for the dataset's info: a mistyped id fails here at once, instead of after `datasets` has
    retried for half a minute. Skipped in offline mode (the `datasets` cache may hold it)."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    if constants.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").upper() in constants.ENV_VARS_TRUE_VALUES:
        return
    try:
        HfApi(endpoint=constants.ENDPOINT).dataset_info(dataset, timeout=30)
    except GatedRepoError:
        return  # it exists; `datasets` says what to do about access
    except (RepositoryNotFoundError, HFValidationError) as exc:
        raise FileNotFoundError(
            f"dataset {dataset!r} is neither a local file or directory nor a dataset on the Hub ({constants.ENDPOINT}) "
            "(a private one needs `hf auth login`); check the id, or pass a local .txt/.jsonl/.parquet file or "
            "directory with --dataset"
        ) from exc
    except Exception as exc:  # network down, timeouts, server errors: one line, no retries
        raise OSError(
            f"could not reach the Hub ({constants.ENDPOINT}) to find dataset {dataset!r}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}; check your network, set HF_HUB_OFFLINE=1 to use the "
            "datasets cache, or pass a local file with --dataset"
        ) from exc


def iter_documents(
    dataset: str | os.PathLike,
    dataset_config: str | None = None,
    split: str = DEFAULT_SPLIT,
    text_field: str = DEFAULT_TEXT_FIELD,
) -> Iterator[str]:
    """Stream text documents, in a fixed order, from a local file/directory or a Hub dataset.

    Local `.txt` files yield blank-line separated paragraphs; `.jsonl`/`.json` (one object per line) and
    `.parquet` yield `text_field`; a directory yields its files in sorted path order. Anything else is a
    Hub dataset id, streamed with `datasets.load_dataset(dataset, dataset_config, split=split, streaming=True)`.
    """
    path = Path(dataset)
    if path.exists():
        for file in _local_files(path):
            try:
                if file.suffix == ".txt":
                    yield from _txt_documents(file)
                elif file.suffix == ".parquet":
                    yield from _parquet_documents(file, text_field)
                else:
                    yield from _jsonl_documents(file, text_field)
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"cannot read calibration file {file}: {exc}") from exc
        return
    if str(dataset).endswith(LOCAL_SUFFIXES) or str(dataset).startswith((".", "/", "~")):
        raise FileNotFoundError(f"calibration file {dataset} does not exist")
    _check_hub_dataset(str(dataset))
    try:
        import datasets

        with _quiet_retries():
            stream = datasets.load_dataset(str(dataset), dataset_config, split=split, streaming=True)
            rows = iter(stream)
            first = next(rows, None)
    except Exception as exc:  # datasets raises many types (ConnectionError, DatasetNotFoundError, ...)
        raise OSError(
            f"could not stream dataset {dataset!r} (config {dataset_config!r}, split {split!r}): {exc}. "
            "Check the id/config/split, or pass a local .txt/.jsonl/.parquet file or directory with --dataset"
        ) from exc
    if first is None:
        return
    yield _field(first, text_field, f"dataset {dataset!r}")
    for row in rows:
        yield _field(row, text_field, f"dataset {dataset!r}")


def pack_documents(
    documents: Iterator[str], tokenizer, num_sequences: int, seq_len: int
) -> tuple[torch.Tensor, int]:
    """Tokenize documents in order and cut the token stream into `num_sequences` rows of `seq_len` tokens.

    Returns:
        `(input_ids [n, seq_len] int64, num_documents_used)`; `n < num_sequences` only when the data ran out.
    """
    if num_sequences < 1 or seq_len < 2:
        raise ValueError(f"need num_sequences >= 1 and seq_len >= 2, got {num_sequences} and {seq_len}")
    eos = tokenizer.eos_token_id
    rows: list[list[int]] = []
    buffer: list[int] = []
    num_documents = 0  # documents whose tokens entered the sample
    chunk: list[str] = []

    def flush(texts: list[str]) -> None:
        nonlocal buffer, num_documents
        for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
            if len(rows) >= num_sequences:
                break
            num_documents += 1
            # EOS between documents tells the model a new document starts, as in pre-training.
            buffer.extend(ids + ([eos] if eos is not None else []))
            while len(buffer) >= seq_len and len(rows) < num_sequences:
                rows.append(buffer[:seq_len])
                buffer = buffer[seq_len:]

    for text in documents:
        if not text:
            continue
        chunk.append(text)
        if len(chunk) == _TOKENIZE_CHUNK:
            flush(chunk)
            chunk = []
            if len(rows) >= num_sequences:
                break
    if chunk and len(rows) < num_sequences:
        flush(chunk)
    import torch

    # Documents tokenized in the last chunk past the point where the sample filled up were not used.
    return torch.tensor(rows, dtype=torch.long).reshape(len(rows), seq_len), num_documents


def sample_hash(input_ids: torch.Tensor) -> str:
    """SHA-256 of the exact token sample (shape + little-endian int64 ids)."""
    import torch

    h = hashlib.sha256(f"{tuple(input_ids.shape)}".encode())
    h.update(input_ids.to(torch.int64).contiguous().numpy().astype("<i8").tobytes())
    return h.hexdigest()


def build_calibration(
    tokenizer,
    dataset: str | os.PathLike = DEFAULT_DATASET,
    dataset_config: str | None = DEFAULT_DATASET_CONFIG,
    split: str = DEFAULT_SPLIT,
    text_field: str = DEFAULT_TEXT_FIELD,
    num_sequences: int = DEFAULT_NUM_SEQUENCES,
    seq_len: int = DEFAULT_SEQ_LEN,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Packed calibration token ids and a description of exactly how they were made.

    Args:
        tokenizer: the (shared) tokenizer of source and target.
        dataset: Hub dataset id (streamed) or a local `.txt`/`.jsonl`/`.parquet` file or directory.
        dataset_config, split, text_field: which part of a Hub dataset; `dataset_config` is ignored for
            local files.
        num_sequences, seq_len: sample size (paper: 500 x 1024).

    Returns:
        `(input_ids [num_sequences, seq_len], info)`; `info` (dataset, config, split, text_field,
        num_sequences, seq_len, num_documents, packing, sample_sha256) goes into `MapperConfig.calibration`.

    Example:
        ```python
        ids, info = build_calibration(tokenizer, "corpus.txt", num_sequences=64, seq_len=256)
        ```
    """
    local = Path(dataset).exists()
    documents = iter_documents(dataset, None if local else dataset_config, split, text_field)
    input_ids, num_documents = pack_documents(documents, tokenizer, num_sequences, seq_len)
    if input_ids.shape[0] == 0:
        raise ValueError(
            f"dataset {dataset!s} gave no full sequence of {seq_len} tokens ({num_documents} documents); "
            "use more text or a smaller --seq-len"
        )
    if input_ids.shape[0] < num_sequences:
        logger.warning(
            "dataset %s ran out after %d of %d sequences of %d tokens; fitting on those",
            dataset, input_ids.shape[0], num_sequences, seq_len,
        )
    info = {
        "dataset": str(dataset),
        "config": None if local else dataset_config,
        "split": None if local else split,
        "text_field": text_field,
        "num_sequences": int(input_ids.shape[0]),
        "seq_len": seq_len,
        "num_documents": num_documents,
        "packing": "documents in stream order, tokenized without special tokens, EOS between documents, "
        "cut into seq_len chunks; the unfilled tail is dropped",
        "sample_sha256": sample_hash(input_ids),
    }
    return input_ids, info


__all__ = ["build_calibration", "iter_documents", "pack_documents", "sample_hash"]
