"""The RL loop takes any :class:`~arealite.api.engine.InferenceEngine`: a user's in-process engine
(HF sampling, no HTTP; tests/dist/user_engine.py) trains GRPO through ``run_rl`` for 3 steps, and
``recipes/grpo_custom_loop.py``'s written-out loop reaches the same parameters as the library loop.

Both runs are deterministic: synchronous (``max_head_offpolicyness 0``), one rank, an engine
with its own seeded generator serving one request at a time, the same seeds. Tolerance: 1e-6 on
every parameter (they run the same operations in the same order; the observed difference is 0)."""

import json
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, env_without_dist


@pytest.fixture(scope="module")
def result(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("user_engine")
    proc = subprocess.run([sys.executable, "tests/dist/user_engine.py", tiny_model_dir, str(out)], cwd=REPO_ROOT,
                          env=env_without_dist(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((out / "result.json").read_text())


def test_a_user_engine_trains_through_the_library_loop(result):
    train = [s for s in result["library_stats"] if "summary" not in s]
    assert [s["step"] for s in train] == [0, 1, 2]
    assert result["loaded"][0] == [1, 2, 3]  # the default disk meta: one load per step, in order
    assert result["paused"] == 3  # the coordinator paused it before each push
    for s in train:
        assert s["rollout/n_samples"] == 8 and s["rollout/staleness_max"] == 0
        assert 0 < s["rollout/reward"] < 1  # varied rewards: the advantages are not all 0
        assert s["actor/grad_norm"] > 0
    assert result["max_diff_final_vs_initial"] > 1e-3  # the 3 updates (lr 1e-3) moved the weights
    assert result["engine_vs_final"] == 0.0  # the engine generates with the trained weights
    assert "eval/accuracy_end" in result["summary"]  # the held-out evaluation ran through it too


def test_the_written_out_loop_trains_like_the_library_loop(result):
    assert result["loaded"][1] == [1, 2, 3]
    assert result["max_diff_library_vs_written"] <= 1e-6
    lib = [s for s in result["library_stats"] if "summary" not in s]
    wri = [s for s in result["written_stats"] if "summary" not in s]
    for a, b in zip(lib, wri, strict=True):
        assert a["rollout/reward"] == b["rollout/reward"] and a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"])
        assert "custom/group_solved_frac" in b and "custom/group_solved_frac" not in a  # the recipe's own stat
        assert 0 <= b["custom/group_solved_frac"] <= 1 and b["custom/response_tokens"] > 0
