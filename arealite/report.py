"""One-page HTML report of an RL run folder: ``python -m arealite.report <output_dir>``.

Writes ``<output_dir>/report.html``, self-contained (the PNG plots, made with matplotlib, are
embedded as base64), from what the run left behind:

* ``stats.jsonl`` (one line per step, then a ``summary`` line): reward, held-out accuracy
  (start/end and the in-loop ``eval/*`` results at the step they finished, with the version
  they evaluated), staleness, overlap, tokens/s, and the time split of each step;
* ``trace.json`` (:mod:`arealite.utils.trace`): a picture of the timeline of the last few
  steps (trainer spans, each server's request lanes, interrupted segments, the staleness gate);
* ``config.yaml``: a few key settings.

A crashed run's folder works: a truncated last line of ``stats.jsonl`` is skipped, a missing or
unreadable ``trace.json`` or summary is noted in the report instead of a plot.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import os
import re
from typing import Any

TIMELINE_STEPS = 3  # steps drawn in the timeline picture (the last ones in the trace)
MAX_LANES = 12  # request lanes drawn per server and rank (more are folded into the last row)
_LANE = re.compile(r"(.*)slot (\d+)$")


def load_stats(out_dir: str) -> tuple[list[dict], dict | None, int]:
    """(step records, the summary or None, number of unreadable lines) of ``stats.jsonl``.
    A resumed run's repeated steps keep the last record of each step."""
    steps: dict[int, dict] = {}
    summary, bad = None, 0
    path = os.path.join(out_dir, "stats.jsonl")
    if not os.path.exists(path):
        return [], None, 0
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if "summary" in rec:
                summary = rec["summary"]
            elif "step" in rec:
                steps[rec["step"]] = rec
    return [steps[k] for k in sorted(steps)], summary, bad


