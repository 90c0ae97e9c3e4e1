"""Off-policy study: staleness η × behaviour correction / surrogate on the embedded task.

    python benchmarks/offpolicy_study.py                                   # the full grid (hours on 2 cores)
    python benchmarks/offpolicy_study.py --etas 1,4 --methods cap,icepop --steps 6 --json out.json --plot out.png
    python benchmarks/offpolicy_study.py --forced-stale 4 --etas 8        # pushes only every 4th update
    python benchmarks/offpolicy_study.py --replot docs/offpolicy_study.json --plot docs/offpolicy_study.png

Each cell runs ``recipes/grpo_math.py`` (embedded SmolLM2-135M and arithmetic task, or
``--model``/``--train``) for ``--steps`` updates with an in-loop greedy evaluation every
``--eval-every`` steps, and reports: held-out accuracy after the fixed number of steps (the
final evaluation), the accuracy at a fixed wall-clock budget (the last in-loop evaluation of
weights reached within ``--budget-s`` of the run's start), the time to 0.6 accuracy, and the
mean mismatch KL(μ‖π_prox) (k3) and ESS over training.

Methods (``--methods``): ``none`` = plain PPO against μ (bypass: ``use_decoupled_loss false``, no
correction); ``cap`` = today's decoupled PPO with the π_prox/μ cap; ``token_tis``, ``icepop``,
``m2po`` = those corrections with decoupled PPO; ``cispo``, ``sapo`` = those surrogates with the
default correction (CISPO with AReaL's ε_low 1.0 / ε_high 4.0). ``--forced-stale K`` makes the
behaviour policy stale on purpose: the servers get new weights only every K-th update (the
versions still advance, so the staleness gate admits the rollouts while μ lags up to K − 1
updates behind π_prox) — the setting where the corrections matter.

Timing is meaningful only on an otherwise idle machine: run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

METHODS = {
    "none": ["--algo.use_decoupled_loss", "False", "--algo.correction", "none"],
    "cap": [],
    "token_tis": ["--algo.correction", "token_tis"],
    "icepop": ["--algo.correction", "icepop"],
    "m2po": ["--algo.correction", "m2po"],
    "cispo": ["--algo.loss", "cispo", "--algo.eps_clip", "1.0", "--algo.eps_clip_high", "4.0"],
    "sapo": ["--algo.loss", "sapo"],
}

# Run inside the recipe's process when --forced-stale is on: sync_weights pushes only every K-th
# version; in between every rank records the new version without touching the servers.
_DELAYED_PUSH = """
import runpy, sys
import arealite.trainer.rl_loop as loop
K = int(sys.argv.pop(1))
real = loop.sync_weights
def delayed(actor, engine, executor, weight_dir, version):
    if version % K == 0:
        return real(actor, engine, executor, weight_dir, version)
    engine.set_version(version)  # the servers keep older weights: μ lags behind π_prox
