"""Run a recipe as a Slurm job: ``python -m arealite.launcher.slurm [--dry-run] [--wait] RECIPE [flags]``.

    python -m arealite.launcher.slurm recipes/grpo_math.py --config my.yaml \\
        --launcher.n_nodes 2 --launcher.trainer_nodes 1 --launcher.trainer_ranks 8 \\
        --launcher.trainer_gpus 1 --rollout.n_servers 4 --launcher.server_gpus 2 --rollout.tp_size 2 \\
        --rollout.backend vllm --launcher.slurm_partition gpu --launcher.slurm_time 12:00:00
    python -m arealite.launcher.slurm --dry-run recipes/grpo_math.py ...   # print the sbatch script

The recipe file is unchanged. The launcher checks the placement against the partition's nodes
(``sinfo``; a clear error naming the field), reads the recipe's validated config, writes
``<output_dir>/slurm/job.sh`` (and ``plan.json``) and submits it with ``sbatch``. The job is one
allocation of ``launcher.n_nodes`` nodes split by node list:

* servers: one ``srun`` step per server on its node (``serve`` below: it picks a port, writes
  ``host:port`` to ``<output_dir>/servers/server{i}.addr`` on the shared output folder and
  becomes the server process); a step that exits is started again on the same node and port up
  to ``rollout.max_server_restarts`` times, and trainer rank 0 catches it up (weights, version)
  before using it again (:class:`~arealite.launcher.local.ServerWatcher`);
* ``wait``: the addresses once every server answers ``/health``;
* trainers: one ``srun`` step over the trainer nodes running ``torchrun`` (one per node, c10d
  rendezvous on the first) with the recipe and ``--rollout.addresses``. When it fails, torchrun's
  report names the rank, host and exit code; with ``--recover.mode auto`` and
  ``launcher.max_restarts N`` the servers and trainers are started again (up to N times) and
  resume from the newest recover checkpoint.

Logs: ``<output_dir>/logs/slurm-<jobid>.out`` (the job script and the trainers) and
``logs/server{i}.log``. ``scancel <jobid>`` stops every step, hence every process. Nodes of an
allocation are assumed alike (the per-node request is the largest the placement needs).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

from arealite.api.cli import ConfigError
from arealite.api.from_yaml import from_dict
from arealite.api.config import InferenceEngineConfig, LauncherConfig
from arealite.utils.proc import free_port
from arealite.launcher.cluster import (Node, Placement, actor_lora_rank, address_file, describe, node_address,
                                       plan_placement, preparse,
                                       previous_port, read_recipe_config, recipe_servers, run_main,
                                       server_argv, trainer_argv, wait_addresses, without_servers, write_address)


def partition_nodes(partition: str = "") -> list[Node]:
    """The usable nodes (not down, drained or failed) of ``partition`` (default: every
    partition) from ``sinfo``, with their CPUs and GPUs (``gres gpu:N``).

    Raises:
        ValueError: ``sinfo`` is missing or fails (Slurm is not reachable from here).
    """
    cmd = ["sinfo", "-h", "-N", "-o", "%N|%c|%G|%t"] + (["-p", partition] if partition else [])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise ValueError("arealite.launcher.slurm: `sinfo` not found; run this on a Slurm login node "
                         "(or start a local cluster with scripts/slurm_local.sh)") from None
    if proc.returncode != 0:
        raise ValueError(f"sinfo failed: {proc.stderr.strip()}"
                         + (f"; is launcher.slurm_partition={partition!r} a partition?" if partition else ""))
    nodes: dict[str, Node] = {}
    for line in proc.stdout.split("\n"):
        if not line.strip():
            continue
        name, cpus, gres, state = line.strip().split("|")
        if any(bad in state for bad in ("down", "drain", "fail", "maint")):
            continue
        gpus = sum(int(g.split(":")[-1].split("(")[0]) for g in gres.split(",")
                   if g.startswith("gpu") and g.split(":")[-1].split("(")[0].isdigit())
        nodes[name] = Node(name, float(cpus), float(gpus))
    return list(nodes.values())


def layout(placement: Placement, launcher: LauncherConfig, rollout: InferenceEngineConfig) -> dict:
    """The placement in node positions of the allocation (trainer nodes first, then the server
    nodes) and the per-node request: ``{"trainer_nodes": [0..], "server_nodes": [pos of server
    i], "cpus_per_node", "gpus_per_node", "n_nodes"}``."""
    order = list(placement.trainer_nodes) + [k for k in dict.fromkeys(placement.server_nodes)
                                             if k not in placement.trainer_nodes]
    pos = {k: i for i, k in enumerate(order)}
    cpus = [0.0] * len(order)
    gpus = [0.0] * len(order)
    for k in placement.trainer_nodes:
        cpus[pos[k]] += placement.ranks_per_node * launcher.trainer_cpus
        gpus[pos[k]] += placement.ranks_per_node * launcher.trainer_gpus
    for k in placement.server_nodes:
        cpus[pos[k]] += rollout.server_threads
        gpus[pos[k]] += launcher.server_gpus
    return {"trainer_nodes": [pos[k] for k in placement.trainer_nodes],
            "server_nodes": [pos[k] for k in placement.server_nodes],
            "cpus_per_node": int(max(cpus)), "gpus_per_node": int(max(gpus)), "n_nodes": launcher.n_nodes}


def sbatch_header(config: dict, plan: dict, launcher: LauncherConfig) -> list[str]:
    """The ``#!/bin/bash`` and ``#SBATCH`` lines of the job script (nodes, per-node request, log,
    partition, time limit, ``launcher.slurm_args``)."""
    head = [
        "#!/bin/bash",
        f"#SBATCH --job-name=arealite-{config['experiment_name']}-{config['trial_name']}",
        f"#SBATCH --nodes={plan['n_nodes']}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={plan['cpus_per_node']}",
        f"#SBATCH --output={config['output_dir']}/logs/slurm-%j.out",
    ]
    if plan["gpus_per_node"]:
        head.append(f"#SBATCH --gpus-per-node={plan['gpus_per_node']}")
    if launcher.slurm_partition:
        head.append(f"#SBATCH --partition={launcher.slurm_partition}")
    if launcher.slurm_time:
        head.append(f"#SBATCH --time={launcher.slurm_time}")
    return head + [f"#SBATCH {a}" for a in launcher.slurm_args]


def job_script(recipe: str, args: list[str], config: dict, plan: dict, plan_path: str) -> str:
    """The sbatch script of the job (see the module docstring); a recipe without servers (SFT,
    offline DPO: :func:`~arealite.launcher.cluster.recipe_servers` is 0) starts the trainers only."""
    launcher = from_dict(LauncherConfig, config["launcher"], "launcher")
    rollout = from_dict(InferenceEngineConfig, config.get("rollout") or {}, "rollout")  # SFT has none
    n_servers = recipe_servers(config)  # 0: no server steps, no --rollout.addresses
    out, py, q = config["output_dir"], sys.executable, shlex.quote
    t_nodes, per_node = plan["trainer_nodes"], launcher.trainer_ranks // launcher.trainer_nodes
    head = sbatch_header(config, plan, launcher)
    trainer_list = ",".join(f"${{NODES[{k}]}}" for k in t_nodes)
    if len(t_nodes) == 1:
        rdzv = "--standalone"
    else:
        rdzv = (f"--nnodes={len(t_nodes)} --rdzv_backend=c10d --rdzv_id=$SLURM_JOB_ID "
                f"--rdzv_endpoint=${{NODES[{t_nodes[0]}]}}:$((20000 + SLURM_JOB_ID % 20000))")
    cmd = trainer_argv(os.path.abspath(recipe), list(args), ["__ADDRS__"] if n_servers else [],
                       config, launcher.trainer_cpus)
    recipe_args = " ".join(q(a) for a in cmd[1:]).replace("__ADDRS__", "$ADDRS")
    gpu_flag = f" --gpus-per-task={per_node * launcher.trainer_gpus}" if launcher.trainer_gpus else ""
    server_gpu = f" --gpus-per-task={launcher.server_gpus}" if launcher.server_gpus else ""
    servers = "\n".join(f'  server {i} "${{NODES[{k}]}}" & SERVER_PIDS+=($!)' for i, k in enumerate(plan["server_nodes"]))
    start = f"""  start_servers
  if ! ADDRS=$("$PY" -m arealite.launcher.slurm wait --plan "$PLAN"); then
    echo "arealite: the servers did not come up; see $OUT/logs/server*.log"; stop_servers; exit 1
  fi
  echo "arealite: servers at $ADDRS; starting {launcher.trainer_ranks} trainer ranks (attempt $attempt)"
