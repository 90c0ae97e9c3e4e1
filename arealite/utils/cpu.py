"""CPU utilisation of a run: the busy fraction of each core, per step and over the whole run.

The kernel's cumulative per-core counters (``/proc/stat`` lines ``cpuN``, or
``psutil.cpu_times(percpu=True)``, which reads the same counters) give the exact busy fraction
of core ``i`` between two snapshots ``a`` and ``b``::

    busy_i = (busy_i(b) - busy_i(a)) / (total_i(b) - total_i(a))
    total  = user + nice + system + idle + iowait + irq + softirq + steal   # guest is inside user/nice
    busy   = total - idle - iowait                                       # the convention of psutil.cpu_percent

so the per-step and whole-run fractions need only a snapshot at each step boundary (no thread).
:class:`CpuSampler` also runs a daemon thread that takes a snapshot every ``interval`` seconds
(one read of ``/proc/stat``, ~50 µs) to tell *when* cores were idle: ``cpu/idle_core_frac`` is the
share of those intervals in which at least one core was below ``idle_threshold`` busy — the
"one core sat idle while training ran" pattern of issue 15.

The counters are machine-wide: other jobs on the same machine count as busy. ``cpu/proc_cores``
(psutil only) is the CPU time of this process and its descendants (e.g. the generation servers
it launched) per wall second, i.e. how many cores this run itself kept busy.

Keys (see :meth:`CpuSampler.mark` and :meth:`CpuSampler.run_stats`): ``cpu/busy_core{i}``,
``cpu/busy_mean``, ``cpu/busy_min``, ``cpu/idle_core_frac``, ``cpu/proc_cores``; over the run the
same names with ``cpu/run_`` instead of ``cpu/``. Fractions are in [0, 1].
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

try:
    import psutil
except ImportError:  # optional: /proc/stat is read directly
    psutil = None

CoreTimes = list[tuple[float, float]]  # per core: (busy, total), cumulative, any time unit

PROC_STAT = "/proc/stat"


def parse_proc_stat(text: str) -> CoreTimes:
    """Per-core ``(busy, total)`` clock ticks from the text of ``/proc/stat``.

    Only the ``cpuN`` lines are read (the aggregate ``cpu`` line is skipped), in the order of N.
    Fields (proc(5)): user nice system idle iowait irq softirq steal guest guest_nice; guest and
    guest_nice are already counted in user and nice, so they are left out of the total.

    Raises:
        ValueError: no ``cpuN`` line, or a line with fewer than 4 counters.
    """
    cores: dict[int, tuple[float, float]] = {}
    for line in text.splitlines():
        name, *fields = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit()):
            continue
        if len(fields) < 4:
            raise ValueError(f"{PROC_STAT}: line {line!r} has fewer than 4 counters")
        v = [float(x) for x in fields[:8]]
        total = sum(v)
        idle = v[3] + (v[4] if len(v) > 4 else 0.0)  # idle + iowait
        cores[int(name[3:])] = (total - idle, total)
    if not cores:
        raise ValueError(f"{PROC_STAT}: no per-core 'cpuN' lines found")
    return [cores[i] for i in sorted(cores)]


def read_core_times() -> CoreTimes:
    """This machine's per-core ``(busy, total)`` counters: psutil when installed, else
    ``/proc/stat`` (Linux).

    Raises:
        OSError: neither psutil nor a readable ``/proc/stat``.
    """
    if psutil is not None:
        out = []
        for t in psutil.cpu_times(percpu=True):
            d = t._asdict()
            total = sum(d.values()) - d.get("guest", 0.0) - d.get("guest_nice", 0.0)
            out.append((total - d["idle"] - d.get("iowait", 0.0), total))
        return out
    with open(PROC_STAT) as f:
        return parse_proc_stat(f.read())


def busy_fractions(a: CoreTimes, b: CoreTimes) -> list[float]:
    """Busy fraction of each core between snapshots ``a`` (earlier) and ``b``; a core whose
    counters did not move reads 0.

    Raises:
        ValueError: the snapshots have different numbers of cores (a core went offline).
    """
    if len(a) != len(b):
        raise ValueError(f"CPU snapshots have {len(a)} and {len(b)} cores; a core went on/offline")
    out = []
    for (busy_a, total_a), (busy_b, total_b) in zip(a, b):
        dt = total_b - total_a
        out.append(min(max((busy_b - busy_a) / dt, 0.0), 1.0) if dt > 0 else 0.0)
    return out


class _ProcTree:
    """CPU seconds (user + system) used by this process and its live descendants, accumulated
    per pid so that a child that starts mid-interval is counted and one that exits keeps what
    was counted before (psutil only)."""

    def __init__(self):
        self.me = psutil.Process(os.getpid())
        self.seen: dict[tuple[int, float], float] = {}  # (pid, create_time) -> cpu seconds counted
        self.total = 0.0
        self.update()

    def update(self) -> float:
        for p in [self.me, *self.me.children(recursive=True)]:
            try:
                with p.oneshot():
                    key, t = (p.pid, p.create_time()), p.cpu_times()
                cpu = t.user + t.system
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            self.total += max(cpu - self.seen.get(key, 0.0), 0.0)
            self.seen[key] = cpu
        return self.total


class CpuSampler:
    """Busy fraction of each core over a run and between :meth:`mark` calls (one per step).

    Args:
        interval: seconds between the background thread's snapshots (for
            ``idle_core_frac``); 0 = no thread (fractions are still exact).
        idle_threshold: a core below this busy fraction over one interval counts as idle.
        reader: ``() -> CoreTimes`` (default :func:`read_core_times`; tests pass synthetic ones).
        clock: wall clock for ``proc_cores`` [s].
        track_processes: measure ``proc_cores`` (needs psutil; ignored without it).

    Raises:
        ValueError: ``interval`` < 0 or ``idle_threshold`` outside [0, 1].
    """

    def __init__(self, interval: float = 1.0, idle_threshold: float = 0.5,
                 reader: Callable[[], CoreTimes] = read_core_times, clock: Callable[[], float] = time.monotonic,
                 track_processes: bool = True):
        if not interval >= 0:
            raise ValueError(f"CpuSampler interval={interval!r}: must be >= 0 seconds (0 = no thread)")
        if not 0.0 <= idle_threshold <= 1.0:
            raise ValueError(f"CpuSampler idle_threshold={idle_threshold!r}: must be in [0, 1]")
        self.interval, self.idle_threshold, self.reader, self.clock = interval, idle_threshold, reader, clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc = _ProcTree() if track_processes and psutil is not None else None
        self._start = self._last = self._sample = reader()
        self._t_start = self._t_last = clock()
        self._cpu_start = self._cpu_last = self._proc.total if self._proc else 0.0
        self._intervals = [0, 0]  # [sampled intervals, intervals with an idle core] since mark
        self._run_intervals = [0, 0]
        self.n_cores = len(self._start)

    def start(self) -> "CpuSampler":
        """Start the background thread (no-op with ``interval`` 0); returns self."""
        if self.interval > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> list[float]:
        """Take one snapshot and count the interval since the previous one (the thread calls
        this every ``interval`` s); returns that interval's per-core fractions."""
        now = self.reader()
        with self._lock:
            fr = busy_fractions(self._sample, now)
            self._sample = now
            idle = int(min(fr) < self.idle_threshold)
            for c in (self._intervals, self._run_intervals):
                c[0] += 1
                c[1] += idle
        return fr

    def _stats(self, prefix: str, a: CoreTimes, b: CoreTimes, intervals: list[int], dt: float,
               cpu_s: float) -> dict[str, float]:
        fr = busy_fractions(a, b)
        out = {f"{prefix}busy_core{i}": f for i, f in enumerate(fr)}
        out[f"{prefix}busy_mean"] = sum(fr) / len(fr)
        out[f"{prefix}busy_min"] = min(fr)
        if intervals[0]:
            out[f"{prefix}idle_core_frac"] = intervals[1] / intervals[0]
        if self._proc is not None and dt > 0:
            out[f"{prefix}proc_cores"] = cpu_s / dt
        return out

    def mark(self) -> dict[str, float]:
        """Stats since the previous :meth:`mark` (or construction): ``cpu/busy_core{i}``,
        ``cpu/busy_mean``, ``cpu/busy_min``, ``cpu/idle_core_frac`` (when the thread sampled at
        least one interval), ``cpu/proc_cores`` (psutil)."""
        now, t = self.reader(), self.clock()
        cpu = self._proc.update() if self._proc else 0.0
        with self._lock:
            intervals, self._intervals = self._intervals, [0, 0]
        out = self._stats("cpu/", self._last, now, intervals, t - self._t_last, cpu - self._cpu_last)
        self._last, self._t_last, self._cpu_last = now, t, cpu
        return out

    def run_stats(self) -> dict[str, float]:
        """The same stats since construction, named ``cpu/run_*`` (does not reset anything)."""
        now, t = self.reader(), self.clock()
        cpu = self._proc.update() if self._proc else 0.0
        with self._lock:
            intervals = list(self._run_intervals)
        return self._stats("cpu/run_", self._start, now, intervals, t - self._t_start, cpu - self._cpu_start)

    def stop(self) -> None:
        """Stop the background thread (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def format_run_stats(stats: dict[str, float]) -> str:
    """One console line from :meth:`CpuSampler.run_stats`, e.g.
    ``cpu over the run: core0 97% core1 45% (mean 71%), a core idle in 40% of 1 s intervals,
    this run's processes 1.38 cores``."""
    cores = sorted((int(k[len("cpu/run_busy_core"):]), v) for k, v in stats.items()
                   if k.startswith("cpu/run_busy_core"))
    s = "cpu over the run: " + " ".join(f"core{i} {v:.0%}" for i, v in cores)
    s += f" (mean {stats['cpu/run_busy_mean']:.0%})"
    if "cpu/run_idle_core_frac" in stats:
        s += f", a core idle in {stats['cpu/run_idle_core_frac']:.0%} of the sampled intervals"
    if "cpu/run_proc_cores" in stats:
        s += f", this run's processes {stats['cpu/run_proc_cores']:.2f} cores"
    return s
