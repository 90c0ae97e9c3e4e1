"""Run untrusted, model-written Python in a separate, resource-limited process.

A call never raises because of what the code does: every violation (time, memory, processes,
output size, file system, network) ends that call and comes back as :attr:`SandboxResult.error`,
a short message meant for the model. Only a broken *host* setup raises (no Python, no
``prlimit``).

Mechanisms (all well-kept OS tools; no own seccomp or ptrace code):

* Process: ``sys.executable -I main.py`` (isolated mode: ignores ``PYTHON*`` variables and the
  user site) in a new session, with a scrubbed environment (``PATH``, ``LANG``, ``HOME`` and 1-thread
  settings for OpenMP/BLAS only).
* Limits via util-linux ``prlimit``: RLIMIT_CPU (CPU seconds), RLIMIT_AS (address space, so a
  memory bomb gets ``MemoryError``), RLIMIT_NPROC (processes of the sandbox uid), RLIMIT_FSIZE
  (largest file), RLIMIT_NOFILE, RLIMIT_CORE = 0; a wall-clock deadline enforced by the parent,
  which then kills the whole process group (SIGKILL).
* Output: stdout+stderr are read incrementally; past ``max_output_bytes`` the process is killed.
* Working directory: a fresh :func:`tempfile.mkdtemp` folder, deleted after the call.

``mode="namespace"`` (chosen by ``"auto"`` when we are root and ``unshare``/``setpriv`` work, as
on the project machines) adds Linux namespaces through util-linux ``unshare``:

* ``--net``: a network namespace with only a downed loopback: **no network at all** (connect
  fails with ENETUNREACH), enforced by the kernel.
* ``--pid --mount-proc``: the code sees only its own processes (no host ``/proc/<pid>/environ``),
  and when the call ends every process it started dies with the namespace (fork bombs included).
* ``--mount``: the work dir is bind-mounted on ``/tmp`` and fresh 1 MiB tmpfs cover ``/var/tmp`` and
  ``/dev/shm``, so the world-writable places are private and thrown away. When the interpreter
  (a venv, or Python itself) lives under one of them — a clone in ``/tmp`` — just the folders it
  needs (``sys.prefix``, ``sys.base_prefix``, the executable's folder) are bound back read-only at
  their own paths; everything else there stays hidden.
* ``setpriv``: the code runs as an unprivileged uid (``uid_base`` + a per-call offset, no groups,
  ``no_new_privs``), so the rest of the file system is read-only to it (ordinary permission checks)
  and RLIMIT_NPROC counts only this call's processes (root would bypass RLIMIT_NPROC).

``mode="rlimit"`` (fallback elsewhere) keeps the limits and adds a ``sys.addaudithook`` prelude
that refuses sockets, file writes outside the work dir, other processes' ``/proc`` entries and —
when running as root, where RLIMIT_NPROC is not enforced — process creation (also ctypes symbols
such as ``fork``). Audit hooks are a guard rail, not a security boundary (PEP 578): in this mode
the guarantees against deliberately malicious code are weaker (e.g. a C extension calling
``open``/``fork`` directly is not seen by the hook).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from functools import lru_cache

from arealite.api.cli import check_section
from arealite.api.config import SandboxConfig  # the limits (re-exported here)

_CALLS = itertools.count()

# Prepended to the user code in mode="rlimit" (see the module docstring).
_AUDIT_PRELUDE = textwrap.dedent("""\
    import sys as _s, os as _o
    def _sandbox_hook(event, args, _block_proc={block_proc}, _root=_o.path.realpath({workdir!r}) + _o.sep,
                      _real=_o.path.realpath, _fs=_o.fspath, _sep=_o.sep,
                      _wflags=_o.O_WRONLY | _o.O_RDWR | _o.O_CREAT):
        if event.startswith("socket.") or (_block_proc and (event in (
                "os.fork", "os.forkpty", "os.system", "os.posix_spawn", "os.exec", "os.spawn",
                "subprocess.Popen", "pty.spawn"))):
            raise PermissionError(f"sandbox: {{event}} is not allowed")
        if event == "ctypes.dlsym" and _block_proc and str(args[1]).strip("b'").startswith((
                "fork", "vfork", "clone", "system", "exec", "posix_spawn", "socket", "connect", "unshare",
                "setuid", "setsid", "kill", "open", "creat", "unlink", "rename", "mkdir", "syscall")):
            raise PermissionError(f"sandbox: ctypes access to {{args[1]!r}} is not allowed")
        if event == "open" and isinstance(args[0], str) and _real(args[0]).startswith("/proc/") and not (
                args[0].startswith("/proc/self/")):
            raise PermissionError(f"sandbox: reading other processes' /proc entries is not allowed: {{args[0]!r}}")
        writes = event == "open" and isinstance(args[0], (str, bytes)) and (
            any(c in str(args[1] or "") for c in "wax+") or (args[2] or 0) & _wflags)
        if writes or event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                               "os.symlink", "os.link", "os.truncate", "os.utime"):
            path = args[0]
            if isinstance(path, (str, bytes)) and not (_real(_fs(path if isinstance(path, str) else path.decode()))
                                                       + _sep).startswith(_root):
                raise PermissionError(f"sandbox: writing outside the work dir is not allowed: {{path!r}}")
    _s.addaudithook(_sandbox_hook)
    del _s, _o, _sandbox_hook
