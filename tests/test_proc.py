"""arealite/utils/proc.py: the free-port helper and children that die with their parent."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from arealite.utils.proc import free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("host", ["127.0.0.1", ""])
def test_free_port_can_be_bound_on_the_host_it_was_asked_for(host):
    port = free_port(host)
    assert 1024 <= port <= 65535
    with socket.socket() as s:  # free on that address right after the call
        s.bind((host, port))
        assert s.getsockname()[1] == port


def test_free_port_of_a_foreign_address_raises():
    with pytest.raises(OSError):
        free_port("192.0.2.1")  # TEST-NET-1: not an address of this machine


# --------------------------------------------------------------------------------- dying with the parent
def _gone(pid: int) -> bool:
    """No such process, or a zombie (exited; this container's init may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _kill_parent_and_wait(parent_code: str, timeout: float = 10.0) -> tuple[bool, bool]:
    """Run ``parent_code`` (it prints its child's pid, then sleeps); SIGKILL it; returns
    (child alive before the kill, child gone within ``timeout`` s after it)."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(parent_code)], stdout=subprocess.PIPE,
                              text=True, cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    try:
        child = int(parent.stdout.readline())
        time.sleep(0.5)
        alive_before = not _gone(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + timeout
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        gone = _gone(child)
        if not gone:
            os.kill(child, signal.SIGKILL)
        return alive_before, gone
    finally:
        parent.kill()


def test_exit_when_parent_dies_ends_a_child_whose_parent_was_sigkilled():
    alive, gone = _kill_parent_and_wait("""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import os, time; "
                                  "from arealite.utils.proc import exit_when_parent_dies; "
                                  "exit_when_parent_dies(os.getppid(), poll_s=0.05); time.sleep(60)"])
        print(child.pid, flush=True)
        time.sleep(60)
    """)
    assert alive and gone


def test_reward_workers_exit_when_the_trainer_is_sigkilled():
    alive, gone = _kill_parent_and_wait("""
        import time
        from arealite.reward.worker import RewardWorker
        w = RewardWorker(timeout=60, max_workers=1)
        assert w.compute(max, 2.0, 3.0) == 3.0  # the worker is up
        print(next(iter(w._pool._processes)), flush=True)
        time.sleep(60)
    """, timeout=15)
    assert alive and gone


def test_die_with_parent_kills_a_foreign_command_whose_parent_was_sigkilled():
    alive, gone = _kill_parent_and_wait("""
        import subprocess, time
        from arealite.utils.proc import die_with_parent
        child = subprocess.Popen(["sleep", "60"], preexec_fn=die_with_parent)
        print(child.pid, flush=True)
        time.sleep(60)
    """)
    assert alive and gone


def test_die_with_parent_fires_when_the_starting_thread_ends():
    """Why reward workers and local servers poll instead: the signal follows the parent *thread*."""
    alive, gone = _kill_parent_and_wait("""
        import subprocess, threading, time
        from arealite.utils.proc import die_with_parent
        box = []
        t = threading.Thread(target=lambda: box.append(subprocess.Popen(["sleep", "60"], preexec_fn=die_with_parent)))
        t.start(); t.join()
        print(box[0].pid, flush=True)
        time.sleep(60)
    """)
    assert not alive and gone  # dead already, while its parent process still ran


def test_return_free_heap_to_os_gives_back_freed_chunks_glibc_keeps():
    """125 MiB of 64 KiB chunks (below glibc's mmap threshold, so on the heap) freed below a chunk
    still in use: glibc's own trim at free() cannot shrink the heap, malloc_trim(0) can."""
    script = textwrap.dedent("""
        from arealite.utils.proc import return_free_heap_to_os
        def rss():
            with open("/proc/self/status") as f:
                return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) / 1024
        blocks = [b"x" * 65536 for _ in range(2000)]
        keep = blocks[-1]
        del blocks
        before = rss()
        print(return_free_heap_to_os(), before, rss())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT,
                         check=True).stdout.split()
    if out[0] == "False":
        pytest.skip("not glibc: no malloc_trim")
    before, after = float(out[1]), float(out[2])
    assert before - after > 100, (before, after)  # [MiB]
