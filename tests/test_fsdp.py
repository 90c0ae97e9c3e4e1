"""FSDP2 engine: the loss and the update do not depend on how the global batch is split
(ranks, micro-batches, packed or padded rows), with sequences of very different lengths."""

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


def run_train_steps(model_dir, tmp_path, nproc, kind):
    """Results of tests/dist/train_step.py under torchrun: {setting: {loss, grad_norm, ...}}."""
    out = tmp_path / f"{kind}_n{nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           SCRIPT, model_dir, str(out), kind]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.load(open(out))


def assert_same_training(got, ref, what):
    for key in ("loss", "grad_norm"):
        for g, r in zip(got[key], ref[key]):
            assert g == pytest.approx(r, rel=1e-5), (what, key)
    assert got["params"].keys() == ref["params"].keys()
    for name in ref["params"]:
        torch.testing.assert_close(torch.tensor(got["params"][name]), torch.tensor(ref["params"][name]),
                                   rtol=1e-5, atol=1e-6, msg=f"{what}: {name}")


def test_one_vs_two_ranks_one_vs_four_microbatches_packed_vs_padded_agree(model_dir, tmp_path):
    one = run_train_steps(model_dir, tmp_path, 1, "actor")
    two = run_train_steps(model_dir, tmp_path, 2, "actor")
    ref = one["10000_True"]  # 1 rank, 1 packed micro-batch
    assert ref["n_microbatches"] == 1 and one["41_True"]["n_microbatches"] == 4
    assert two["41_False"]["n_microbatches"] == 2  # per rank
    for ranks, results in ((1, one), (2, two)):
        for setting, got in results.items():
            assert_same_training(got, ref, f"{ranks} ranks, {setting}")
