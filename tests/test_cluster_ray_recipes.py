"""Every recipe works under the cluster launchers: each gets its config through
``arealite.trainer.entry.load_run_config``, which honours ``$AREALITE_CONFIG_DUMP`` (validates,
writes the YAML, trains nothing, exits 0), and SFT, offline DPO and an agent recipe train through
``python -m arealite.launcher.ray`` on a two-raylet local Ray cluster (tiny random model, 2 steps);
the Slurm job script of a recipe without servers starts no server step."""

import dataclasses
import glob
import json
import math
import os
import runpy
import subprocess
import sys

import pytest
import yaml

from conftest import REPO_ROOT, env_without_dist

RECIPES = sorted(os.path.relpath(p, REPO_ROOT) for p in glob.glob(os.path.join(REPO_ROOT, "recipes", "*.py"))
                 + glob.glob(os.path.join(REPO_ROOT, "recipes", "agents", "*.py")))
NEEDS = {"langgraph_agent.py": "langgraph", "openai_agents_sdk.py": "agents", "openai_agent.py": "openai",
         "multiply_tool.py": "openai"}
NO_SERVERS = {("recipes/sft_math.py", ()), ("recipes/dpo_math.py", ("--mode", "offline")), ("recipes/rm_math.py", ())}
NO_ROLLOUT = {"recipes/sft_math.py", "recipes/rm_math.py"}  # supervised configs: no rollout section at all


def test_every_recipe_is_covered():
    assert len(RECIPES) >= 11 and "recipes/sft_math.py" in RECIPES and "recipes/agents/multiply_tool.py" in RECIPES


def _dump(monkeypatch, tmp_path, recipe, args):
    """Run ``recipe`` in this process as ``__main__`` with ``$AREALITE_CONFIG_DUMP`` set; returns
    (exit code, dumped dict)."""
    import arealite.train_engine.fsdp
    import arealite.trainer.offline_loop
    import arealite.trainer.rl_loop

    def trains(*args, **kwargs):
        raise AssertionError(f"{recipe} started training instead of dumping its config")

    for module, name in ((arealite.trainer.rl_loop, "run_rl"), (arealite.trainer.rl_loop, "setup_rl"),
                         (arealite.trainer.offline_loop, "run_offline"), (arealite.trainer.offline_loop, "prepare_offline"),
                         (arealite.train_engine.fsdp, "init_distributed")):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, trains)  # a recipe that skipped the door fails here, fast
    path = tmp_path / "dump.yaml"
    monkeypatch.setenv("AREALITE_CONFIG_DUMP", str(path))
    monkeypatch.setattr(sys, "argv", [os.path.join(REPO_ROOT, recipe), *args])
    try:  # load_run_config ends the process with SystemExit(0)
        runpy.run_path(os.path.join(REPO_ROOT, recipe), run_name="__main__")
        code = 0  # a recipe whose main returns after the dump also exits with status 0
    except SystemExit as e:
        code = e.code
    return code, (yaml.safe_load(open(path)) if path.exists() else None)


@pytest.mark.parametrize("recipe,extra", [(r, ()) for r in RECIPES] + [("recipes/dpo_math.py", ("--mode", "offline"))])
def test_recipe_honours_the_config_dump(monkeypatch, tmp_path, tiny_model_dir, recipe, extra):
    """The dump: validated for launcher.trainer_ranks=2, written as YAML, exit 0, nothing under fileroot."""
    from arealite.launcher.cluster import recipe_servers

    if os.path.basename(recipe) in NEEDS:
        pytest.importorskip(NEEDS[os.path.basename(recipe)])
    fileroot = tmp_path / "runs"
    args = ["--actor.path", tiny_model_dir, "--fileroot", str(fileroot), "--launcher.trainer_ranks", "2",
            "--trial_name", "dumped", *extra]
    code, dumped = _dump(monkeypatch, tmp_path, recipe, args)
    assert code == 0 and dumped is not None
    assert dumped["launcher"]["trainer_ranks"] == 2 and dumped["trial_name"] == "dumped"
    assert dumped["output_dir"] == str(fileroot / dumped["experiment_name"] / "dumped")
    assert dumped["model_path"] == os.path.abspath(tiny_model_dir)
    assert recipe_servers(dumped) == (0 if (recipe, tuple(extra)) in NO_SERVERS else 1)  # the launcher's reading
    assert ("rollout" in dumped) is (recipe not in NO_ROLLOUT)
    assert not fileroot.exists()  # trained nothing, wrote nothing


