"""The timeline trace (arealite/utils/trace.py): bounded, thread-safe, lanes never overlap, the
client's interrupted segments are visible, and a 3-step tiny GRPO run writes a trace.json whose
tracks and spans agree with its stats.jsonl."""

import json
import os
import subprocess
import sys
import threading

import pytest

from arealite.utils import trace
from arealite.utils.trace import Tracer, merge_files
from conftest import REPO_ROOT
from test_remote import ABORT_PARTIAL, STOP, _run, fake_sglang  # noqa: F401 (fixture)


def _names(events):
    """{(pid, tid): "process/track"} and {pid: process} from the metadata events."""
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    tracks = {(e["pid"], e["tid"]): procs[e["pid"]] + "/" + e["args"]["name"] for e in events if e["name"] == "thread_name"}
    return procs, tracks


def test_bounded_keeps_the_first_half_and_the_most_recent_half(tmp_path):
    t = Tracer(max_events=10)
    for i in range(25):
        t.complete(f"e{i}", i, i + 0.5)
    kept = [e["name"] for e in t.events() if e["ph"] == "X"]
    assert kept == [f"e{i}" for i in range(5)] + [f"e{i}" for i in range(20, 25)]
    assert t.dropped == 15
    t.save(str(tmp_path / "t.json"))
    data = json.load(open(tmp_path / "t.json"))
    assert data["otherData"]["dropped_events"] == 15
    ev = [e for e in data["traceEvents"] if e["ph"] == "X"][0]
    assert ev["ts"] == 0 and ev["dur"] == 0.5e6  # µs
    assert _names(data["traceEvents"])[1][(ev["pid"], ev["tid"])] == "trainer/rank 0"


def test_thread_safe_counts_every_event():
    t = Tracer(max_events=100_000)

    def work(k):
        for i in range(2000):
            with t.span("s", track=f"thread {k}"):
                pass

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    [th.start() for th in threads]
    [th.join() for th in threads]
    assert sum(e["ph"] == "X" for e in t.events()) == 8000
    assert len(_names(t.events())[1]) == 4


def test_lanes_hold_non_overlapping_spans():
    t = Tracer()
    spans = [(0, 10), (1, 5), (6, 8), (2, 12), (11, 13)]  # recorded in end order, as the client does
    for a, b in sorted(spans, key=lambda s: s[1]):
        t.lane_complete("server a", "generate", a, b)
    by_lane = {}
    _, tracks = _names(t.events())
    for e in t.events():
        if e["ph"] == "X":
            by_lane.setdefault(tracks[(e["pid"], e["tid"])], []).append((e["ts"], e["ts"] + e["dur"]))
    for lane in by_lane.values():
        lane.sort()
        assert all(x[1] <= y[0] for x, y in zip(lane, lane[1:]))
    assert sorted(by_lane) == ["server a/rank 0 slot 0", "server a/rank 0 slot 1", "server a/rank 0 slot 2"]


def test_interrupted_segments_are_separate_spans_on_the_server_track(fake_sglang):  # noqa: F811
    from arealite.api.config import GenerationConfig, InferenceEngineConfig
    from arealite.api.io_struct import ModelRequest
    from arealite.inference.remote import RemoteInferenceEngine

    addr, script, _ = fake_sglang
    script += [ABORT_PARTIAL, STOP]
    engine = RemoteInferenceEngine(InferenceEngineConfig(request_timeout=10), [addr])
    t = trace.install(Tracer())
    try:
        _run(engine, lambda: engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=GenerationConfig(max_new_tokens=10))))
    finally:
        trace.install(None)
    _, tracks = _names(t.events())
    spans = [(tracks[(e["pid"], e["tid"])], e["name"], e["args"]["tokens"]) for e in t.events() if e["ph"] == "X"]
    lane = f"server {addr}/rank 0 slot 0"
    assert spans == [(lane, "interrupted", 2), (lane, "generate", 2)]


def test_merge_files_concatenates_ranks_and_skips_a_missing_file(tmp_path):
    for r in range(2):
        t = Tracer(track=f"rank {r}")
        t.complete("train", r, r + 1)
        t.save(str(tmp_path / f"r{r}.json"))
    merge_files([str(tmp_path / "r0.json"), str(tmp_path / "r1.json"), str(tmp_path / "gone.json")], str(tmp_path / "m.json"))
    events = json.load(open(tmp_path / "m.json"))["traceEvents"]
    _, tracks = _names(events)
    assert sorted(tracks[(e["pid"], e["tid"])] for e in events if e["ph"] == "X") == ["trainer/rank 0", "trainer/rank 1"]


