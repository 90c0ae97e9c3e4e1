"""What the Ray and Slurm launchers share: the placement check, reading a recipe's config, the
server and trainer commands, address files, and log streaming (docs/cluster.md).

A cluster launcher runs in three phases, each able to fail before the next costs anything:

1. :func:`preparse` reads the ``launcher`` and ``rollout`` sections from ``--config`` and the
   flags (no torch import), and :func:`plan_placement` checks them against the cluster's nodes:
   an impossible request is a :class:`~arealite.api.cli.ConfigError` naming the field and what
   the cluster has, within seconds.
2. :func:`read_recipe_config` runs the recipe with ``AREALITE_CONFIG_DUMP`` set: the recipe loads
   and validates its whole config (its own dataclass, ``world_size = launcher.trainer_ranks``)
   through :func:`arealite.trainer.entry.load_run_config`, writes it as YAML and exits without
   training. The YAML says whether the run uses inference servers (:func:`recipe_servers`: none
   for SFT and offline DPO; :func:`without_servers` then drops them from the placement).
3. The launcher starts the servers (:func:`server_argv`, each writes its ``host:port`` to
   :func:`address_file`), waits for them (:func:`wait_addresses`), then starts the trainer ranks
   (:func:`trainer_argv`, :func:`trainer_env`) with ``--rollout.addresses``. Trainer rank 0
   catches up a restarted server before using it again
   (:class:`~arealite.launcher.local.ServerWatcher`).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

import yaml

from arealite.api.cli import ConfigError, validate_config
from arealite.api.from_yaml import from_dict
from arealite.api.config import InferenceEngineConfig, LauncherConfig

CONFIG_DUMP_ENV = "AREALITE_CONFIG_DUMP"  # trainer/entry.py::load_run_config writes the validated config here and exits


# ------------------------------------------------------------------------------------------------
# Phase 1: the placement, from the flags alone
# ------------------------------------------------------------------------------------------------

def preparse(args: list[str]) -> tuple[LauncherConfig, InferenceEngineConfig]:
    """The ``launcher`` and ``rollout`` sections of a recipe's ``--config FILE`` and flags
    (``--launcher.trainer_ranks 2``, ``--rollout.n_servers=2``), without the recipe's imports.

    Raises:
        FileNotFoundError: ``--config`` names a missing file.
        ConfigError: an unknown key or a wrongly typed value in these sections.
    """
    sections: dict[str, dict] = {"launcher": {}, "rollout": {}}
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, inline = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        values = [inline] if eq else []
        j = i + 1
        if not eq:
            while j < len(args) and not args[j].startswith("--"):
                values.append(args[j])
                j += 1
        i = j
        if name == "config" and values:
            if not os.path.isfile(values[0]):
                raise FileNotFoundError(f"--config {values[0]}: no such file")
            with open(values[0]) as f:
                data = yaml.safe_load(f) or {}
            for key in sections:
                if isinstance(data.get(key), dict):
                    sections[key].update(data[key])
        section, _, key = name.partition(".")
        if section in sections and key and "." not in key:
            parsed = [_scalar(v) for v in values]
            sections[section][key] = parsed if key in _LIST_FIELDS else (parsed[0] if parsed else True)
    launcher = from_dict(LauncherConfig, sections["launcher"], "launcher")
    rollout = from_dict(InferenceEngineConfig, sections["rollout"], "rollout")
    validate_config(_Sections(launcher, rollout))  # ranges, with their dotted names
    return launcher, rollout


@dataclass
class _Sections:
    launcher: LauncherConfig
    rollout: InferenceEngineConfig


_LIST_FIELDS = {f.name for cls in (LauncherConfig, InferenceEngineConfig) for f in dataclasses.fields(cls)
                if str(f.type).startswith("list")}


def _scalar(text: str) -> Any:
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 reads "1e-5" as a string
        except ValueError:
            return value
    return text if value is None else value


@dataclass
class Node:
    """One node of a cluster as a launcher sees it: its address and free resources."""

    name: str  # Ray node IP / Slurm hostname
    cpus: float
    gpus: float = 0.0
    node_id: str = ""  # Ray node id (for placement constraints); "" elsewhere


@dataclass
class Placement:
    """Which nodes run what (indices into the node list given to :func:`plan_placement`)."""

    trainer_nodes: list[int]  # one entry per trainer node (ranks_per_node ranks each)
    ranks_per_node: int
    server_nodes: list[int]  # node of each inference server
    colocated: bool  # servers share the trainers' nodes (launcher.n_nodes == launcher.trainer_nodes)
    nodes: list[Node] = field(default_factory=list)


def this_machine() -> Node:
    """This machine as one node: its CPUs and GPUs (``CUDA_VISIBLE_DEVICES`` if set, else the
    ``/dev/nvidiaN`` devices), found without importing torch or starting anything."""
    import glob

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = len([g for g in visible.split(",") if g.strip()]) if visible is not None else \
        len(glob.glob("/dev/nvidia[0-9]*"))
    return Node("this machine", float(os.cpu_count() or 1), float(gpus))


def describe(nodes: list[Node]) -> str:
    """``"2 nodes: 10.0.0.1 (4 CPUs, 0 GPUs), ..."`` for error messages."""
    parts = [f"{n.name} ({n.cpus:g} CPUs, {n.gpus:g} GPUs)" for n in nodes]
    return f"{len(nodes)} node{'s' * (len(nodes) != 1)}: " + ", ".join(parts)


def plan_placement(launcher: LauncherConfig, rollout: InferenceEngineConfig, nodes: list[Node],
                   cluster: str = "the cluster") -> Placement:
    """Place ``launcher.trainer_ranks`` trainer ranks (``trainer_cpus``/``trainer_gpus`` each,
    ``trainer_ranks / trainer_nodes`` per node, on ``trainer_nodes`` distinct nodes) and
    ``rollout.n_servers`` servers (``rollout.server_threads`` CPUs and ``launcher.server_gpus``
    GPUs each) on ``nodes``: trainers first, on the nodes with the most room; servers first-fit
    on what is left — on the other nodes when ``n_nodes > trainer_nodes``, else anywhere.

    Raises:
        ConfigError: ``rollout.addresses`` is set (a cluster launcher starts its own servers),
            the request needs more nodes, CPUs or GPUs than ``nodes`` have (the message names
            the field, the request and what the cluster has), or a server/rank fits no node.
    """
    if rollout.addresses:
        raise ConfigError("rollout.addresses", "a cluster launcher starts its own servers; drop "
                          "rollout.addresses (or run the recipe with torchrun against them)")
    if rollout.backend in ("sglang", "vllm") and launcher.server_gpus and launcher.server_gpus != rollout.tp_size:
        raise ConfigError("launcher.server_gpus", f"{launcher.server_gpus} GPUs per server, but "
                          f"rollout.tp_size={rollout.tp_size}; make them equal")
    have = describe(nodes)
    if launcher.n_nodes > len(nodes):
        raise ConfigError("launcher.n_nodes", f"{launcher.n_nodes} nodes requested, {cluster} has {have}")
    per_node = launcher.trainer_ranks // launcher.trainer_nodes
    need_cpu, need_gpu = per_node * launcher.trainer_cpus, per_node * launcher.trainer_gpus
    total_gpu = launcher.trainer_ranks * launcher.trainer_gpus + rollout.n_servers * launcher.server_gpus
    if total_gpu > sum(n.gpus for n in nodes):
        raise ConfigError("launcher.trainer_gpus" if launcher.trainer_gpus else "launcher.server_gpus",
                          f"launcher.trainer_ranks={launcher.trainer_ranks} × launcher.trainer_gpus="
                          f"{launcher.trainer_gpus} + rollout.n_servers={rollout.n_servers} × "
                          f"launcher.server_gpus={launcher.server_gpus} = {total_gpu} GPUs, but {cluster} has {have}")
    total_cpu = launcher.trainer_ranks * launcher.trainer_cpus + rollout.n_servers * rollout.server_threads
    if total_cpu > sum(n.cpus for n in nodes):
        raise ConfigError("launcher.trainer_cpus", f"launcher.trainer_ranks={launcher.trainer_ranks} × "
                          f"launcher.trainer_cpus={launcher.trainer_cpus} + rollout.n_servers={rollout.n_servers} × "
                          f"rollout.server_threads={rollout.server_threads} = {total_cpu} CPUs, but {cluster} has {have}")
    free = [[n.cpus, n.gpus] for n in nodes]
    order = sorted(range(len(nodes)), key=lambda k: (-nodes[k].gpus, -nodes[k].cpus))
    trainer = [k for k in order if free[k][0] >= need_cpu and free[k][1] >= need_gpu][: launcher.trainer_nodes]
    if len(trainer) < launcher.trainer_nodes:
        raise ConfigError("launcher.trainer_nodes", f"{launcher.trainer_nodes} nodes with {per_node} trainer ranks "
                          f"× ({launcher.trainer_cpus} CPUs, {launcher.trainer_gpus} GPUs) = {need_cpu} CPUs and "
                          f"{need_gpu} GPUs each (launcher.trainer_ranks / trainer_cpus / trainer_gpus), but only "
                          f"{len(trainer)} such nodes in {cluster}: {have}")
    for k in trainer:
        free[k][0] -= need_cpu
        free[k][1] -= need_gpu
    colocated = launcher.n_nodes == launcher.trainer_nodes
    pool = [k for k in order if colocated or k not in trainer]
    servers = []
    for i in range(rollout.n_servers):
        fit = [k for k in pool if free[k][0] >= rollout.server_threads and free[k][1] >= launcher.server_gpus]
        if not fit:
            raise ConfigError("rollout.n_servers", f"server {i} of {rollout.n_servers} (rollout.server_threads="
                              f"{rollout.server_threads} CPUs, launcher.server_gpus={launcher.server_gpus} GPUs) fits no "
                              f"{'node' if colocated else 'node outside the trainer nodes'} after the trainer ranks; "
                              f"{cluster} has {have}")
        servers.append(fit[0])
        free[fit[0]][0] -= rollout.server_threads
        free[fit[0]][1] -= launcher.server_gpus
    return Placement(trainer, per_node, servers, colocated, nodes)


# ------------------------------------------------------------------------------------------------
# Phase 2: the recipe's own config
# ------------------------------------------------------------------------------------------------

def read_recipe_config(recipe: str, args: list[str], timeout: float = 600.0) -> dict:
    """Run ``python RECIPE ARGS`` with ``AREALITE_CONFIG_DUMP`` set: the recipe loads and
    validates its config (its dataclass, world size ``launcher.trainer_ranks``) and writes it as
    YAML, plus ``output_dir`` and ``model_path`` (``actor.path`` resolved; the embedded model is
    converted once here), then exits. Returns that dict.

    Raises:
        FileNotFoundError: no such recipe file.
        ConfigError: the recipe rejected its config (its message, naming the field).
        RuntimeError: the recipe failed otherwise (its output's tail is in the message).
    """
    if not os.path.isfile(recipe):
        raise FileNotFoundError(f"recipe {recipe!r}: no such file (e.g. recipes/grpo_math.py)")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.yaml")
        proc = subprocess.run([sys.executable, recipe, *args], env={**os.environ, CONFIG_DUMP_ENV: path},
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not os.path.exists(path):
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-20:]
            errors = [line for line in tail if "ConfigError" in line or "Error:" in line]
            if errors and "ConfigError" in errors[-1]:
                msg = errors[-1].split("ConfigError: ", 1)[-1]
                field_, _, rest = msg.partition(": ")
                raise ConfigError(field_, rest)
            usage = proc.stderr.strip().splitlines()[-1:] if proc.returncode == 2 else []
            if usage and ": error: " in usage[0]:  # load_config's one line: "PROG: error: FIELD: why"
                field_, _, rest = usage[0].split(": error: ", 1)[1].partition(": ")
                raise ConfigError(field_, rest)
            raise RuntimeError(f"{recipe} failed while reading its config (exit {proc.returncode}):\n" + "\n".join(tail))
        with open(path) as f:
            return yaml.safe_load(f)


def recipe_servers(config: dict) -> int:
    """How many inference servers the run of a read config (:func:`read_recipe_config`) needs:
    ``rollout.n_servers``, or 0 when the recipe said it uses none (SFT, offline DPO) or has no
    ``rollout`` section."""
    if not config.get("uses_servers", True) or not isinstance(config.get("rollout"), dict):
        return 0
    return int(config["rollout"].get("n_servers", InferenceEngineConfig.n_servers))


def without_servers(launcher: LauncherConfig, rollout: InferenceEngineConfig, placement: Placement,
                    cluster: str = "the cluster") -> Placement:
    """``placement`` planned again with no servers (a recipe that uses none): the trainer ranks
    only, on the same nodes' list.

    Raises:
        ConfigError: as :func:`plan_placement` (cannot happen for a request that fitted with servers).
    """
    return plan_placement(launcher, dataclasses.replace(rollout, n_servers=0), placement.nodes, cluster)


# ------------------------------------------------------------------------------------------------
# Phase 3: commands, address files, processes
# ------------------------------------------------------------------------------------------------

def server_argv(rollout: InferenceEngineConfig, model_path: str, host: str, port: int, seed: int,
                lora_rank: int = 0) -> tuple[list[str], dict]:
    """The command and extra environment of one server listening on ``host:port``
    (:func:`arealite.launcher.local.server_command`, bound to this node's address; ``lora_rank``:
    the actor's ``lora.rank``)."""
    from arealite.launcher.local import server_command, server_env

    cmd = server_command(rollout, model_path, port, seed, host=host, lora_rank=lora_rank)
    env = {"OMP_NUM_THREADS": str(rollout.server_threads), **server_env(rollout.backend)}
    return cmd, env


def actor_lora_rank(config: dict) -> int:
    """The actor's ``lora.rank`` in a recipe's config dict (0 without an actor or LoRA)."""
    return int(((config.get("actor") or {}).get("lora") or {}).get("rank") or 0)


def trainer_argv(recipe: str, args: list[str], addresses: list[str], config: dict, cpus: int) -> list[str]:
    """``python RECIPE ARGS --rollout.addresses A B ...`` (+ ``--actor.num_threads cpus`` unless
    the config sets it) for one trainer rank; no ``--rollout.addresses`` when ``addresses`` is
    empty (a recipe without servers)."""
    cmd = [sys.executable, recipe, *args, *(["--rollout.addresses", *addresses] if addresses else [])]
    if not config.get("actor", {}).get("num_threads"):
        cmd += ["--actor.num_threads", str(cpus)]
    return cmd


def trainer_env(rank: int, world: int, local_rank: int, local_world: int, master: str, port: int,
                cpus: int) -> dict:
    """The ``torch.distributed`` environment of one trainer rank (what ``torchrun`` sets)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": master, "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": str(cpus)}


def address_file(output_dir: str, index: int) -> str:
    """``<output_dir>/servers/server{index}.addr``: where server ``index`` writes ``host:port``."""
    return os.path.join(output_dir, "servers", f"server{index}.addr")


def write_address(path: str, address: str) -> None:
    """Write ``address`` to ``path`` atomically (readers never see a partial line)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(address + "\n")
    os.replace(tmp, path)


def previous_port(path: str, host: str) -> int | None:
    """The port server ``path`` used before on ``host`` (a restart keeps its address), else None."""
    try:
        with open(path) as f:
            old_host, _, port = f.read().strip().rpartition(":")
        return int(port) if old_host == host and port_free(host, int(port)) else None
    except (OSError, ValueError):
        return None


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def node_address() -> str:
    """This node's IP address as other nodes reach it (loopback on a single machine)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the outgoing interface
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def wait_addresses(paths: list[str], timeout: float, alive: Callable[[], str | None] = lambda: None,
                   poll: float = 0.5) -> list[str]:
    """Wait until every file of ``paths`` holds an address and that server answers ``/health``.

    Args:
        alive: returns a reason string when a server process died meanwhile (fail fast).

    Raises:
        TimeoutError: not all servers were healthy within ``timeout`` s (names the missing ones).
        RuntimeError: ``alive()`` reported a dead server.
    """
    from arealite.inference.remote import post_json
    from arealite.inference.adapters import ServerError

    deadline = time.monotonic() + timeout
    ready: dict[str, str] = {}
    while len(ready) < len(paths):
        dead = alive()
        if dead:
            raise RuntimeError(dead)
        for p in paths:
            if p in ready or not os.path.exists(p):
                continue
            with open(p) as f:
                addr = f.read().strip()
            try:
                post_json(addr, "/health", timeout=5, retries=1, method="GET")
                ready[p] = addr
            except ServerError:
                pass
        if len(ready) < len(paths):
            if time.monotonic() > deadline:
                missing = [os.path.basename(p) for p in paths if p not in ready]
                raise TimeoutError(f"servers {missing} not healthy after {timeout} s (rollout.setup_timeout); "
                                   "see their logs under <output_dir>/logs/")
            time.sleep(poll)
    return [ready[p] for p in paths]


def stream(proc: subprocess.Popen, prefix: str, log: TextIO, echo: TextIO | None = sys.stdout) -> threading.Thread:
    """Copy ``proc``'s stdout line by line to ``log`` and, prefixed with ``[prefix]``, to ``echo``."""

    def run() -> None:
        for line in proc.stdout:
            log.write(line)
            log.flush()
            if echo is not None:
                echo.write(f"[{prefix}] {line}")
                echo.flush()

    t = threading.Thread(target=run, name=f"arealite-log-{prefix}", daemon=True)
    t.start()
    return t


def run_main(name: str, main: Callable[[], int]) -> int:
    """Run a launcher's ``main``; a bad request (:class:`ConfigError`, ``ValueError``,
    ``FileNotFoundError``, ``TimeoutError``) is one ``name: error: ...`` line and exit code 2."""
    try:
        return main()
    except (ValueError, FileNotFoundError, TimeoutError) as e:
        print(f"{name}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted; every process of the job was stopped", file=sys.stderr, flush=True)
        return 130


def exit_reason(returncode: int | None) -> str:
    """``"exit code 1"`` / ``"killed by SIGKILL"`` for a process's return code."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    if returncode > 128 and returncode - 128 in {s.value for s in signal.Signals}:
        return f"exit code {returncode} (signal {signal.Signals(returncode - 128).name})"
    return f"exit code {returncode}"