""")


@dataclass
class SandboxResult:
    """Outcome of one call.

    Attributes:
        output: stdout and stderr interleaved, decoded (UTF-8, errors replaced), at most
            ``max_output_bytes`` bytes before decoding.
        returncode: exit status of the sandboxed program (negative: killed by that signal;
            None: killed by the parent for a timeout or too much output).
        error: None on success, else a one-line reason for the model ("timeout: ...",
            "output limit: ...", "MemoryError: ...", the last traceback line, ...).
        mode: the isolation mode actually used ("namespace" | "rlimit").
        wall_time: seconds from start to the end of the process.
    """

    output: str
    returncode: int | None
    error: str | None
    mode: str
    wall_time: float

    @property
    def ok(self) -> bool:
        return self.error is None

    def observation(self) -> str:
        """The text returned to the model: the output, then the error line if any."""
        text = self.output.rstrip()
        if self.error:
            text = f"{text}\n[sandbox error] {self.error}" if text else f"[sandbox error] {self.error}"
        return text or "[no output]"


@lru_cache(maxsize=1)
def namespace_available() -> bool:
    """True when we are root and ``unshare --net --pid --mount`` + ``setpriv`` work here
    (probed once per process by running ``true`` under them)."""
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv") and shutil.which("prlimit")):
        return False
    try:
        r = subprocess.run(["unshare", "--net", "--pid", "--fork", "--mount", "--mount-proc", "--kill-child", "--",
                            "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "true"],
                           capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def resolve_mode(config: SandboxConfig) -> str:
    """The isolation mode ``config.mode`` resolves to here ("namespace" | "rlimit").

    Raises:
        RuntimeError: mode "namespace" was asked for but is not available.
    """
    if config.mode == "auto":
        return "namespace" if namespace_available() else "rlimit"
    if config.mode == "namespace" and not namespace_available():
        raise RuntimeError("sandbox.mode='namespace' needs root plus working util-linux unshare/setpriv/prlimit; "
                           "use sandbox.mode='auto' or 'rlimit'")
    return config.mode


def _command(config: SandboxConfig, mode: str, workdir: str, uid: int) -> list[str]:
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        raise RuntimeError("the sandbox needs util-linux 'prlimit' on PATH (apt-get install util-linux)")
    mib = 1 << 20
    limits = [prlimit, f"--cpu={config.cpu_time}:{config.cpu_time + 1}", f"--as={config.memory_mb * mib}",
              f"--nproc={config.max_processes}", f"--fsize={config.max_file_mb * mib}", "--nofile=64",
              "--core=0", "--"]
    if mode == "rlimit":
        return limits + [sys.executable, "-I", os.path.join(workdir, "main.py")]
    # sh stays PID 1 of the namespace (a Python PID 1 would ignore SIGXCPU) and exits with Python's
    # status; when it exits the kernel kills everything else left in the namespace.
    inner = (_remount_script(_interpreter_paths(), workdir) + " && cd /tmp && "
             f"setpriv --reuid={uid} --regid={uid} --clear-groups --no-new-privs "
             f"\"$1\" -I /tmp/main.py")
    return limits + ["unshare", "--net", "--pid", "--fork", "--mount", "--mount-proc", "--kill-child", "--",
                     "sh", "-c", inner, workdir, sys.executable]


# The world-writable places the namespace mode replaces: the work dir goes on /tmp, a fresh 1 MiB
# tmpfs on each of the others.
_HIDDEN = ("/tmp", "/var/tmp", "/dev/shm")


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


@lru_cache(maxsize=1)
def _interpreter_paths() -> tuple[str, ...]:
    """Folders the interpreter needs that lie under a hidden place (:data:`_HIDDEN`).

    These are ``sys.prefix`` (a venv: ``pyvenv.cfg`` and its site-packages), ``sys.base_prefix`` /
    ``exec_prefix`` (the standard library) and the folders of ``sys.executable`` before and after
    resolving symlinks, each made absolute and real; nested ones are dropped. Folders elsewhere stay
    visible anyway, so they are not listed."""
    cands = set()
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
              os.path.dirname(os.path.abspath(sys.executable)), os.path.dirname(os.path.realpath(sys.executable))):
        for q in (os.path.abspath(p), os.path.realpath(p)):
            if any(_under(q, h) for h in _HIDDEN) and q not in _HIDDEN and os.path.isdir(q):
                cands.add(q)
    return tuple(sorted(p for p in cands if not any(p != o and _under(p, o) for o in cands)))


def _remount_script(keep: tuple[str, ...], workdir: str) -> str:
    """Shell commands (run as root inside the new mount namespace) that put the work dir on /tmp,
    fresh tmpfs on /var/tmp and /dev/shm, and then bind each folder of ``keep`` back read-only at
    its own path. Each kept folder is first bind-mounted onto a stage inside the work dir
    (``.host/<i>``), which the recursive bind of the work dir carries to ``/tmp/.host/<i>``; after
    the final bind the stage is unmounted and removed, so the program sees only the kept folders."""
    q = shlex.quote
    stage = [os.path.join(workdir, ".host", str(i)) for i in range(len(keep))]
    cmds = []
    for src, st in zip(keep, stage):
        cmds += [f"mkdir -p {q(st)}", f"mount --bind -o ro {q(src)} {q(st)}"]
    cmds += ['mount --rbind "$0" /tmp', "mount -t tmpfs -o size=1m tmpfs /var/tmp",
             "mount -t tmpfs -o size=1m tmpfs /dev/shm"]
    for i, dst in enumerate(keep):
        st = f"/tmp/.host/{i}"
        cmds += [f"mkdir -p {q(dst)}", f"mount --bind -o ro {st} {q(dst)}", f"umount {st}"]
    return " && ".join(cmds)


def _explain(rc: int | None, output: str, config: SandboxConfig) -> str | None:
    if rc == 0:
        return None
    sig = -rc if rc is not None and rc < 0 else (rc - 128 if rc is not None and rc > 128 else None)
    if sig == signal.SIGXCPU or sig == signal.SIGKILL:
        return f"CPU time limit: killed after {config.cpu_time} CPU s (signal {sig})"
    if sig is not None:
        return f"killed by signal {sig}"
    lines = [ln for ln in output.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else f"exit status {rc}"


async def arun_python(code: str, config: SandboxConfig | None = None) -> SandboxResult:
    """Run ``code`` (a Python program) in the sandbox without blocking the event loop.

    Args:
        code: program text; what it prints is the result.
        config: limits; ``SandboxConfig()`` when None.

    Returns: a :class:`SandboxResult`; violations are reported in ``error``, never raised.

    Raises:
        ValueError: a bad config field (named).
        RuntimeError: the host lacks ``prlimit`` (or ``unshare`` for mode="namespace").
    """
    config = config or SandboxConfig()
    check_section(config, "sandbox.")  # the sandbox.* rules of validate_config (one copy)
    mode = resolve_mode(config)
    uid = config.uid_base + (os.getpid() * 64 + next(_CALLS)) % 50000
    workdir = tempfile.mkdtemp(prefix="arealite_sbx_")
    start = time.monotonic()
    proc = None
    try:
        if mode == "rlimit":
            code = _AUDIT_PRELUDE.format(block_proc=os.geteuid() == 0, workdir=workdir) + code
        else:
            os.chown(workdir, uid, uid)
        with open(os.path.join(workdir, "main.py"), "w") as f:
            f.write(code)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp" if mode == "namespace" else workdir,
               # one BLAS/OpenMP thread: threads count against RLIMIT_NPROC (numpy would start one per core)
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        proc = await asyncio.create_subprocess_exec(
            *_command(config, mode, workdir, uid), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, cwd=workdir, env=env, start_new_session=True)
        buf, error = bytearray(), None
        deadline = start + config.timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                error = f"timeout: the program ran longer than {config.timeout} s (wall clock) and was killed"
                break
            try:
                chunk = await asyncio.wait_for(proc.stdout.read(65536), timeout=remaining)
            except asyncio.TimeoutError:
                continue
            if not chunk:
                break
            buf += chunk
            if len(buf) > config.max_output_bytes:
                del buf[config.max_output_bytes:]
                error = f"output limit: more than {config.max_output_bytes} bytes printed; the program was killed"
                break
        if error is not None:
            _kill_group(proc.pid)
            await _drain_and_wait(proc)
            rc = None
        else:
            try:
                rc = await asyncio.wait_for(proc.wait(), timeout=max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                _kill_group(proc.pid)
                await _drain_and_wait(proc)
                rc, error = None, f"timeout: the program ran longer than {config.timeout} s (wall clock) and was killed"
        output = buf.decode("utf-8", errors="replace")
        if error is None:
            error = _explain(rc, output, config)
        return SandboxResult(output=output, returncode=rc, error=error, mode=mode,
                             wall_time=time.monotonic() - start)
    finally:
        if proc is not None and proc.returncode is None:  # cancelled: never leave it running
            _kill_group(proc.pid)
        shutil.rmtree(workdir, ignore_errors=True)


def run_python(code: str, config: SandboxConfig | None = None) -> SandboxResult:
    """Blocking :func:`arun_python` (for scripts and tests; not from inside an event loop)."""
    return asyncio.run(arun_python(code, config))


async def _drain_and_wait(proc) -> None:
    # asyncio's wait() returns only once the pipe is closed, and a full reader stops reading it.
    while await proc.stdout.read(65536):
        pass
    await proc.wait()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
