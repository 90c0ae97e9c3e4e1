"""CPU utilisation sampler (arealite/utils/cpu.py): hand-computed fractions from synthetic
/proc/stat snapshots, a pinned busy thread read back as one busy core, and the stats logger's
per-step and summary records."""

import json
import os
import threading
import time

import pytest

from arealite.utils import cpu as C
from arealite.utils.stats_logger import StatsLogger

# user nice system idle iowait irq softirq steal guest guest_nice
STAT_A = """cpu  300 0 100 800 0 0 0 0 0 0
cpu0 200 0 50 200 0 0 0 0 0 0
cpu1 100 0 50 600 0 0 0 0 0 0
intr 12345
ctxt 999
"""
# core0: +60 user, +20 system, +10 idle, +10 iowait, +50 guest (already inside user) -> busy 80 of 100
# core1: +5 nice, +5 irq, +90 idle -> busy 10 of 100
STAT_B = """cpu  365 5 120 900 10 5 0 0 50 0
cpu0 260 0 70 210 10 0 0 0 50 0
cpu1 100 5 50 690 0 5 0 0 0 0
"""


def test_proc_stat_parse_and_fractions_hand_computed():
    a, b = C.parse_proc_stat(STAT_A), C.parse_proc_stat(STAT_B)
    assert a == [(250.0, 450.0), (150.0, 750.0)]  # aggregate line skipped, guest not in total
    assert b == [(330.0, 550.0), (160.0, 850.0)]
    assert C.busy_fractions(a, b) == pytest.approx([0.8, 0.1])
    assert C.busy_fractions(a, a) == [0.0, 0.0]  # no ticks: 0, not a division by zero
    with pytest.raises(ValueError, match="cores"):
        C.busy_fractions(a, a[:1])
    with pytest.raises(ValueError, match="cpuN"):
        C.parse_proc_stat("cpu 1 2 3 4\nintr 5\n")


def test_sampler_step_and_run_stats_from_synthetic_snapshots():
    # cumulative (busy, total) per core; 4 readings: construction, sample, mark, sample+run_stats
    snaps = iter([
        [(0, 0), (0, 0)],
        [(90, 100), (10, 100)],  # interval 1: core1 at 10% -> an idle core
        [(180, 200), (100, 200)],  # mark: step = core0 0.9, core1 0.5
        [(280, 300), (200, 300)],  # interval 2 (since the last *sample*): 190/200 each -> no idle core
        [(280, 300), (200, 300)],
    ])
    s = C.CpuSampler(interval=0, reader=lambda: next(snaps), track_processes=False)
    assert s.sample() == pytest.approx([0.9, 0.1])
    step = s.mark()
    assert step == pytest.approx({"cpu/busy_core0": 0.9, "cpu/busy_core1": 0.5, "cpu/busy_mean": 0.7,
                                  "cpu/busy_min": 0.5, "cpu/idle_core_frac": 1.0})
    assert s.sample() == pytest.approx([0.95, 0.95])
    run = s.run_stats()
    assert run == pytest.approx({"cpu/run_busy_core0": 280 / 300, "cpu/run_busy_core1": 200 / 300,
                                 "cpu/run_busy_mean": 240 / 300, "cpu/run_busy_min": 200 / 300,
                                 "cpu/run_idle_core_frac": 0.5})
    line = C.format_run_stats(run)
    assert line.startswith("cpu over the run: core0 93% core1 67% (mean 80%)") and "50%" in line
    with pytest.raises(ValueError, match="interval"):
        C.CpuSampler(interval=-1)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_a_pinned_busy_thread_makes_its_core_busy():
    core = sorted(os.sched_getaffinity(0))[-1]
    stop = threading.Event()

    def spin():
        os.sched_setaffinity(0, {core})  # pid 0 = this thread only
        while not stop.is_set():
            pass

    s = C.CpuSampler(interval=0.2).start()
    t = threading.Thread(target=spin)
    t.start()
    time.sleep(1.5)
    stop.set()
    t.join()
    step = s.mark()
    s.stop()
    assert step[f"cpu/busy_core{core}"] >= 0.8  # the proc counters saw the spinning core
    assert s.n_cores == os.cpu_count()
    if C.psutil is not None:
        assert 0.8 <= step["cpu/proc_cores"] <= os.cpu_count() + 0.1  # ~1 core of our own CPU time
    # the reader the sampler uses agrees with /proc/stat parsed directly (same counters)
    with open(C.PROC_STAT) as f:
        direct = C.parse_proc_stat(f.read())
    assert len(direct) == len(C.read_core_times())


def test_stats_logger_writes_cpu_per_step_and_over_the_run(tmp_path, capsys):
    log = StatsLogger(str(tmp_path), 0, total_steps=2)
    for step in range(2):
        time.sleep(0.05)
        log.commit(step, {"rollout/reward": 0.5})
    log.summary(2, {"steps": 2.0})
    log.close()
    rows = [json.loads(x) for x in open(tmp_path / "stats.jsonl")]
    n = os.cpu_count()
    for r in rows[:2]:
        fr = [r[f"cpu/busy_core{i}"] for i in range(n)]
        assert all(0.0 <= f <= 1.0 for f in fr) and r["cpu/busy_mean"] == pytest.approx(sum(fr) / n)
    summary = rows[2]["summary"]
    assert summary["steps"] == 2.0 and 0.0 <= summary["cpu/run_busy_mean"] <= 1.0
    assert f"cpu/run_busy_core{n - 1}" in summary
    out = capsys.readouterr().out
    assert "cpu over the run: core0 " in out
    assert log.cpu._thread is None  # close() stopped the sampler thread
