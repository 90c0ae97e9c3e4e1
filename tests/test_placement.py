"""Placement of servers and trainer ranks on hand-made clusters, reading the launcher/rollout
sections from flags, the Slurm layout, and the job script (no cluster needed)."""

import pytest

from arealite.api.cli import ConfigError
from arealite.api.config import InferenceEngineConfig, LauncherConfig
from arealite.launcher.cluster import Node, exit_reason, plan_placement, preparse


def nodes(*spec):
    return [Node(f"n{i}", cpus, gpus) for i, (cpus, gpus) in enumerate(spec)]


def test_trainers_go_to_the_node_with_room_and_servers_to_the_others():
    launcher = LauncherConfig(n_nodes=2, trainer_ranks=2)
    p = plan_placement(launcher, InferenceEngineConfig(n_servers=1), nodes((1, 0), (2, 0)))
    assert p.trainer_nodes == [1] and p.ranks_per_node == 2 and p.server_nodes == [0] and not p.colocated


def test_gpu_cluster_two_trainer_nodes_and_servers_on_a_third():
    launcher = LauncherConfig(n_nodes=3, trainer_nodes=2, trainer_ranks=16, trainer_gpus=1, trainer_cpus=4,
                              server_gpus=2)
    rollout = InferenceEngineConfig(n_servers=4, tp_size=2, backend="vllm", server_threads=8)
    p = plan_placement(launcher, rollout, nodes((64, 8), (64, 8), (64, 8)))
    assert p.ranks_per_node == 8 and len(set(p.trainer_nodes)) == 2
    (server_node,) = set(p.server_nodes)  # 4 × 2 GPUs fill the third node
    assert server_node not in p.trainer_nodes and p.server_nodes == [server_node] * 4


def test_colocated_servers_share_the_trainer_node():
    p = plan_placement(LauncherConfig(), InferenceEngineConfig(n_servers=1), nodes((2, 0)))
    assert p.colocated and p.trainer_nodes == [0] and p.server_nodes == [0]


@pytest.mark.parametrize("launcher,rollout,field,words", [
    (LauncherConfig(trainer_gpus=1), InferenceEngineConfig(), "launcher.trainer_gpus", "= 1 GPUs, but the cluster has 2 nodes"),
    (LauncherConfig(server_gpus=1), InferenceEngineConfig(), "launcher.server_gpus", "0 GPUs"),
    (LauncherConfig(n_nodes=3), InferenceEngineConfig(), "launcher.n_nodes", "3 nodes requested"),
    (LauncherConfig(trainer_cpus=4), InferenceEngineConfig(), "launcher.trainer_cpus", "= 5 CPUs"),
    (LauncherConfig(n_nodes=2), InferenceEngineConfig(n_servers=2), "rollout.n_servers", "server 1 of 2"),
    (LauncherConfig(), InferenceEngineConfig(addresses=["a:1"]), "rollout.addresses", "starts its own servers"),
])
def test_impossible_requests_name_the_field_and_what_the_cluster_has(launcher, rollout, field, words):
    with pytest.raises(ConfigError) as e:
        plan_placement(launcher, rollout, nodes((1, 0), (2, 0)))
    assert str(e.value).startswith(field) and words in str(e.value)
    assert "n0 (1 CPUs, 0 GPUs), n1 (2 CPUs, 0 GPUs)" in str(e.value) or field == "rollout.addresses"


def test_no_single_node_holds_the_trainer_ranks():
    with pytest.raises(ConfigError, match=r"^launcher.trainer_nodes: 1 nodes with 3 trainer ranks .* only 0 such nodes"):
        plan_placement(LauncherConfig(trainer_ranks=3), InferenceEngineConfig(), nodes((2, 0), (2, 0)))


def test_preparse_reads_yaml_then_flags(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("launcher:\n  n_nodes: 2\n  trainer_ranks: 4\nrollout:\n  n_servers: 3\nactor:\n  path: x\n")
    launcher, rollout = preparse(["--config", str(cfg), "--launcher.trainer_ranks=2", "--rollout.setup_timeout",
                                  "1e2", "--actor.optimizer.lr", "1e-5", "--launcher.slurm_args", "-Arl", "-qhigh"])
    assert (launcher.n_nodes, launcher.trainer_ranks, rollout.n_servers, rollout.setup_timeout) == (2, 2, 3, 100.0)
    assert launcher.slurm_args == ["-Arl", "-qhigh"]
    with pytest.raises(ConfigError, match="rollout.n_servers: must be >= 1"):
        preparse(["--rollout.n_servers", "0"])
    with pytest.raises(ConfigError, match="launcher.trainer_ranks: 3 ranks do not split evenly"):
        preparse(["--launcher.trainer_ranks", "3", "--launcher.trainer_nodes", "2", "--launcher.n_nodes", "2"])
    with pytest.raises(ConfigError, match="launcher.bogus: unknown config key"):
        preparse(["--launcher.bogus", "1"])


def test_slurm_layout_puts_trainer_nodes_first_and_sizes_the_request():
    from arealite.launcher.slurm import layout

    launcher = LauncherConfig(n_nodes=2, trainer_ranks=4, trainer_cpus=2)
    rollout = InferenceEngineConfig(n_servers=2, server_threads=4)
    p = plan_placement(launcher, rollout, nodes((16, 0), (8, 0)))
    plan = layout(p, launcher, rollout)
    assert plan["trainer_nodes"] == [0] and plan["server_nodes"] == [1, 1]
    assert plan["cpus_per_node"] == 8 and plan["gpus_per_node"] == 0 and plan["n_nodes"] == 2


def test_exit_reasons():
    assert exit_reason(-9) == "killed by SIGKILL" and exit_reason(1) == "exit code 1"
    assert exit_reason(137) == "exit code 137 (signal SIGKILL)"