loop.sync_weights = delayed
sys.argv[0] = sys.argv[1]; del sys.argv[1]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_cell(eta: int, method: str, args, root: str) -> dict:
    """One training run; figures from its ``stats.jsonl`` (times in seconds from process start)."""
    trial = f"eta{eta}_{method}" + (f"_stale{args.forced_stale}" if args.forced_stale else "")
    recipe = os.path.join(ROOT, "recipes", "grpo_math.py")
    flags = ["--config", os.path.join(ROOT, "recipes", "configs", "grpo_math.yaml"),  # README command 1's run
             "--fileroot", root, "--trial_name", trial, "--total_train_steps", str(args.steps),
             "--rollout.max_head_offpolicyness", str(eta), "--evaluator.freq_steps", str(args.eval_every),
             "--evaluator.at_start", "True", "--evaluator.at_end", "True", "--seed", str(args.seed),
             *(["--actor.path", args.model] if args.model else []),
             *(["--train_dataset.path", args.train] if args.train else []), *METHODS[method], *args.extra]
    cmd = ([sys.executable, "-c", _DELAYED_PUSH, str(args.forced_stale), recipe] if args.forced_stale
           else [sys.executable, recipe]) + flags
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.time() - start
    if proc.returncode != 0:
        return {"eta": eta, "method": method, "error": (proc.stdout[-1500:] + proc.stderr[-3000:])}
    rows = [json.loads(line) for line in open(os.path.join(root, "grpo_math", trial, "stats.jsonl"))]
    steps = [r for r in rows if "summary" not in r]
    summary = next(r["summary"] for r in rows if "summary" in r)
    reached = {0: start}  # weight version → wall time it was reached (end of that update's push)
    for s in steps:
        reached[int(s["step"]) + 1] = s["time/train_end"] + s["time/weight_sync_s"]
    curve = [(0.0, summary.get("eval/accuracy_start", float("nan")))]
    curve += sorted((reached[int(s["eval/version"])] - start, s["eval/accuracy"])
                    for s in steps if "eval/accuracy" in s and int(s["eval/version"]) in reached)
    curve.append((reached[max(reached)] - start, summary.get("eval/accuracy_end", float("nan"))))
    within = [acc for t, acc in curve if t <= args.budget_s]
    first = next((t for t, acc in curve if acc >= args.target), None)
    def mean(key):  # over the steps that logged it (bypass mode has no π_prox: no mismatch figures)
        vals = [s[key] for s in steps if key in s]
        return sum(vals) / len(vals) if vals else None
    return {"eta": eta, "method": method, "forced_stale": args.forced_stale, "wall_s": wall,
            "acc_end": summary.get("eval/accuracy_end"), "acc_budget": within[-1] if within else None,
            "time_to_target_s": first, "mismatch_kl_k3": mean("actor/mismatch/kl_k3"), "ess": mean("actor/behav/ess"),
            "masked_frac": mean("actor/behav/masked_frac"), "staleness_mean": mean("rollout/staleness_mean"),
            "curve": curve}


def _fmt(v, spec=".3f"):
    return "—" if v is None else format(v, spec)


