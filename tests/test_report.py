"""The run report (arealite/report.py) from a finished 3-step tiny run's folder (the RL loop
writes it at the end) and from crashed folders (truncated stats.jsonl, missing or cut trace)."""

import base64
import json
import re
import shutil

import pytest

from arealite.report import load_stats, main, write_report
from test_trace import run_tiny_rl


def _images(path):
    """{alt: PNG bytes} of the report's embedded images."""
    text = open(path).read()
    return {alt: base64.b64decode(b) for alt, b in re.findall(r"alt='([^']*)' src='data:image/png;base64,([^']*)'", text)}


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tmp_path_factory):
    return run_tiny_rl(tmp_path_factory.mktemp("report_run"), tiny_model_dir)


def test_finished_run_report_is_written_by_the_loop(finished_run):
    out, proc = finished_run
    assert f"run report: {out / 'report.html'}" in proc.stdout
    imgs = _images(out / "report.html")
    assert sorted(imgs) == ["off-policy", "reward", "staleness", "throughput", "time split", "timeline"]
    assert all(b.startswith(b"\x89PNG\r\n\x1a\n") and len(b) > 5000 for b in imgs.values())
    html = open(out / "report.html").read()
    assert "steps done</th><td>3 / 3" in html and "eval/accuracy_start" in html
    assert "last in-loop evaluation" in html and "did not finish" not in html
    steps = [json.loads(line) for line in open(out / "stats.jsonl") if '"summary"' not in line]
    for s in steps:  # what the off-policy plot shows, every step of a default run
        assert s["actor/mismatch/kl_k3"] >= 0 and 0 < s["actor/behav/ess"] <= 1 + 1e-6
        assert s["actor/behav/masked_frac"] >= 0 and s["rollout/versions_spanned_max"] >= 1
        assert sum(s[f"rollout/staleness_frac_{k}"] for k in ("0", "1", "2", "3", "4plus")) == pytest.approx(1.0)


def test_crashed_run_report_from_partial_logs(finished_run, tmp_path):
    out, _ = finished_run
    crashed = tmp_path / "crashed"
    shutil.copytree(out, crashed, ignore=shutil.ignore_patterns("report.html", "final"))
    lines = open(crashed / "stats.jsonl").read().splitlines(keepends=True)
    with open(crashed / "stats.jsonl", "w") as f:  # step 1 complete, step 2 cut mid-line, no summary
        f.write(lines[0] + lines[1][: len(lines[1]) // 2])
    steps, summary, bad = load_stats(str(crashed))
    assert [s["step"] for s in steps] == [0] and summary is None and bad == 1
    (crashed / "trace.json").unlink()
    path = main([str(crashed)])
    html = open(path).read()
    assert "1 unreadable line" in html and "did not finish" in html and "no trace.json" in html
    assert "steps done</th><td>1 / 3" in html
    assert sorted(_images(path)) == ["off-policy", "reward", "staleness", "throughput", "time split"]
    # a trace cut mid-write (not the atomic flush, e.g. copied from a dying node)
    text = open(out / "trace.json").read()
    (crashed / "trace.json").write_text(text[: len(text) // 2])
    assert "trace.json is unreadable" in open(write_report(str(crashed))).read()


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="output_dir"):
        write_report(str(tmp_path / "nope"))