def run_tiny_rl(root, *extra, steps=3, check=True):
    """A ``steps``-step GRPO run of the tiny model (1 rank, our launched server) under
    ``root``; returns (output folder, completed process)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           os.path.join(REPO_ROOT, "recipes", "grpo_math.py"), "--actor.path", extra[0], "--fileroot", str(root),
           "--total_train_steps", str(steps), "--gconfig.n_samples", "2", "--gconfig.max_new_tokens", "8",
           "--rollout.consumer_batch_size", "4", "--train_dataset.batch_size", "4", "--valid_dataset.size", "4",
           "--evaluator.freq_steps", "1", *extra[1:]]
    proc = subprocess.run(cmd, cwd=str(root), capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return root / "grpo_math" / "trial0", proc


def test_three_step_run_trace_has_the_tracks_and_agrees_with_stats(tiny_model_dir, tmp_path):
    out, proc = run_tiny_rl(tmp_path, tiny_model_dir, "--evaluator.n_samples", "2")
    events = json.load(open(out / "trace.json"))["traceEvents"]
    procs, tracks = _names(events)
    stats = [json.loads(line) for line in open(out / "stats.jsonl")]
    steps = [s for s in stats if "summary" not in s]
    assert len(steps) == 3
    spans = [(tracks[(e["pid"], e["tid"])], e) for e in events if e["ph"] == "X"]
    # tracks: the trainer rank, one group per server (its request lanes), the staleness gate counter
    assert {t for t, _ in spans if t.startswith("trainer/")} == {"trainer/rank 0"}
    servers = {t.split("/")[0] for t, e in spans if e["name"] in ("generate", "interrupted")}
    assert len(servers) == 1 and next(iter(servers)).startswith("server 127.0.0.1:")
    gate = [e for e in events if e["ph"] == "C" and e["name"] == "staleness gate"]
    assert gate and procs[gate[0]["pid"]] == "rollout rank 0" and {g["args"]["open"] for g in gate} <= {0, 1}
    assert any(g["args"]["open"] == 0 for g in gate)  # η = 1: the gate closes once 2 batches are out
    # the trainer's spans agree with the step times in stats.jsonl (within 5%)
    for s in steps:
        mine = {e["name"]: e for t, e in spans if t == "trainer/rank 0" and e.get("args", {}).get("step") == s["step"]}
        for name, key in (("rollout-wait", "time/gen_wait_s"), ("train", "time/train_s"), ("weight-sync", "time/weight_sync_s")):
            assert mine[name]["dur"] / 1e6 == pytest.approx(s[key], rel=0.05, abs=1e-3)
        train = mine["train"]
        assert train["ts"] / 1e6 == pytest.approx(s["time/train_start"], abs=0.05 * s["time/train_s"] + 1e-3)
        # forward / backward / optimizer (engine/fsdp.py) lie inside this step's train span
        inner = [e for t, e in spans if t == "trainer/rank 0" and e["name"] in ("forward", "backward", "optimizer")
                 and train["ts"] <= e["ts"] and e["ts"] + e["dur"] <= train["ts"] + train["dur"] + 1]
        assert {e["name"] for e in inner} == {"forward", "backward", "optimizer"}
        assert 0.3 * train["dur"] < sum(e["dur"] for e in inner) <= train["dur"] + 1
    # every trained sample was generated: at least 3 steps × 4 prompts × 2 samples request spans
    assert sum(e["name"] == "generate" for _, e in spans) >= 24
    # the in-loop evaluation (2 samples per problem) is logged with the version it evaluated
    evals = [s for s in steps if "eval/version" in s]
    assert evals and all({"eval/pass@1", "eval/pass@2", "eval/maj@2"} <= set(s) for s in evals)
    assert all(s["eval/version"] <= s["step"] + 1 for s in evals)


def test_periodic_flush_runs_in_the_background_and_the_final_save_wins(tmp_path):
    t = Tracer()
    t.complete("a", 0, 1)
    path = str(tmp_path / "trace.json")
    t.maybe_save(path, every_s=0)  # starts a background write
    t.complete("b", 1, 2)
    t.save(path)  # waits for that write, then writes the newer snapshot
    assert [e["name"] for e in json.load(open(path))["traceEvents"] if e["ph"] == "X"] == ["a", "b"]
    saver = t._saver
    t.maybe_save(path, every_s=3600)  # saved just now: no new write
    assert t._saver is saver
