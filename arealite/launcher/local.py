"""Local launcher: start our generation servers as subprocesses of trainer rank 0.

Used when ``rollout.addresses`` is empty. Rank 0 starts ``rollout.n_servers`` processes of
``python -m arealite.engine.server`` on free loopback ports, waits for ``/health`` and
broadcasts the addresses to the other ranks; the servers are killed when rank 0 exits.

CPU threads are split so that servers and trainer ranks never oversubscribe the cores:
each server gets ``rollout.server_threads``; the trainer ranks share the rest
(:func:`trainer_threads`).
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys

import torch.distributed as dist

from arealite.api.config import InferenceEngineConfig
from arealite.engine.remote import RemoteInferenceEngine, wait_healthy


def trainer_threads(config: InferenceEngineConfig, world_size: int) -> int:
    """Torch threads per trainer rank: cores not used by local servers, split over ranks (≥ 1)."""
    servers = 0 if config.addresses else config.n_servers * config.server_threads
    return max(1, ((os.cpu_count() or 1) - servers) // world_size)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_servers(config: InferenceEngineConfig, model_path: str, log_dir: str, seed: int = 1) -> list[str]:
    """Start ``config.n_servers`` servers on this machine and wait until they are healthy.

    Server logs go to ``log_dir/server{i}.log``. Returns their ``127.0.0.1:port`` addresses.

    Raises:
        TimeoutError: a server did not become healthy within ``rollout.setup_timeout``
            (the processes are killed; see the server log).
    """
    os.makedirs(log_dir, exist_ok=True)
    procs, addresses = [], []
    for i in range(config.n_servers):
        port = _free_port()
        cmd = [
            sys.executable, "-m", "arealite.engine.server", "--model-path", model_path,
            "--host", "127.0.0.1", "--port", str(port), "--num-threads", str(config.server_threads),
            "--max-batch-size", str(config.server_max_batch_size), "--seed", str(seed + i),
            "--parent-pid", str(os.getpid()),  # no orphan server if the trainer is SIGKILLed
        ]
        env = dict(os.environ, OMP_NUM_THREADS=str(config.server_threads))
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)  # the server is not part of the trainer's process group
        log = open(os.path.join(log_dir, f"server{i}.log"), "a")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        addresses.append(f"127.0.0.1:{port}")

    def _kill() -> None:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()

    atexit.register(_kill)
    try:
        wait_healthy(addresses, config.setup_timeout)
    except BaseException:
        _kill()
        raise
    return addresses


def make_inference_engine(config: InferenceEngineConfig, model_path: str, log_dir: str, seed: int = 1) -> RemoteInferenceEngine:
    """The rollout engine of this rank: servers from ``config.addresses`` or launched by rank 0.

    Collective over all trainer ranks when servers are launched (addresses are broadcast).
    """
    addresses = list(config.addresses)
    if not addresses:
        obj = [launch_servers(config, model_path, log_dir, seed) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(obj, src=0)
        addresses = obj[0]
    engine = RemoteInferenceEngine(config, addresses, world_size=dist.get_world_size())
    engine.initialize()
    return engine
