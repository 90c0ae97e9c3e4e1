"""A timeline of the run in Chrome trace-event format (``{"traceEvents": [...]}``; opens in
https://ui.perfetto.dev or chrome://tracing).

Events (https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU):
``"X"`` complete spans (``ts``/``dur`` in µs of wall-clock time, ``time.time()``, so that the
files of several processes line up and match ``stats.jsonl``), ``"C"`` counters, ``"i"``
instants, and ``"M"`` metadata naming each process (a group of tracks: ``trainer``, ``server
127.0.0.1:port``, ``rollout rank r``) and thread (a track: ``rank r``, ``rank r slot j``). Process and
thread ids are stable hashes of those names, so files written by different processes merge by
concatenation (:func:`merge_files`).

Overlapping spans (concurrent requests on one server) go to *lanes*: :meth:`Tracer.lane_complete`
puts a span on the first ``<track> slot j`` track of its group that is free at its start (``<track>``
is the tracer's own, e.g. ``rank 1``, so that the clients of several ranks never share one), so every track
holds properly nested spans.

Bounded size: at most ``max_events`` events are kept (default 100,000, about 12 MB of JSON):
the first half forever, then the most recent half in a ring (older ones in that part are
rotated out); ``otherData.dropped_events`` counts what was lost. Thread-safe (one lock per
event append). Disabled (``AREALITE_TRACE=0`` or no tracer installed) every call is a no-op:
the module functions check one global.

Usage::

    from arealite.utils import trace
    trace.install(trace.Tracer(process="trainer", track="rank 0"))
    with trace.span("forward"):
        ...
    trace.complete("weight-sync", t_start, t_end)          # seconds (time.time())
    trace.counter("staleness gate", {"open": 1}, process="rollout rank 0")
    trace.get().save("out/trace.json")
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
import time
import zlib
from typing import Any, Iterator

DEFAULT_MAX_EVENTS = 100_000


def _id(name: str) -> int:
    return zlib.crc32(name.encode()) % 2_000_000_000 + 1


class Tracer:
    """Collects trace events in memory; :meth:`save` writes them.

    Args:
        process: default process (track group) name of :meth:`span` / :meth:`complete`.
        track: default track (thread) name within it.
        max_events: bound on the events kept (≥ 2; see the module docstring).
    """

    def __init__(self, process: str = "trainer", track: str = "rank 0", max_events: int = DEFAULT_MAX_EVENTS):
        if max_events < 2:
            raise ValueError(f"Tracer: max_events={max_events} must be >= 2")
        self.process, self.track = process, track
        self.max_events = max_events
        self._head: list[dict] = []
        self._tail: collections.deque = collections.deque(maxlen=max_events - max_events // 2)
        self._meta: dict[tuple, dict] = {}
        self._id_cache: dict[tuple[str, str], tuple[int, int]] = {}
        self._lanes: dict[str, list[float]] = {}
        self._lock = threading.Lock()
        self.dropped = 0
        self.last_save = 0.0
        self._saver: threading.Thread | None = None

    # -- recording ---------------------------------------------------------------------------------
    def _ids(self, process: str | None, track: str | None) -> tuple[int, int]:
        key = (process or self.process, track or self.track)
        ids = self._id_cache.get(key)  # a dict read; the first use of a track names it
        if ids is None:
            process, track = key
            pid, tid = ids = _id(process), _id(process + "/" + track)
            with self._lock:
                self._id_cache[key] = ids
                self._meta[(pid, 0)] = {"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                                        "args": {"name": process}}
                self._meta[(pid, tid)] = {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                                          "args": {"name": track}}
        return ids

    def _add(self, ev: dict) -> None:
        with self._lock:
            if len(self._head) < self.max_events // 2:
                self._head.append(ev)
            else:
                if len(self._tail) == self._tail.maxlen:
                    self.dropped += 1
                self._tail.append(ev)

    def complete(self, name: str, start: float, end: float, args: dict | None = None,
                 process: str | None = None, track: str | None = None) -> None:
        """A span ``[start, end]`` (seconds, ``time.time()``) on ``process``/``track``."""
        pid, tid = self._ids(process, track)
        ev = {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": start * 1e6, "dur": max(end - start, 0.0) * 1e6}
        if args:
            ev["args"] = args
        self._add(ev)

    @contextlib.contextmanager
    def span(self, name: str, args: dict | None = None, process: str | None = None,
             track: str | None = None) -> Iterator[None]:
        """Context manager recording a span around its body (also when the body raises)."""
        start = time.time()
        try:
            yield
        finally:
            self.complete(name, start, time.time(), args, process, track)

    def lane_complete(self, process: str, name: str, start: float, end: float, args: dict | None = None) -> None:
        """A span in group ``process`` on the first ``<self.track> slot j`` track free at ``start``
        (spans must be recorded in the order they end, as they are when recorded on completion)."""
        with self._lock:
            lanes = self._lanes.setdefault(process, [])
            j = next((i for i, t in enumerate(lanes) if t <= start), len(lanes))
            if j == len(lanes):
                lanes.append(end)
            lanes[j] = end
        self.complete(name, start, end, args, process, f"{self.track} slot {j}")

    def counter(self, name: str, values: dict[str, float], process: str | None = None, t: float | None = None) -> None:
        """Counter ``name`` (a track of ``process``) takes ``values`` from time ``t`` (now)."""
        pid, _ = self._ids(process, None)
        self._add({"ph": "C", "name": name, "pid": pid, "tid": 0, "ts": (t or time.time()) * 1e6, "args": values})

    def instant(self, name: str, args: dict | None = None, process: str | None = None, track: str | None = None) -> None:
        """A point event on ``process``/``track`` at the current time."""
        pid, tid = self._ids(process, track)
        self._add({"ph": "i", "s": "t", "name": name, "pid": pid, "tid": tid, "ts": time.time() * 1e6, "args": args or {}})

    # -- output --------------------------------------------------------------------------------------
    def events(self) -> list[dict]:
        """Metadata events followed by the kept events, oldest first."""
        with self._lock:
            return list(self._meta.values()) + self._head + list(self._tail)

    def save(self, path: str) -> None:
        """Write ``{"traceEvents": [...], "otherData": {...}}`` to ``path`` atomically (a crash
        mid-write leaves the previous file). Waits for a background flush first, so the newest
        snapshot is the one left."""
        saver = self._saver
        if saver is not None and saver is not threading.current_thread():
            saver.join()
        data = {"traceEvents": self.events(), "displayTimeUnit": "ms",
                "otherData": {"dropped_events": self.dropped, "max_events": self.max_events}}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
        with open(tmp, "w") as f:
            json.dump(data, f, separators=(",", ":"))
        os.replace(tmp, path)
        self.last_save = time.time()

    def maybe_save(self, path: str, every_s: float = 30.0) -> None:
        """Periodic flush: :meth:`save` in a background thread when the last save is more than
        ``every_s`` seconds old and none is running (writing 100k events takes about a second)."""
        if time.time() - self.last_save >= every_s and not (self._saver and self._saver.is_alive()):
            self.last_save = time.time()
            self._saver = threading.Thread(target=self.save, args=(path,), name="arealite-trace-save", daemon=True)
            self._saver.start()


def merge_files(paths: list[str], out: str) -> None:
    """Concatenate the events of trace files ``paths`` (missing or unreadable ones skipped) into
    ``out``; metadata events are deduplicated, ``dropped_events`` summed."""
    events, meta, dropped = [], {}, 0
    for p in paths:
        try:
            with open(p) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        dropped += data.get("otherData", {}).get("dropped_events", 0)
        for ev in data["traceEvents"]:
            if ev.get("ph") == "M":
                meta[(ev["pid"], ev["tid"], ev["name"])] = ev
            else:
                events.append(ev)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": list(meta.values()) + events, "displayTimeUnit": "ms",
                   "otherData": {"dropped_events": dropped}}, f, separators=(",", ":"))
    os.replace(tmp, out)


# -- the process-wide tracer ------------------------------------------------------------------------
_TRACER: Tracer | None = None


def enabled_by_env() -> bool:
    """False when ``AREALITE_TRACE`` is ``0``/``false``/``off`` (tracing is on by default)."""
    return os.environ.get("AREALITE_TRACE", "1").lower() not in ("0", "false", "off", "no")


def install(tracer: Tracer | None) -> Tracer | None:
    """Make ``tracer`` the process-wide tracer (None disables tracing); returns it."""
    global _TRACER
    _TRACER = tracer
    return tracer


def get() -> Tracer | None:
    """The installed tracer, or None."""
    return _TRACER


_NULL = contextlib.nullcontext()


def span(name: str, args: dict | None = None, process: str | None = None, track: str | None = None):
    """:meth:`Tracer.span` on the installed tracer; a no-op context when none is installed."""
    t = _TRACER
    return _NULL if t is None else t.span(name, args, process, track)


def complete(name: str, start: float, end: float, args: dict | None = None, process: str | None = None,
             track: str | None = None) -> None:
    """:meth:`Tracer.complete` on the installed tracer (no-op when none)."""
    if _TRACER is not None:
        _TRACER.complete(name, start, end, args, process, track)


def lane_complete(process: str, name: str, start: float, end: float, args: dict | None = None) -> None:
    """:meth:`Tracer.lane_complete` on the installed tracer (no-op when none)."""
    if _TRACER is not None:
        _TRACER.lane_complete(process, name, start, end, args)


def counter(name: str, values: dict[str, Any], process: str | None = None) -> None:
    """:meth:`Tracer.counter` on the installed tracer (no-op when none)."""
    if _TRACER is not None:
        _TRACER.counter(name, values, process)