"""
    no_servers = f'  echo "arealite: no inference servers; starting {launcher.trainer_ranks} trainer ranks (attempt $attempt)"\n'
    body = f"""
# Written by python -m arealite.launcher.slurm: {os.path.basename(recipe)} on {plan['n_nodes']} node(s).
# Servers on node positions {plan['server_nodes']}; {launcher.trainer_ranks} trainer ranks on {t_nodes} ({per_node} per node).
set -u
OUT={q(out)}
PLAN={q(plan_path)}
PY={q(py)}
cd {q(os.getcwd())}
NODES=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
mkdir -p "$OUT/logs" "$OUT/servers"
SERVER_PIDS=()

server() {{  # server $1 on node $2; its step is started again when it exits
  for attempt in $(seq 0 {rollout.max_server_restarts}); do
    srun --nodes=1 --ntasks=1 --cpus-per-task={rollout.server_threads}{server_gpu} --nodelist="$2" --overlap \\
      "$PY" -m arealite.launcher.slurm serve --plan "$PLAN" --index "$1" >> "$OUT/logs/server$1.log" 2>&1
    rc=$?
    [ -e "$OUT/servers/stop" ] && return 0
    echo "arealite: server $1 on $2 exited with $rc; starting it again (restart $((attempt + 1)) of {rollout.max_server_restarts})"
  done
}}
start_servers() {{
  rm -f "$OUT"/servers/*.addr "$OUT/servers/stop"
  SERVER_PIDS=()
{servers}
}}
stop_servers() {{
  touch "$OUT/servers/stop"
  for p in "${{SERVER_PIDS[@]}}"; do pkill -TERM -P "$p" 2>/dev/null; done
  wait "${{SERVER_PIDS[@]}}" 2>/dev/null
}}
trap 'stop_servers; exit 143' TERM INT

rc=1
for attempt in $(seq 0 {launcher.max_restarts}); do
{start if n_servers else no_servers}  srun --nodes={len(t_nodes)} --ntasks-per-node=1 --cpus-per-task={per_node * launcher.trainer_cpus}{gpu_flag} \\
    --nodelist="{trainer_list}" --overlap --kill-on-bad-exit=1 \\
    "$PY" -m torch.distributed.run {rdzv} --nproc_per_node={per_node} {recipe_args}
  rc=$?
  stop_servers
  [ $rc -eq 0 ] && {{ echo "arealite: the job finished"; exit 0; }}
  echo "arealite: the trainer step failed with exit code $rc (torchrun's report above names the rank and host)"
  [ "$attempt" -lt {launcher.max_restarts} ] && echo "arealite: restarting the job from the newest recover checkpoint (restart $((attempt + 1)) of {launcher.max_restarts})"
done
exit $rc
"""
    return "\n".join(head) + "\n" + body


def serve(plan_path: str, index: int) -> None:
    """Inside a server step: pick this node's address and a port (the previous one after a
    restart), write it to the address file, and become the server process (``exec``)."""
    with open(plan_path) as f:
        plan = json.load(f)
    rollout = from_dict(InferenceEngineConfig, plan["config"]["rollout"], "rollout")
    out = plan["config"]["output_dir"]
    host = node_address()
    path = address_file(out, index)
    port = previous_port(path, host) or free_port(host)
    cmd, extra = server_argv(rollout, plan["config"]["model_path"], host, port, plan["config"]["seed"] + index,
                             actor_lora_rank(plan["config"]))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    print(f"[arealite] server {index} starting on {host}:{port}: {' '.join(cmd)}", flush=True)
    write_address(path, f"{host}:{port}")
    os.execvpe(cmd[0], cmd, {**env, **extra})


def wait_servers(plan_path: str) -> None:
    """Inside the job: print the servers' addresses once every one answers ``/health``."""
    with open(plan_path) as f:
        plan = json.load(f)
    rollout = from_dict(InferenceEngineConfig, plan["config"]["rollout"], "rollout")
    files = [address_file(plan["config"]["output_dir"], i) for i in range(rollout.n_servers)]
    print(" ".join(wait_addresses(files, rollout.setup_timeout)))


def job_state(job_id: str) -> str:
    """``JobState`` of ``job_id`` from ``scontrol`` (PENDING, RUNNING, COMPLETED, FAILED, ...)."""
    proc = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True)
    for token in proc.stdout.split():
        if token.startswith("JobState="):
            return token.split("=", 1)[1]
    return "UNKNOWN"


def submit(args: argparse.Namespace) -> int:
    launcher, rollout = preparse(args.args)
    nodes = partition_nodes(launcher.slurm_partition)
    where = f"Slurm partition {launcher.slurm_partition!r}" if launcher.slurm_partition else "the Slurm cluster"
    if not nodes:
        raise ConfigError("launcher.slurm_partition", f"{where} has no usable node (sinfo lists none up)")
    placement = plan_placement(launcher, rollout, nodes, cluster=where)
    config = read_recipe_config(args.recipe, args.args)
    if not recipe_servers(config):  # SFT, offline DPO: the trainer ranks only
        placement = without_servers(launcher, rollout, placement, cluster=where)
    plan = layout(placement, launcher, rollout)
    slurm_dir = os.path.join(config["output_dir"], "slurm")
    plan_path = os.path.join(slurm_dir, "plan.json")
    script = job_script(args.recipe, args.args, config, plan, plan_path)
    if args.dry_run:
        print(script)
        return 0
    os.makedirs(slurm_dir, exist_ok=True)
    os.makedirs(os.path.join(config["output_dir"], "logs"), exist_ok=True)
    with open(plan_path, "w") as f:
        json.dump({"config": config, "layout": plan, "nodes": describe(nodes)}, f, indent=1)
    script_path = os.path.join(slurm_dir, "job.sh")
    with open(script_path, "w") as f:
        f.write(script)
    proc = subprocess.run(["sbatch", "--parsable", script_path], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ValueError(f"sbatch rejected {script_path}: {proc.stderr.strip()}")
    job_id = proc.stdout.strip().split(";")[0]
    log = os.path.join(config["output_dir"], "logs", f"slurm-{job_id}.out")
    print(f"arealite.launcher.slurm: submitted job {job_id} ({script_path}); log: {log}; cancel: scancel {job_id}",
          flush=True)
    if not args.wait:
        return 0
    offset, state = 0, "PENDING"
    try:
        while True:
            state = job_state(job_id)
            if os.path.exists(log):
                with open(log) as f:
                    f.seek(offset)
                    chunk = f.read()
                    offset = f.tell()
                sys.stdout.write(chunk)
                sys.stdout.flush()
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "UNKNOWN"):
                break
            time.sleep(2)
    except KeyboardInterrupt:
        subprocess.run(["scancel", job_id])
        print(f"arealite.launcher.slurm: cancelled job {job_id}", file=sys.stderr, flush=True)
        return 130
    print(f"arealite.launcher.slurm: job {job_id} {state}", flush=True)
    return 0 if state == "COMPLETED" else 1


def main(argv: list[str] | None = None) -> int:
    """``[--dry-run] [--wait] RECIPE [flags]`` submits; ``serve`` / ``wait`` run inside the job."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["serve"], ["wait"]):
        p = argparse.ArgumentParser(prog=f"python -m arealite.launcher.slurm {argv[0]}")
        p.add_argument("--plan", required=True)
        p.add_argument("--index", type=int, default=0)
        ns = p.parse_args(argv[1:])
        if argv[0] == "serve":
            serve(ns.plan, ns.index)
        else:
            wait_servers(ns.plan)
        return 0
    p = argparse.ArgumentParser(prog="python -m arealite.launcher.slurm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script; submit nothing, write nothing")
    p.add_argument("--wait", action="store_true", help="follow the job's log until it ends; exit 0 if it completed")
    p.add_argument("recipe", help="the recipe file, e.g. recipes/grpo_math.py")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the recipe's flags (--config FILE, --a.b VALUE)")
    return submit(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(run_main("arealite.launcher.slurm", main))
