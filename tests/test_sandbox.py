"""The sandbox contains hostile model-written code: every violation ends that call with an error
message for the model, and the calling (trainer) process carries on unaffected.

Each hostile case runs in both isolation modes available here: ``namespace`` (root + util-linux
unshare, the project machines) and the ``rlimit`` fallback. The fork bomb runs only where the
process limit is known to hold (checked first, inside the sandbox)."""

import asyncio
import os
import socket
import subprocess
import threading

import pytest

from arealite.sandbox import SandboxConfig, arun_python, namespace_available, run_python

from conftest import REPO_ROOT

MODES = ["rlimit"] + (["namespace"] if namespace_available() else [])


def _cfg(mode, **kw):
    return SandboxConfig(mode=mode, **{"timeout": 4.0, "cpu_time": 2, **kw})


def _trainer_unaffected():
    """The calling process can still fork, allocate and compute."""
    assert subprocess.run(["true"]).returncode == 0
    assert sum(bytearray(10**6)) == 0


@pytest.mark.parametrize("mode", MODES)
def test_ordinary_code_runs_and_prints(mode):
    r = run_python("import math\nprint(sum(range(101)), math.comb(5, 2))", _cfg(mode))
    assert r.ok and r.returncode == 0 and r.output == "5050 10\n" and r.mode == mode
    assert r.observation() == "5050 10"


@pytest.mark.parametrize("mode", MODES)
def test_infinite_loop_is_stopped_by_cpu_or_wall_limit(mode):
    r = run_python("while True:\n    pass", _cfg(mode))
    assert not r.ok and ("CPU time limit" in r.error or "timeout" in r.error), r.error
    _trainer_unaffected()


@pytest.mark.parametrize("mode", MODES)
def test_sleeping_program_is_killed_at_the_wall_clock_limit(mode):
    r = run_python("import time\nprint('start', flush=True)\ntime.sleep(60)", _cfg(mode, timeout=1.0))
    assert r.returncode is None and r.error.startswith("timeout") and r.output == "start\n"
    assert "[sandbox error] timeout" in r.observation()


@pytest.mark.parametrize("mode", MODES)
def test_memory_bomb_gets_memory_error(mode):
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(64 * 1024 * 1024))"
    r = run_python(code, _cfg(mode, memory_mb=256))
    assert r.error == "MemoryError", r.output[-500:]
    _trainer_unaffected()


@pytest.mark.parametrize("mode", MODES)
def test_huge_output_is_capped_and_the_program_killed(mode):
    r = run_python("while True:\n    print('x' * 1000)", _cfg(mode, max_output_bytes=5000))
    assert r.error.startswith("output limit") and r.returncode is None
    assert len(r.output.encode()) == 5000 and set(r.output) <= {"x", "\n"}


@pytest.mark.parametrize("mode", MODES)
def test_writing_outside_the_work_dir_fails(mode):
    target = os.path.join(REPO_ROOT, f"sandbox_pwned_{mode}.txt")  # a folder only root may write
    r = run_python(f"open({target!r}, 'w').write('x')", _cfg(mode))
    exists = os.path.exists(target)
    if exists:
        os.remove(target)
    assert not exists
    assert r.error.startswith("PermissionError"), r.output
    # the work dir itself is writable, and thrown away afterwards
    r = run_python("import os\nopen('note.txt', 'w').write('hi')\nprint(os.getcwd())", _cfg(mode))
    assert r.ok, r.output
    assert not os.path.exists(r.output.strip()) or r.output.strip() == "/tmp"


@pytest.mark.parametrize("mode", MODES)
def test_parent_environment_is_not_visible(mode, monkeypatch):
    monkeypatch.setenv("AREALITE_TEST_SECRET", "s3cret-value")
    code = ("import os\nprint(sorted(os.environ))\n"
            f"try:\n    print(open('/proc/{os.getpid()}/environ', 'rb').read())\n"
            "except Exception as e:\n    print('blocked', type(e).__name__)\n")
    r = run_python(code, _cfg(mode))
    assert r.ok, r.output
    assert "s3cret" not in r.output and "AREALITE_TEST_SECRET" not in r.output
    names = set(eval(r.output.splitlines()[0]))  # a printed list of names
    allowed = {"HOME", "LANG", "PATH", "PWD", "OLDPWD", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}
    assert {"HOME", "LANG", "PATH"} <= names <= allowed  # sh adds PWD
    assert r.output.splitlines()[1].startswith("blocked")


@pytest.mark.parametrize("mode", MODES)
def test_network_socket_cannot_connect(mode):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    r = run_python(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')",
                   _cfg(mode))
    assert not r.ok and "connected" not in r.output
    assert ("Network is unreachable" in r.error or "Connection refused" in r.error or "sandbox: socket" in r.error), r.error
    with pytest.raises(socket.timeout):
        server.accept()  # nothing reached the listener
    server.close()


def _sandbox_uids(base: int) -> set[int]:
    uids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        uid = int(line.split()[1])
                        if base <= uid < base + 50000:
                            uids.add(uid)
        except OSError:
            pass
    return uids


