"""The per-step progress line (ETA, last held-out score) and the optional wandb logging of
arealite/utils/stats_logger.py."""

import json
import os
import time
import sys
import types

import pytest

from arealite.api.config import WandbConfig
from arealite.utils import stats_logger as sl


def test_progress_line_has_eta_and_the_last_held_out_score(tmp_path, monkeypatch, capsys):
    now = [100.0]
    monkeypatch.setattr(sl, "time", types.SimpleNamespace(time=lambda: now[0]))  # the logger's clock only
    log = sl.StatsLogger(str(tmp_path), 0, total_steps=5)
    log.commit(0, {"time/gen_wait_s": 4.0, "time/train_s": 5.0, "time/weight_sync_s": 1.0})
    now[0] = 110.0
    log.commit(1, {"eval/accuracy": 0.25, "eval/version": 1.0, "eval/time_s": 3.0})
    now[0] = 120.0
    log.commit(2, {})
    log.close()
    lines = capsys.readouterr().out.splitlines()
    # step 1: its own time split (10 s) × 4 steps left; then the mean commit interval (10 s) × steps left
    assert lines[0] == "step 1/5 | gen_wait 4.0s | train 5.0s | sync 1.0s | eta 0:00:40"
    assert lines[1] == "step 2/5 | eta 0:00:30 | held-out accuracy 0.250 (v1)"
    assert lines[2] == "step 3/5 | eta 0:00:20 | held-out accuracy 0.250 (v1)"
    assert [json.loads(x)["step"] for x in open(tmp_path / "stats.jsonl")] == [0, 1, 2]
    start = sl.StatsLogger(str(tmp_path / "start"), 0, total_steps=2)
    start.last_eval = ("eval/accuracy", 0.078, 0.0)  # the evaluation before training (rl_loop sets it)
    start.commit(0, {})
    start.close()
    assert capsys.readouterr().out.endswith("held-out accuracy 0.078 (v0, before training)\n")
    assert sl.format_eta(3725) == "1:02:05" and sl.format_eta(float("nan")) == "?"


def test_wandb_requested_but_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ImportError, match="logger.wandb.project is set but wandb is not installed"):
        sl.StatsLogger(str(tmp_path / "run"), 0, 3, WandbConfig(project="p"))
    assert not os.path.exists(tmp_path / "run")  # raised before any file is written
    sl.StatsLogger(str(tmp_path / "run2"), 0, 3, WandbConfig()).close()  # no project: no wandb needed


def test_wandb_offline_writes_its_run_folder(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = sl.StatsLogger(str(tmp_path), 0, 2, WandbConfig(project="arealite-test"), {"seed": 1})
    log.commit(0, {"rollout/reward": 0.5})
    log.summary(1, {"eval/accuracy_end": 0.75})
    run = log.wandb_run
    assert run.summary["eval/accuracy_end"] == 0.75
    assert run.config["seed"] == 1
    log.close()
    runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
    assert len(runs) == 1
    logs = [f for f in os.listdir(tmp_path / "wandb" / runs[0]) if f.endswith(".wandb")]
    # What `wandb sync` uploads. wandb's service process writes it; on a loaded machine the last
    # records can land a moment after finish() returns.
    path, deadline = tmp_path / "wandb" / runs[0] / logs[0], time.monotonic() + 60
    while True:
        record = open(path, "rb").read()
        if (b"rollout/reward" in record and b"eval/accuracy_end" in record) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert b"rollout/reward" in record and b"eval/accuracy_end" in record