def test_config_dump_validates_for_the_launcher_ranks(monkeypatch, tmp_path, tiny_model_dir):
    """A global batch that 3 ranks cannot split is rejected in dump mode (1 rank would accept it)."""
    from arealite.api.cli import ConfigError

    args = ["--actor.path", tiny_model_dir, "--fileroot", str(tmp_path), "--train_dataset.batch_size", "4",
            "--launcher.trainer_ranks", "3"]
    monkeypatch.setenv("AREALITE_CONFIG_DUMP", str(tmp_path / "dump.yaml"))
    monkeypatch.setattr(sys, "argv", ["sft_math.py", *args])
    with pytest.raises(ConfigError, match="train_dataset.batch_size.*3 trainer ranks"):
        runpy.run_path(os.path.join(REPO_ROOT, "recipes", "sft_math.py"), run_name="__main__")
    assert not (tmp_path / "dump.yaml").exists()


def test_load_run_config_without_dump_returns_the_config_and_needs_a_launcher_section(monkeypatch, tmp_path,
                                                                                      tiny_model_dir):
    from arealite.api.cli import ConfigError
    from arealite.api.config import SFTConfig, TrainEngineConfig
    from arealite.trainer.entry import dump_run_config, load_run_config

    monkeypatch.delenv("AREALITE_CONFIG_DUMP", raising=False)
    config = load_run_config(SFTConfig, ["--total_train_steps", "3"], uses_servers=False)
    assert isinstance(config, SFTConfig) and config.total_train_steps == 3

    @dataclasses.dataclass
    class NoLauncher:
        actor: TrainEngineConfig = dataclasses.field(default_factory=TrainEngineConfig)

    with pytest.raises(ConfigError, match="launcher: NoLauncher has no launcher section"):
        dump_run_config(NoLauncher(), str(tmp_path / "d.yaml"))
    with pytest.raises(ConfigError, match="rollout: SFTConfig has no rollout section"):
        dump_run_config(SFTConfig(), str(tmp_path / "d.yaml"), uses_servers=True)
    assert not (tmp_path / "d.yaml").exists()


def test_slurm_job_script_of_a_recipe_without_servers_starts_only_the_trainers(tmp_path):
    from arealite.api.cli import to_dict
    from arealite.api.config import InferenceEngineConfig, LauncherConfig, SFTConfig
    from arealite.launcher.cluster import Node, plan_placement, recipe_servers, without_servers
    from arealite.launcher.slurm import job_script, layout

    config = {**to_dict(SFTConfig()), "output_dir": str(tmp_path), "model_path": "/m", "uses_servers": False}
    config["launcher"]["trainer_ranks"] = 2
    launcher, rollout = LauncherConfig(trainer_ranks=2), InferenceEngineConfig()
    nodes = [Node("n1", 4.0)]
    placement = without_servers(launcher, rollout, plan_placement(launcher, rollout, nodes))
    assert recipe_servers(config) == 0 and placement.server_nodes == [] and placement.trainer_nodes == [0]
    plan = layout(placement, launcher, rollout)
    assert plan["cpus_per_node"] == 2  # the trainer ranks only: no server CPU
    script = job_script("recipes/sft_math.py", ["--total_train_steps", "2"], config, plan, str(tmp_path / "plan.json"))
    assert "--rollout.addresses" not in script and "slurm wait" not in script and "start_servers\n" not in script
    assert "--nproc_per_node=2" in script and "no inference servers" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # valid bash
    grpo = {**config, "uses_servers": True, "rollout": to_dict(rollout)}
    assert recipe_servers(grpo) == 1
    assert "--rollout.addresses $ADDRS" in job_script("recipes/grpo_math.py", [], grpo, layout(
        plan_placement(launcher, rollout, nodes), launcher, rollout), str(tmp_path / "plan.json"))


# ------------------------------------------------------------------------------------------------
# Through the Ray launcher on a two-raylet local cluster
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    worker = c.add_node(num_cpus=2)
    c.wait_for_nodes()
    yield c, c.head_node.node_id, worker.node_id
    c.shutdown()