def load_trace(out_dir: str) -> tuple[list[dict] | None, str]:
    """(events, "") of ``trace.json``, or (None, why not)."""
    path = os.path.join(out_dir, "trace.json")
    try:
        with open(path) as f:
            return json.load(f)["traceEvents"], ""
    except FileNotFoundError:
        return None, "no trace.json (the run stopped before its first flush, or AREALITE_TRACE=0)"
    except (ValueError, KeyError) as e:
        return None, f"trace.json is unreadable ({e})"


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _series(steps: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(s["step"] + 1, s[key]) for s in steps if isinstance(s.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_metrics(steps: list[dict], summary: dict | None) -> dict[str, str]:
    """The per-step plots: {title: base64 PNG}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs: dict[str, str] = {}
    last = steps[-1]["step"] + 1 if steps else 1

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(*_series(steps, "rollout/reward"), "o-", label="batch reward")
    evals = sorted({k for s in steps for k in s if k.startswith("eval/") and k not in ("eval/version", "eval/time_s")})
    for k in evals:  # at the version evaluated (= steps trained), not the step it was logged at
        pts = [(s["eval/version"], s[k]) for s in steps if k in s and "eval/version" in s]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "s--", label=f"held-out {k[5:]} (in-loop)")
    for k, v in (summary or {}).items():
        if k.startswith("eval/") and k.endswith(("_start", "_end")):
            ax.plot([0 if k.endswith("_start") else last], [v], "D", ms=8, label=f"held-out {k[5:]}")
    ax.set(xlabel="step (held-out: weight version = steps trained)", ylabel="reward / accuracy",
           title="Reward and held-out accuracy")
    ax.legend(fontsize=7)
    figs["reward"] = _png(fig)

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(*_series(steps, "rollout/staleness_max"), "o-", label="max staleness (versions)")
    ax.plot(*_series(steps, "rollout/staleness_mean"), "o-", label="mean staleness")
    ax.plot(*_series(steps, "rollout/overlap_frac"), "s-", label="overlap (share of batch)")
    ax.set(xlabel="step", title="Staleness and rollout/train overlap")
    ax.legend(fontsize=7)
    figs["staleness"] = _png(fig)

    if any("actor/mismatch/kl_k3" in s for s in steps):
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot(*_series(steps, "actor/mismatch/kl_k3"), "o-", label="mismatch KL(μ‖π_prox), k3")
        ax.set(xlabel="step", ylabel="KL (nats / token)", title="Off-policy: behaviour mismatch and ESS")
        ax2 = ax.twinx()
        ax2.plot(*_series(steps, "actor/behav/ess"), "s--", color="#c44e52", label="ESS (Σw)²/(NΣw²)")
        ax2.plot(*_series(steps, "actor/behav/masked_frac"), "^:", color="#8172b3", label="masked fraction")
        ax2.set(ylabel="ESS / fraction", ylim=(0, 1.05))
        lines = ax.get_legend_handles_labels(), ax2.get_legend_handles_labels()
        ax.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], fontsize=7)
        figs["off-policy"] = _png(fig)

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(*_series(steps, "perf/trained_tokens_per_s"), "o-")
    ax.set(xlabel="step", ylabel="tokens/s", title="Trained tokens per second (per step wall time)")
    figs["throughput"] = _png(fig)

    fig, ax = plt.subplots(figsize=(6, 3.2))
    bottom = [0.0] * len(steps)
    for key, label in (("time/gen_wait_s", "rollout wait"), ("time/train_s", "train"), ("time/weight_sync_s", "weight sync")):
        vals = [float(s.get(key, 0.0)) for s in steps]
        ax.bar([s["step"] + 1 for s in steps], vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set(xlabel="step", ylabel="seconds", title="Time split per step")
    ax.legend(fontsize=7)
    figs["time split"] = _png(fig)
    return figs


def plot_timeline(events: list[dict], n_steps: int = TIMELINE_STEPS) -> str | None:
    """A picture of the last ``n_steps`` steps of the trace (base64 PNG), or None when it has no
    trainer step spans."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    step_spans = sorted((e for e in spans if e["name"] == "rollout-wait"), key=lambda e: e["ts"])
    if not step_spans:
        return None
    t0 = step_spans[-n_steps:][0]["ts"]
    t1 = max(e["ts"] + e["dur"] for e in spans if e["name"] == "weight-sync" and e["ts"] >= t0) if any(
        e["name"] == "weight-sync" and e["ts"] >= t0 for e in spans) else max(e["ts"] + e["dur"] for e in spans)
    rows: dict[str, list[tuple[float, float, str]]] = {}
    for e in spans:
        if e["ts"] + e["dur"] < t0 or e["ts"] > t1:
            continue
        proc, track = procs.get(e["pid"], "?"), tracks.get((e["pid"], e["tid"]), "?")
        lane = _LANE.match(track)
        if lane:
            track = f"{lane.group(1)}slot {min(int(lane.group(2)), MAX_LANES - 1)}"
        rows.setdefault(f"{proc} / {track}", []).append(((e["ts"] - t0) / 1e6, e["dur"] / 1e6, e["name"]))
    gates = sorted((e for e in events if e.get("ph") == "C" and e.get("name") == "staleness gate"), key=lambda e: e["ts"])
    colors = {"rollout-wait": "#bbbbbb", "train": "#4c72b0", "weight-sync": "#dd8452", "forward": "#55a868",
              "backward": "#c44e52", "optimizer": "#8172b3", "forward (no grad)": "#937860",
              "generate": "#64b5cd", "interrupted": "#e377c2"}
    def order(row):
        lane = _LANE.match(row)
        return (not row.startswith("trainer"), lane.group(1) if lane else row, int(lane.group(2)) if lane else -1)

    names = sorted(rows, key=order)
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.32 * (len(names) + 1)))
    for y, name in enumerate(names):
        for start, dur, label in rows[name]:
            nested = label in ("forward", "backward", "optimizer", "forward (no grad)")
            ax.broken_barh([(start, dur)], (y - (0.2 if nested else 0.4), 0.4 if nested else 0.8),
                           color=colors.get(label, "#999999"), zorder=3 if nested else 2)
    if gates:
        y = len(names)
        xs = [(g["ts"] - t0) / 1e6 for g in gates]
        ax.step(xs, [y + 0.4 - 0.8 * g["args"].get("open", 0) for g in gates], where="post", color="k")  # y inverted
        names.append("staleness gate (up = open)")
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_xlim(0, (t1 - t0) / 1e6)
    ax.invert_yaxis()
    ax.set(xlabel="seconds", title=f"Timeline of the last {min(n_steps, len(step_spans))} steps")
    from matplotlib.patches import Patch

    used = sorted({label for r in rows.values() for _, _, label in r}, key=list(colors).index)
    ax.legend(handles=[Patch(color=colors[k], label=k) for k in used if k in colors], fontsize=7,
              ncol=len(used), loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / len(names)))
    return _png(fig)


