"""Run a recipe on a Ray cluster: ``python -m arealite.launcher.ray RECIPE [recipe flags]``.

    ray start --head --num-cpus 8                      # node 1 (or no cluster: a local one starts)
    ray start --address HEAD_IP:6379 --num-gpus 8      # every other node
    python -m arealite.launcher.ray recipes/grpo_math.py --config my.yaml \\
        --launcher.trainer_ranks 8 --launcher.trainer_gpus 1 --launcher.n_nodes 2 \\
        --rollout.n_servers 4 --rollout.backend vllm --launcher.server_gpus 2 --rollout.tp_size 2

The recipe file is unchanged: this launcher plays ``torchrun`` and the local server launcher.

1. Placement (:func:`arealite.launcher.cluster.plan_placement`): the request is checked against
   the alive nodes' CPUs and GPUs before anything starts (a clear error naming the field), then
   reserved as one Ray placement group — a bundle per trainer node (its ranks' CPUs and GPUs)
   and one per server, each pinned to its planned node (``bundle_label_selector`` on
   ``ray.io/node-id``). A group not placed within ``launcher.placement_timeout`` is an error that
   says what the cluster has, never a silent pending state.
2. Servers (none for a recipe that uses none: SFT, offline DPO): one :class:`ServerActor` per
   server runs the server process (ours, vLLM or SGLang) on its node's address and writes
   ``host:port`` to ``<output_dir>/servers/server{i}.addr``. If the process dies the actor exits
   and Ray restarts it (``rollout.max_server_restarts`` times) in the same bundle, on the same
   port; trainer rank 0 sees the server come back, loads it with
   the current weights and version, and readmits it (:class:`~arealite.launcher.local.ServerWatcher`).
3. Trainers: one :class:`TrainerActor` per rank runs ``python RECIPE ... --rollout.addresses ...``
   with the ``torch.distributed`` environment (``MASTER_ADDR`` = rank 0's node, gloo on CPU,
   NCCL on GPU; Ray sets each rank's ``CUDA_VISIBLE_DEVICES``).
4. Logs: every process's output goes to ``<output_dir>/logs/{server,trainer}{i}.log`` and,
   prefixed, to this driver's console. The placement is written to ``logs/placement.json``.
5. End: on success, on Ctrl-C and on any trainer's death every actor is killed (their
   processes die with them: ``PR_SET_PDEATHSIG``). A trainer rank that dies fails the run with
   its rank, node and exit reason (every failed rank is named, the first to die first:
   :func:`_wait_trainers`); with ``--recover.mode auto`` and ``launcher.max_restarts N``
   the whole job (servers included, so that their weights match the checkpoint) is started again
   up to N times and resumes from the newest recover checkpoint.

The output folder must be on storage every node sees (disk weight sync and recover
checkpoints); ``arealite`` must be importable on every node (same venv path, or a shared one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from arealite.api.from_yaml import from_dict
from arealite.api.config import InferenceEngineConfig, LauncherConfig
from arealite.utils.proc import die_with_parent, free_port
from arealite.launcher.cluster import (Node, Placement, actor_lora_rank, address_file, describe, exit_reason,
                                       plan_placement, preparse, previous_port, read_recipe_config,
                                       recipe_servers, run_main, server_argv, stream, this_machine, trainer_argv,
                                       trainer_env, wait_addresses, without_servers, write_address)

_NOT_FOR_SERVERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_FORWARDED = ("AREALITE_", "VLLM_", "SGLANG_", "HF_", "NCCL_", "GLOO_", "TORCH_", "PYTHONPATH")


def forwarded_env() -> dict:
    """The driver's variables that the job's processes need on every node (``AREALITE_VLLM_PYTHON``,
    ``VLLM_*``, ``HF_*``, ``NCCL_*``, ``PYTHONPATH``, ...): Ray workers otherwise inherit the
    environment of ``ray start``, not the driver's."""
    return {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED)}