def _ray(cluster_address, recipe, args, cwd, timeout=300):
    cmd = [sys.executable, "-m", "arealite.launcher.ray", os.path.join(REPO_ROOT, recipe), *args,
           "--launcher.ray_address", cluster_address]
    env = env_without_dist(PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout


def _stats(out):
    rows = [json.loads(line) for line in open(out / "stats.jsonl")]
    return [r for r in rows if "summary" not in r], [r["summary"] for r in rows if "summary" in r][-1]


def _check_offline_run(out, log, worker):
    """A recipe without servers: 2 steps by 2 ranks on the worker, no server started, final/ saved."""
    placement = json.load(open(out / "logs" / "placement.json"))
    assert placement["servers"] == [] and [t["node_id"] for t in placement["trainers"]] == [worker, worker]
    assert "the recipe uses no inference servers" in log and "[server0]" not in log
    assert not (out / "logs" / "server0.log").exists() and (out / "logs" / "trainer1.log").stat().st_size > 0
    assert os.path.exists(out / "final" / "config.json") and os.path.exists(out / "final" / "model.safetensors")
    steps, summary = _stats(out)
    assert [s["step"] for s in steps] == [0, 1]
    return steps, summary


OFFLINE = ["--total_train_steps", "2", "--train_dataset.batch_size", "4", "--launcher.trainer_ranks", "2",
           "--launcher.n_nodes", "2"]


def test_sft_through_the_ray_launcher(cluster, tiny_model_dir, tmp_path):
    c, _, worker = cluster
    rc, log = _ray(c.address, "recipes/sft_math.py", [
        "--actor.path", tiny_model_dir, "--fileroot", str(tmp_path), "--valid_dataset.size", "4",
        "--valid_dataset.batch_size", "2", "--evaluator.freq_steps", "0", "--actor.optimizer.lr", "1e-3", *OFFLINE],
        str(tmp_path))
    assert rc == 0, log[-6000:]
    steps, summary = _check_offline_run(tmp_path / "sft_math" / "trial0", log, worker)
    assert all(s["actor/n_tokens"] > 0 for s in steps)
    # random model over a ~49k vocabulary: NLL near ln(49152) = 10.8; lr 1e-3 lowers it in 2 steps
    assert 9.0 < summary["eval/loss_start"] < 12.0 and summary["eval/loss_end"] < summary["eval/loss_start"]


def test_offline_dpo_through_the_ray_launcher(cluster, tiny_model_dir, tmp_path):
    c, _, worker = cluster
    rc, log = _ray(c.address, "recipes/dpo_math.py", [
        "--mode", "offline", "--actor.path", tiny_model_dir, "--fileroot", str(tmp_path), "--valid_dataset.size", "2",
        "--evaluator.at_start", "False", "--evaluator.at_end", "False", *OFFLINE], str(tmp_path))
    assert rc == 0, log[-6000:]
    steps, _ = _check_offline_run(tmp_path / "dpo_math" / "trial0", log, worker)
    # step 0: policy = reference, so every pair's Δ = 0: loss ln 2 over 4 pairs (2 per rank, summed)
    assert steps[0]["actor/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert all(s["actor/n_pairs"] == 4 for s in steps) and steps[1]["actor/grad_norm"] > 0


def test_agent_recipe_through_the_ray_launcher(cluster, tiny_model_dir, tmp_path):
    """recipes/agents/multiply_tool.py (an openai-package agent behind the proxy; it used to call
    run_rl directly): 2 GRPO steps, its server on the head, its trainer rank on the worker."""
    pytest.importorskip("openai")
    c, head, worker = cluster
    rc, log = _ray(c.address, "recipes/agents/multiply_tool.py", [
        "--config", os.path.join(REPO_ROOT, "recipes", "configs", "multiply_tool.yaml"),
        "--actor.path", tiny_model_dir, "--fileroot", str(tmp_path), "--total_train_steps", "2",
        "--gconfig.n_samples", "2", "--gconfig.max_new_tokens", "8", "--rollout.consumer_batch_size", "2",
        "--train_dataset.batch_size", "2", "--valid_dataset.size", "2", "--evaluator.at_start", "False",
        "--evaluator.at_end", "False", "--launcher.trainer_ranks", "1", "--launcher.n_nodes", "2"], str(tmp_path))
    assert rc == 0, log[-6000:]
    out = tmp_path / "multiply_tool" / "trial0"
    placement = json.load(open(out / "logs" / "placement.json"))
    assert [s["node_id"] for s in placement["servers"]] == [head]
    assert [t["node_id"] for t in placement["trainers"]] == [worker]
    steps, _ = _stats(out)
    assert [s["step"] for s in steps] == [0, 1]
    for s in steps:  # 2 prompts × 2 sessions trained per step, every session finished
        assert s["rollout/n_samples"] == 4 and s["rollout/staleness_max"] <= 1
        assert s["workflow/failed"] == 0 and s["workflow/timed_out"] == 0 and s["workflow/episodes"] >= 4 * (s["step"] + 1)
    assert "[server0]" in log and "[trainer0] step 2/2" in log
    assert os.path.exists(out / "final" / "config.json")


def test_bad_recipe_value_through_the_ray_launcher_is_one_error_naming_the_field(cluster, tiny_model_dir, tmp_path):
    """The recipe rejects its config while the launcher reads it (2 ranks cannot split a batch of 3):
    exit 2 with the field and the fix, no traceback, nothing started or written."""
    c, _, _ = cluster
    rc, log = _ray(c.address, "recipes/sft_math.py", ["--actor.path", tiny_model_dir, "--fileroot", str(tmp_path),
                                                      "--train_dataset.batch_size", "3", "--launcher.trainer_ranks", "2"],
                   str(tmp_path), timeout=120)
    assert rc == 2, log[-3000:]
    assert "arealite.launcher.ray: error: train_dataset.batch_size: 3 is not divisible by the 2 trainer ranks" in log
    assert "Traceback" not in log and not (tmp_path / "sft_math").exists()
