"""FSDP2 engine: the loss and the update do not depend on how the global batch is split."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, save_tiny_model

SCRIPT = os.path.join(REPO_ROOT, "tests", "dist", "train_step.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("fsdp_model")), initializer_range=0.2)


def _run(model_dir, tmp_path, nproc, max_tokens):
    out = tmp_path / f"n{nproc}_t{max_tokens}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           SCRIPT, model_dir, str(out), str(max_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.load(open(out))


def test_one_vs_two_ranks_and_one_vs_many_microbatches_agree(model_dir, tmp_path):
    ref = _run(model_dir, tmp_path, nproc=1, max_tokens=10_000)  # 1 rank, 1 micro-batch
    assert ref["n_microbatches"] == 1
    for nproc, max_tokens in [(1, 40), (2, 10_000), (2, 40)]:
        got = _run(model_dir, tmp_path, nproc, max_tokens)
        if max_tokens == 40:
            assert got["n_microbatches"] >= 2
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), (nproc, max_tokens)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), (nproc, max_tokens)
        torch.testing.assert_close(torch.tensor(got["param"]), torch.tensor(ref["param"]), rtol=1e-5, atol=1e-6)