@pytest.mark.skipif("namespace" not in MODES, reason="fork-bomb containment needs the namespace mode (root + unshare)")
def test_fork_bomb_is_contained_and_leaves_no_process():
    cfg = _cfg("namespace", timeout=3.0, max_processes=16)
    # Limits first: the code must run unprivileged with RLIMIT_NPROC in force, else we do not fork-bomb.
    probe = run_python("import os, resource\nprint(os.getuid(), resource.getrlimit(resource.RLIMIT_NPROC)[0])", cfg)
    uid, nproc = map(int, probe.output.split())
    assert uid != 0 and nproc == 16
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = run_python(bomb, cfg)
    assert r.error.startswith("timeout") and r.returncode is None
    assert not _sandbox_uids(cfg.uid_base)  # every forked process died with the namespace
    _trainer_unaffected()


def test_rlimit_mode_as_root_refuses_process_creation():
    if os.geteuid() != 0:
        pytest.skip("as non-root, RLIMIT_NPROC itself bounds processes")
    r = run_python("import os\nos.fork()", _cfg("rlimit"))
    assert r.error == "PermissionError: sandbox: os.fork is not allowed"
    r = run_python("import ctypes\nctypes.CDLL(None).fork()", _cfg("rlimit"))
    assert r.error == "PermissionError: sandbox: ctypes access to 'fork' is not allowed"


def test_concurrent_calls_from_an_event_loop_in_a_thread():
    """As in the rollout executor: an asyncio loop in a background thread runs many calls at once."""
    out = {}

    def worker():
        async def main():
            return await asyncio.gather(*[arun_python(f"print({i} * {i})") for i in range(4)],
                                        arun_python("while True: pass", SandboxConfig(timeout=1.0)))
        out["results"] = asyncio.run(main())

    t = threading.Thread(target=worker)
    t.start()
    t.join(timeout=60)
    results = out["results"]
    assert [r.output for r in results[:4]] == ["0\n", "1\n", "4\n", "9\n"]
    assert not results[4].ok


@pytest.mark.parametrize("mode", MODES)
def test_numpy_and_sympy_work_within_the_limits(mode):
    r = run_python("import numpy as np, sympy\nprint(int(np.arange(5).sum()), sympy.factorint(12))", _cfg(mode))
    assert r.output == "10 {2: 2, 3: 1}\n", r.output


def test_bad_config_is_rejected_before_running():
    with pytest.raises(ValueError, match="sandbox.memory_mb"):
        run_python("print(1)", SandboxConfig(memory_mb=16))
    with pytest.raises(ValueError, match="sandbox.timeout"):
        run_python("print(1)", SandboxConfig(timeout=0))


_PROBE = """\
import os, sys, sbx_probe
print(sys.prefix)
print(sbx_probe.VALUE)
print(os.path.exists({secret!r}))
mounts = [ln.split() for ln in open('/proc/self/mountinfo')]
print([m[5].split(',')[0] for m in mounts if m[4] == sys.prefix])
try:
    open(sbx_probe.__file__, 'a')
    print('writable')
except OSError as e:
    print('refused', e.errno)
"""


@pytest.mark.skipif("namespace" not in MODES, reason="the hidden folders exist only in the namespace mode")
@pytest.mark.parametrize("base", ["/tmp", "/var/tmp", "repo"])
def test_interpreter_under_a_hidden_folder_is_bound_back_read_only(base):
    """A venv (and so sys.executable) under /tmp or /var/tmp — a fresh clone in /tmp — or anywhere
    else: the sandboxed program still starts, imports from that venv's site-packages, cannot write
    there (read-only bind), and sees nothing else of the host's /tmp."""
    import shutil
    import sys
    import sysconfig
    import tempfile

    parent = REPO_ROOT if base == "repo" else base
    root = tempfile.mkdtemp(prefix="sbx_venv_", dir=parent)
    os.chmod(root, 0o755)  # like a clone: readable by the sandbox's unprivileged uid
    secret = os.path.join(base if base != "repo" else "/tmp", f"sbx_secret_{os.getpid()}")
    try:
        venv = os.path.join(root, "venv")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
        site = os.path.join(venv, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}", "site-packages")
        with open(os.path.join(site, "sbx_probe.py"), "w") as f:
            f.write("VALUE = 42\n")
        with open(secret, "w") as f:
            f.write("host secret")
        driver = ("import sys\nfrom arealite.sandbox import run_python, SandboxConfig\n"
                  f"r = run_python({_PROBE.format(secret=secret)!r}, SandboxConfig(mode='namespace', timeout=10))\n"
                  "print(repr(r.error)); sys.stdout.write(r.output)")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO_ROOT, sysconfig.get_paths()["purelib"]])}
        out = subprocess.run([os.path.join(venv, "bin", "python"), "-c", driver], env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0] == "None", out.stdout
        assert lines[1] == venv and lines[2] == "42"
        assert lines[3] == "False"  # the rest of the host's /tmp (or /var/tmp) stays hidden
        if base != "repo":
            assert lines[4] == "['ro']"  # bound back read-only at its own path
        assert lines[5].startswith("refused")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if os.path.exists(secret):
            os.remove(secret)
