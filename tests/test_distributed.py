"""Two processes (torchrun, gloo on CPU) give the same statistics and mapper as one process."""

import os
import subprocess
import sys

import torch

from conftest import HANG_GUARD_S
from fit_fixtures import save_pair, write_corpus
from hf_kvtransfer import KVMapper, KVStatistics
from hf_kvtransfer.commands.cli import main


def test_two_ranks_equal_one(tmp_path):
    source, target = save_pair(tmp_path / "models")
    corpus = write_corpus(tmp_path / "corpus.txt", num_paragraphs=120)

    def args(output, stats):
        return [
            "fit", "--source", str(source), "--target", str(target), "--dataset", str(corpus), "--output", str(output),
            "--num-sequences", "13", "--seq-len", "32", "--batch-size", "3", "--top-k", "2",
            "--heldout-fraction", "0.3", "--stats-dir", str(stats),
        ]  # fmt: skip

    assert main(args(tmp_path / "one", tmp_path / "stats-one")) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "hf_kvtransfer.commands.cli", *args(tmp_path / "two", tmp_path / "stats-two")],
        capture_output=True, text=True, env=env, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("wrote ") == 1  # rank 0 writes, rank 1 does not
    assert "2 processes" in proc.stderr
    for part in ("train", "heldout"):
        one, two = KVStatistics.load(tmp_path / "stats-one" / part), KVStatistics.load(tmp_path / "stats-two" / part)
        # disjoint shards: the token count is that of one pass, not twice it
        assert one.count == two.count > 0
        for name in one.tensors:
            torch.testing.assert_close(two.tensors[name], one.tensors[name], rtol=1e-10, atol=1e-9)
    m1, m2 = KVMapper.from_pretrained(tmp_path / "one"), KVMapper.from_pretrained(tmp_path / "two")
    assert m1.config.selected_layers == m2.config.selected_layers
    assert m1.config.calibration == m2.config.calibration
    for name, tensor in m1.state_dict().items():
        torch.testing.assert_close(m2.state_dict()[name], tensor, rtol=1e-5, atol=1e-6)