def _table(rows: list[tuple[str, Any]]) -> str:
    cells = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_fmt(v))}</td></tr>" for k, v in rows)
    return f"<table>{cells}</table>"


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def write_report(out_dir: str, path: str | None = None) -> str:
    """Write the report of run folder ``out_dir`` to ``path`` (default ``out_dir/report.html``);
    returns the path.

    Raises:
        FileNotFoundError: ``out_dir`` is not a folder.
    """
    if not os.path.isdir(out_dir):
        raise FileNotFoundError(f"run folder {out_dir!r} not found; pass a run's output_dir "
                                "(fileroot/experiment_name/trial_name)")
    path = path or os.path.join(out_dir, "report.html")
    steps, summary, bad = load_stats(out_dir)
    events, why = load_trace(out_dir)
    notes = []
    if not steps:
        notes.append("stats.jsonl has no completed step")
    if bad:
        notes.append(f"{bad} unreadable line(s) in stats.jsonl skipped (a crash mid-write)")
    if summary is None:
        notes.append("no summary line: the run did not finish (crashed or still running)")
    if why:
        notes.append(why)
    config = {}
    try:
        import yaml

        with open(os.path.join(out_dir, "config.yaml")) as f:
            config = yaml.safe_load(f) or {}
    except (OSError, ValueError, ImportError):
        notes.append("config.yaml missing or unreadable")
    figs: dict[str, str] = {}
    if steps:
        figs.update(plot_metrics(steps, summary))
    if events:
        tl = plot_timeline(events)
        if tl:
            figs["timeline"] = tl
        else:
            notes.append("trace.json has no step spans yet")
    roll, actor = config.get("rollout", {}), config.get("actor", {})
    key = [("run folder", os.path.abspath(out_dir)), ("model", actor.get("path") or "embedded default"),
           ("steps done", f"{len(steps)} / {config.get('total_train_steps', '?')}"),
           ("max_head_offpolicyness (η)", roll.get("max_head_offpolicyness", "?")),
           ("consumer_batch_size", roll.get("consumer_batch_size", "?"))]
    if steps:
        key.append(("mean step time (s)", sum(s.get("time/gen_wait_s", 0) + s.get("time/train_s", 0)
                                                + s.get("time/weight_sync_s", 0) for s in steps) / len(steps)))
    last_eval = [s for s in steps if "eval/version" in s]
    if last_eval:
        e = last_eval[-1]
        key.append(("last in-loop evaluation", ", ".join(f"{k[5:]} {v:.3f}" for k, v in e.items()
                                                          if k.startswith("eval/") and k not in ("eval/version", "eval/time_s"))
                    + f" (version {e['eval/version']:.0f}, logged at step {e['step'] + 1})"))
    body = [f"<h1>Run report: {html.escape(str(config.get('experiment_name', '')))} / "
            f"{html.escape(str(config.get('trial_name', '')))}</h1>", _table(key)]
    if notes:
        body.append("<ul class='notes'>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>")
    if summary:
        body.append("<h2>Summary</h2>" + _table(sorted(summary.items())))
    for title, b64 in figs.items():
        body.append(f"<h2>{html.escape(title.capitalize())}</h2><img alt='{html.escape(title)}' "
                    f"src='data:image/png;base64,{b64}'>")
    style = ("body{font-family:sans-serif;max-width:1100px;margin:1em auto}table{border-collapse:collapse}"
             "th,td{border:1px solid #ccc;padding:2px 8px;text-align:left;font-size:13px}"
             ".notes{color:#a00}img{max-width:100%}")
    with open(path, "w") as f:
        f.write(f"<!doctype html><html><head><meta charset='utf-8'><title>arealite run report</title>"
                f"<style>{style}</style></head><body>{''.join(body)}</body></html>")
    return path


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output_dir", help="a run's output folder (fileroot/experiment_name/trial_name)")
    p.add_argument("--output", default=None, help="report path (default: OUTPUT_DIR/report.html)")
    args = p.parse_args(argv)
    path = write_report(args.output_dir, args.output)
    print(f"report: {path}")
    return path


if __name__ == "__main__":
    main()