def table(results: list[dict], args) -> str:
    lines = [f"| η | forced stale | method | acc after {args.steps} steps | acc at {args.budget_s:.0f} s | time to {args.target} (s) "
             "| mismatch KL k3 | ESS | masked | wall (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['eta']} | {r.get('forced_stale', 0)} | {r['method']} | failed | | | | | | |")
            continue
        lines.append(f"| {r['eta']} | {r.get('forced_stale', 0)} | {r['method']} | {_fmt(r['acc_end'])} | {_fmt(r['acc_budget'])} | "
                     f"{_fmt(r['time_to_target_s'], '.0f')} | {_fmt(r['mismatch_kl_k3'], '.2e')} | {_fmt(r['ess'])} | "
                     f"{_fmt(r['masked_frac'])} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def _title(eta: int, stale: int) -> str:
    return f"η = {eta}" + (f", weights pushed every {stale} updates" if stale else "")


def plot(results: list[dict], path: str, budget_s: float | None = None, steps: int | None = None) -> None:
    """Per (η, forced stale) setting: accuracy-vs-wall-time curves (results with a ``curve``), then
    bars of the accuracy after the fixed steps and at the budget, and the mismatch KL (k3) and
    ESS per method (every result, also ones saved without curves)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "error" not in r]
    settings = sorted({(r["eta"], r.get("forced_stale", 0)) for r in ok})
    curves = any(r.get("curve") for r in ok)
    cols = 3 if curves else 2
    fig, axes = plt.subplots(len(settings), cols, figsize=(4.6 * cols, 3.3 * len(settings)), squeeze=False)
    for row, (eta, stale) in zip(axes, settings):
        rs = [r for r in ok if (r["eta"], r.get("forced_stale", 0)) == (eta, stale)]
        names = [r["method"] for r in rs]
        x = range(len(rs))
        ax = row[0]
        ax.bar([i - 0.2 for i in x], [r["acc_end"] or 0 for r in rs], 0.4, label=f"after {steps or '?'} steps")
        ax.bar([i + 0.2 for i in x], [r["acc_budget"] or 0 for r in rs], 0.4,
               label=f"at {budget_s:.0f} s" if budget_s else "at the budget")
        ax.set_title(_title(eta, stale) + ": held-out accuracy", fontsize=9)
        ax.set_ylim(0, 1)
        ax.set_xticks(list(x), names, rotation=30, fontsize=8)
        ax.legend(fontsize=7)
        ax = row[1]
        ax.bar([i - 0.2 for i in x], [r["mismatch_kl_k3"] or 0 for r in rs], 0.4, color="tab:red", label="KL(μ‖π_prox), k3")
        ax.set_xticks(list(x), names, rotation=30, fontsize=8)
        ax.set_title(_title(eta, stale) + ": off-policyness", fontsize=9)
        for i, r in enumerate(rs):
            if r["mismatch_kl_k3"] is None:  # bypass: no π_prox, no mismatch figure
                ax.text(i - 0.2, 0, "n/a", ha="center", va="bottom", fontsize=7)
        ax.set_ylabel("mean mismatch KL", color="tab:red")
        twin = ax.twinx()
        twin.bar([i + 0.2 for i in x], [r["ess"] or 0 for r in rs], 0.4, color="tab:green", label="ESS")
        twin.set_ylim(0.9, 1.0)
        twin.set_ylabel("mean ESS", color="tab:green")
        if curves:
            ax = row[2]
            for r in rs:
                if r.get("curve"):
                    ax.plot([t for t, _ in r["curve"]], [a for _, a in r["curve"]], "o-", ms=3, label=r["method"])
            ax.set(title=_title(eta, stale), xlabel="wall time (s)", ylabel="held-out accuracy (greedy)")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--etas", default="0,1,4,16", help="max_head_offpolicyness values, comma-separated")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {list(METHODS)}")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--budget-s", type=float, default=300.0, help="wall-clock budget for 'acc at budget' [s]")
    p.add_argument("--target", type=float, default=0.6, help="accuracy for 'time to target'")
    p.add_argument("--forced-stale", type=int, default=0, help="push weights only every K-th update (0 = off)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model", default="", help="actor.path (default: the embedded SmolLM2-135M)")
    p.add_argument("--train", default="", help="train_dataset.path (default: the embedded task)")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--plot", default="", help="write accuracy-vs-time curves here (PNG)")
    p.add_argument("--keep", default="", help="run folders here (default: a temporary folder)")
    p.add_argument("--replot", default="", help="only redraw --plot (and print the table) from a saved --json file")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="flags passed to every run")
    args = p.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        saved_args = argparse.Namespace(**{**vars(args), **saved["args"]})
        print(table(saved["results"], saved_args))
        if args.plot:
            plot(saved["results"], args.plot, saved_args.budget_s, saved_args.steps)
        return saved["results"]
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if unknown:
        p.error(f"--methods: unknown {unknown}; choose from {list(METHODS)}")
    root = args.keep or tempfile.mkdtemp(prefix="offpolicy_")
    results = []
    for eta in (int(e) for e in args.etas.split(",")):
        for method in args.methods.split(","):
            r = run_cell(eta, method, args, root)
            results.append(r)
            print(f"η={eta} {method}: " + (f"FAILED\n{r['error']}" if "error" in r else
                  f"acc_end {_fmt(r['acc_end'])}, acc@budget {_fmt(r['acc_budget'])}, KL {_fmt(r['mismatch_kl_k3'], '.2e')}, "
                  f"ESS {_fmt(r['ess'])}, {r['wall_s']:.0f} s"), flush=True)
    print(table(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    if args.plot:
        plot(results, args.plot, args.budget_s, args.steps)
    return results


if __name__ == "__main__":
    main()