class ServerActor:
    """One inference server process on this actor's node (see the module docstring, 2.).

    Args:
        index: server number (its log and address file names).
        rollout: the ``rollout`` config as a dict.
        model_path: the model folder the server starts from (version 0).
        seed: its sampling seed.
        output_dir: the run folder (shared storage).
        cwd: working directory of the process.
    """

    def __init__(self, index: int, rollout: dict, model_path: str, seed: int, output_dir: str, cwd: str,
                 lora_rank: int = 0):
        import threading

        config = from_dict(InferenceEngineConfig, rollout, "rollout")
        host = ray.util.get_node_ip_address()
        path = address_file(output_dir, index)
        port = previous_port(path, host) or free_port(host)  # a restarted actor keeps its address
        cmd, extra = server_argv(config, model_path, host, port, seed, lora_rank)
        env = {k: v for k, v in os.environ.items() if k not in _NOT_FOR_SERVERS}
        os.makedirs(os.path.join(output_dir, "logs"), exist_ok=True)
        self.log = open(os.path.join(output_dir, "logs", f"server{index}.log"), "a")
        self.log.write(f"[arealite] server {index} starting on {host}:{port}: {' '.join(cmd)}\n")
        self.log.flush()
        self.proc = subprocess.Popen(cmd, env={**env, **extra}, cwd=cwd, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, preexec_fn=die_with_parent)
        stream(self.proc, f"server{index}", self.log)
        self.address = f"{host}:{port}"
        self.stopping = False
        write_address(path, self.address)
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        code = self.proc.wait()
        if not self.stopping:  # the server died: this actor exits and Ray restarts it (same bundle)
            print(f"server process at {self.address} exited ({exit_reason(code)}); restarting its actor", flush=True)
            os._exit(1)

    def info(self) -> dict:
        """``{"address", "pid" (of the server process), "node_id"}``."""
        return {"address": self.address, "pid": self.proc.pid, "node_id": ray.get_runtime_context().get_node_id()}

    def stop(self) -> None:
        self.stopping = True
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class TrainerActor:
    """Runs one trainer rank's process (see the module docstring, 3.)."""

    def info(self) -> dict:
        """``{"ip", "node_id", "port"}``: this node's address and a free port on it (rank 0's is
        the ``MASTER_PORT``)."""
        ip = ray.util.get_node_ip_address()
        return {"ip": ip, "node_id": ray.get_runtime_context().get_node_id(), "port": free_port(ip)}

    def run(self, cmd: list[str], env: dict, cwd: str, log_path: str, prefix: str) -> tuple[int, float]:
        """Run ``cmd`` to its end, its output to ``log_path`` and this actor's stdout (which Ray
        shows on the driver). Returns its exit code (negative: killed by that signal) and the
        wall-clock time (``time.time()``, s) at which the process ended."""
        base = {k: v for k, v in os.environ.items() if k not in _NOT_FOR_SERVERS}
        with open(log_path, "a") as log:
            proc = subprocess.Popen(cmd, env={**base, **env}, cwd=cwd, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, preexec_fn=die_with_parent)
            t = stream(proc, prefix, log)
            code = proc.wait()
            ended = time.time()
            t.join(timeout=5)
        return code, ended


