"""Skipped computations give the same update as the full ones (issue 15, "Done when" 4), on a
real FSDPEngine (tiny Llama) and one fixed batch (tests/dist/skip_equivalence.py):

* one minibatch: π_prox from the training forward (detached) instead of a separate no-grad
  forward — GRPO and GSPO (sequence-level ratio);
* ``kl_coef = 0``: no reference model and no KL term, instead of a reference forward and
  0 · KL in the loss.

Each is compared parameter by parameter (≤ 1e-6) and stat by stat; negative controls (a shifted
proximal policy, β = 0.1) show the comparison would see a difference."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, env_without_dist, save_tiny_model

SCRIPT = os.path.join(REPO_ROOT, "tests", "dist", "skip_equivalence.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("skip_eq")
    model = save_tiny_model(str(d / "model"), seed=0, initializer_range=0.2)
    ref = save_tiny_model(str(d / "ref"), seed=1, initializer_range=0.2)
    out = d / "out.json"
    # A test that ran init_distributed() in this pytest process left RANK / MASTER_PORT in
    # os.environ (its TCPStore holds that port): the script must make its own 1-rank group.
    proc = subprocess.run([sys.executable, SCRIPT, model, ref, str(out)], capture_output=True, text=True,
                          timeout=240, env=env_without_dist(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.load(open(out))


def max_param_diff(a: dict, b: dict) -> float:
    assert a["params"].keys() == b["params"].keys()
    return max(max(abs(x - y) for x, y in zip(a["params"][n], b["params"][n])) for n in a["params"])


@pytest.mark.parametrize("algo", ["grpo", "gspo"])
def test_one_minibatch_prox_from_training_forward_equals_a_separate_forward(results, algo):
    skip, full, wrong = results[f"{algo}_skip"], results[f"{algo}_full"], results[f"{algo}_wrong"]
    assert max_param_diff(skip, results["init"]) > 1e-3  # the update moved the weights
    assert max_param_diff(skip, full) <= 1e-6
    assert skip["stats"].keys() == full["stats"].keys()
    for k, v in skip["stats"].items():
        assert full["stats"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    assert skip["stats"]["actor/importance_weight"] != 1.0  # behaviour weights were in play
    # negative control: a proximal policy 0.5 nats off (beyond the clip range) changes the update
    assert max_param_diff(skip, wrong) > 1e-4
    assert abs(wrong["stats"]["actor/approx_kl"] - skip["stats"]["actor/approx_kl"]) > 1e-3


def test_zero_kl_coef_without_reference_equals_reference_forward_with_zero_weighted_kl(results):
    skip, full, wrong = results["grpo_skip"], results["grpo_kl_full"], results["grpo_kl_wrong"]
    assert max_param_diff(skip, full) <= 1e-6
    for k, v in skip["stats"].items():
        assert full["stats"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    assert full["stats"]["actor/kl_ref"] > 1e-3  # the reference (other weights) really differed
    assert "actor/kl_ref" not in skip["stats"]
    assert max_param_diff(skip, wrong) > 1e-4  # β = 0.1: the same KL term does move the update


@pytest.mark.parametrize("loss,skipped", [("ppo", [4.0, 7.0]), ("cispo", [4.0, 7.0]), ("gmpo", [4.0, 7.0]),
                                          ("gspo", [4.0, 7.0]), ("ppo_2mb", [3.0, 6.0])])
def test_rows_with_zero_advantages_are_left_out_with_the_same_update(results, loss, skipped):
    """GRPO trains no row whose advantages are all 0 (a group with all-equal rewards) and passes
    its loss weight to the engine instead: the same two updates (the second on all-inert groups,
    where one row is kept so that AdamW's momentum still steps) as training every row. With two
    minibatches (one group each) one row of each all-inert minibatch is kept, and the proximal
    forward pass runs on the rows trained only."""
    skip, full, unweighted = (results[f"inert_{loss}_{m}"] for m in ("skip", "full", "unweighted"))
    assert max_param_diff(full, results["init"]) > 1e-3
    assert max_param_diff(skip, full) <= 1e-6
    assert [s["rows_skipped"] for s in skip["stats"]] == skipped
    assert [s["rows_skipped"] for s in full["stats"]] == [0.0, 0.0]
    for s, f in zip(skip["stats"], full["stats"]):
        for key in ("loss", "grad_norm", "lr"):
            assert s[key] == pytest.approx(f[key], rel=1e-5, abs=1e-7), key
        assert s["actor/advantage_abs_mean"] == f["actor/advantage_abs_mean"]
    assert skip["stats"][1]["grad_norm"] == 0.0  # all inert: a zero gradient, yet the weights moved
    # negative control: leaving the rows out without their weight rescales the step (not with one
    # group per minibatch: there a minibatch is wholly inert or has no inert row)
    assert max_param_diff(unweighted, full) > 1e-4 or loss == "ppo_2mb"