def ray_nodes() -> list[Node]:
    """The alive nodes of the connected Ray cluster with their total CPUs and GPUs."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return [Node(n["NodeManagerAddress"], n["Resources"].get("CPU", 0.0), n["Resources"].get("GPU", 0.0), n["NodeID"])
            for n in nodes]


def reserve(placement: Placement, launcher, rollout, timeout: float):
    """The job's placement group (trainer-node bundles, then one bundle per server), each bundle
    pinned to its planned node.

    Raises:
        TimeoutError: Ray could not place it within ``timeout`` s (other jobs hold the resources).
    """
    nodes = placement.nodes
    bundles, selectors = [], []
    for k in placement.trainer_nodes:
        bundles.append({"CPU": float(placement.ranks_per_node * launcher.trainer_cpus),
                        "GPU": float(placement.ranks_per_node * launcher.trainer_gpus)})
        selectors.append({"ray.io/node-id": nodes[k].node_id})
    for k in placement.server_nodes:
        bundles.append({"CPU": float(rollout.server_threads), "GPU": float(launcher.server_gpus)})
        selectors.append({"ray.io/node-id": nodes[k].node_id})
    bundles = [{r: v for r, v in b.items() if v > 0} or {"CPU": 0.001} for b in bundles]
    pg = placement_group(bundles, strategy="PACK", bundle_label_selector=selectors)
    try:
        ray.get(pg.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise TimeoutError(f"Ray could not reserve {bundles} within launcher.placement_timeout={timeout} s; "
                           f"the cluster has {describe(ray_nodes())} and its available resources are "
                           f"{ray.available_resources()} (other jobs may hold them)") from None
    return pg


def _run_once(args, config: dict, placement: Placement, pg, attempt: int) -> tuple[int, str]:
    """Start the servers, then the trainers; wait for the trainers. Returns (exit code, reason)."""
    launcher = from_dict(LauncherConfig, config["launcher"], "launcher")
    rollout = from_dict(InferenceEngineConfig, config.get("rollout") or {}, "rollout")  # SFT has none
    out, cwd = config["output_dir"], os.getcwd()
    n_trainer_bundles, n_servers = len(placement.trainer_nodes), recipe_servers(config)
    servers, trainers = [], []
    try:
        for i in range(n_servers):
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=n_trainer_bundles + i)
            servers.append(ray.remote(ServerActor).options(
                num_cpus=rollout.server_threads, num_gpus=launcher.server_gpus, max_restarts=rollout.max_server_restarts,
                scheduling_strategy=strategy, runtime_env={"env_vars": forwarded_env()}).remote(i, config["rollout"], config["model_path"], config["seed"] + i, out, cwd,
                                                                   actor_lora_rank(config)))
        files = [address_file(out, i) for i in range(n_servers)]
        infos = ray.get([s.info.remote() for s in servers], timeout=rollout.setup_timeout)
        addresses = wait_addresses(files, rollout.setup_timeout)
        print(f"arealite.launcher.ray: servers ready at {addresses}" if n_servers else
              "arealite.launcher.ray: the recipe uses no inference servers", flush=True)

        for k in range(n_trainer_bundles):
            for _ in range(placement.ranks_per_node):
                strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=k)
                trainers.append(ray.remote(TrainerActor).options(
                    num_cpus=launcher.trainer_cpus, num_gpus=launcher.trainer_gpus, max_restarts=0,
                    scheduling_strategy=strategy, runtime_env={"env_vars": forwarded_env()}).remote())
        tinfo = ray.get([t.info.remote() for t in trainers], timeout=launcher.placement_timeout)
        with open(os.path.join(out, "logs", "placement.json"), "w") as f:
            json.dump({"attempt": attempt, "servers": infos, "trainers": tinfo}, f, indent=1)
        master, port = tinfo[0]["ip"], tinfo[0]["port"]
        cmd = trainer_argv(os.path.abspath(args.recipe), list(args.args), addresses,
                           config, launcher.trainer_cpus)
        runs = {}
        for r, t in enumerate(trainers):
            local = r % placement.ranks_per_node
            env = trainer_env(r, len(trainers), local, placement.ranks_per_node, master, port, launcher.trainer_cpus)
            runs[t.run.remote(cmd, env, cwd, os.path.join(out, "logs", f"trainer{r}.log"), f"trainer{r}")] = r
        return _wait_trainers(runs, tinfo, out)
    finally:
        for t in trainers:
            ray.kill(t, no_restart=True)
        for s in servers:
            try:
                ray.get(s.stop.remote(), timeout=15)
            except Exception:  # noqa: BLE001 - already dead or restarting
                pass
            ray.kill(s, no_restart=True)


FAILURE_GRACE_S = 10.0  # after a rank fails, how long the others may take to fail too before they are killed


def _wait_trainers(runs: dict, tinfo: list[dict], out: str) -> tuple[int, str]:
    """Wait for the trainer ranks' ``run`` calls (``{object ref: rank}``). Returns ``(0, "")``
    when all exit with 0, else the exit code of the rank that failed first and a reason naming
    every failed rank, earliest first.

    One rank's death makes the others fail too (their next collective finds the peer gone), and
    any of them may be *reported* first. So after the first failure the others get
    ``FAILURE_GRACE_S`` to end, and the failures are ordered by when each process ended (as
    torchrun's elastic agent names its "root cause" by timestamp); ranks still running then are
    killed by the caller."""
    pending, failed, deadline = list(runs), [], None
    while pending:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not done:
            break
        r = runs[done[0]]
        try:
            (code, ended), reason = ray.get(done[0]), None
        except ray.exceptions.RayActorError as e:
            code, ended, reason = -1, time.time(), f"its Ray actor died ({type(e).__name__})"
        if code != 0:
            failed.append((ended, r, code, reason or exit_reason(code)))
            deadline = deadline or time.monotonic() + FAILURE_GRACE_S
    if not failed:
        return 0, ""
    failed.sort()
    parts = [f"trainer rank {r} on node {tinfo[r]['ip']} (Ray node {tinfo[r]['node_id'][:12]}) failed"
             f"{' first' if i == 0 and len(failed) > 1 else ''}: {why}; see {out}/logs/trainer{r}.log"
             for i, (_, r, _, why) in enumerate(failed)]
    return failed[0][2], "; then ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Parse ``RECIPE [flags]``, check the placement, run the job (restarts per
    ``launcher.max_restarts``). Returns the exit code (0 = success)."""
    p = argparse.ArgumentParser(prog="python -m arealite.launcher.ray", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="the recipe file, e.g. recipes/grpo_math.py")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the recipe's flags (--config FILE, --a.b VALUE)")
    args = p.parse_args(argv)
    launcher, rollout = preparse(args.args)
    fresh = not (launcher.ray_address or os.environ.get("RAY_ADDRESS") or os.path.exists("/tmp/ray/ray_current_cluster"))
    if fresh:  # no cluster: a local one on this machine, gone when the job ends
        plan_placement(launcher, rollout, [this_machine()], cluster="this machine")  # before Ray starts
        ray.init(include_dashboard=False)
    else:
        ray.init(address=launcher.ray_address or None)
    try:
        placement = plan_placement(launcher, rollout, ray_nodes(), cluster="the Ray cluster")
        config = read_recipe_config(args.recipe, args.args)
        if not recipe_servers(config):  # SFT, offline DPO: the trainer ranks only
            placement = without_servers(launcher, rollout, placement, cluster="the Ray cluster")
        os.makedirs(os.path.join(config["output_dir"], "logs"), exist_ok=True)
        pg = reserve(placement, launcher, rollout, launcher.placement_timeout)
        try:
            attempt = 0
            while True:
                start = time.monotonic()
                code, reason = _run_once(args, config, placement, pg, attempt)
                if code == 0:
                    print(f"arealite.launcher.ray: the job finished in {time.monotonic() - start:.0f} s", flush=True)
                    return 0
                print(f"arealite.launcher.ray: {reason}", file=sys.stderr, flush=True)
                if attempt >= launcher.max_restarts:
                    if launcher.max_restarts:
                        print(f"arealite.launcher.ray: no restart left (launcher.max_restarts={launcher.max_restarts})",
                              file=sys.stderr, flush=True)
                    return code if 0 < code < 256 else 1
                attempt += 1
                print(f"arealite.launcher.ray: restarting the job from the newest recover checkpoint "
                      f"(restart {attempt} of {launcher.max_restarts})", flush=True)
        finally:
            remove_placement_group(pg)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    from arealite.launcher import ray as _module  # the actors' classes under their importable name

    sys.exit(run_main("arealite.launcher.ray", _module.main))
