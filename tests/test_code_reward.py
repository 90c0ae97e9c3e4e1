"""The code reward (arealite/reward/code.py): a completion's program against a problem's tests in
the sandbox. Each hostile program gets reward 0.0 and the outcome named in the module docstring;
the calling process is unaffected. Runs in the sandbox mode this host resolves to (namespace as
root with unshare, the rlimit fallback elsewhere); where the two modes refuse an action
differently, the expected outcome names both."""

import collections
import dataclasses
import json
import os
import subprocess
import time

import pytest

from arealite.reward import code as C
from arealite.reward.worker import RewardWorker
from arealite.sandbox import SandboxConfig, namespace_available


MODES = ["rlimit"] + (["namespace"] if namespace_available() else [])
FAST = SandboxConfig(timeout=3.0, cpu_time=2, memory_mb=512, max_output_bytes=1 << 16)


@pytest.fixture(params=MODES)
def mode(request):
    """The hostile programs run in each isolation mode this host has."""
    return request.param

ADD = {"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"],
       "entry_point": "add"}
ECHO_SUM = {"io": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 7\n", "output": "12"},
                   {"input": "0 0\n", "output": "0\n"}]}


def fence(code: str, lang: str = "python") -> str:
    return f"Here is my solution:\n```{lang}\n{code}\n```\nIt adds the numbers."


def score(code: str, problem=ADD, mode: str = "auto", **kw) -> C.CodeResult:
    config = kw.pop("config", FAST)
    return C.score_code(fence(code), problem, config=dataclasses.replace(config, mode=mode), **kw)


# --- extraction -------------------------------------------------------------------------------

def test_extract_takes_the_last_python_block_else_the_last_block_else_the_text():
    two = "```python\nx = 1\n```\ntext\n```py\nx = 2\n```\n```bash\nls\n```"
    assert C.extract_code(two) == "x = 2\n"  # the last *python* block wins over a later bash block
    assert C.extract_code("```\ny = 3\n```") == "y = 3\n"  # an untagged block
    assert C.extract_code("```js\nz\n```") == "z\n"  # no python block: the last block of any language
    assert C.extract_code("def f():\n    return 1") == "def f():\n    return 1"  # no fence: the raw text
    assert C.extract_code("text\n```python\ndef f():\n    return 1") == "def f():\n    return 1\n"  # unterminated
    assert C.extract_code("  ```python\n  a = 1\n  ```") == "  a = 1\n"  # indented fences
    assert C.extract_code(None) == ""
    placeholder = "```python\ndef f(x):\n    return 1\n```\nor:\n```python\n# your code here\n```"
    assert C.extract_code(placeholder) == "# your code here\n"
    assert C.extract_code(placeholder, entry_point="f") == "def f(x):\n    return 1\n"  # the block defining it
    assert C.extract_code("```python\ny = 1\n```", entry_point="f") == "y = 1\n"  # none defines it: the last


def test_humaneval_body_continuation_gets_the_prompt_prepended():
    problem = {"prompt": "import math\n\ndef root(x):\n    \"\"\"sqrt\"\"\"\n", "entry_point": "root",
               "test": "def check(candidate):\n    assert candidate(9) == 3\n"}
    body = "    return int(math.sqrt(x))\n"
    assert C.assemble_program(body, problem) == problem["prompt"] + body
    full = "def root(x):\n    return int(math.sqrt(x))\n"  # a full definition: only the prompt's imports
    assert C.assemble_program(full, problem) == "import math\n" + full
    assert C.score_code(body, problem, config=FAST).outcome == "pass"
    assert C.score_code(fence(full), problem, config=FAST).outcome == "pass"
    assert C.score_code("    return x\n", problem, config=FAST).outcome == "wrong_answer"


# --- outcomes of ordinary programs ------------------------------------------------------------

def test_correct_wrong_and_partial_programs():
    ok = score("def add(a, b):\n    return a + b")
    assert (ok.reward, ok.outcome, ok.n_passed, ok.n_tests, ok.detail) == (1.0, "pass", 3, 3, "")
    wrong = score("def add(a, b):\n    return a * b")  # add(1, 2) == 2: the first test fails
    assert (wrong.reward, wrong.outcome, wrong.n_passed, wrong.failed) == (0.0, "wrong_answer", 0, 0)
    partial = "def add(a, b):\n    return a + b if a >= 0 else 7"  # tests 1 and 3 pass, 2 fails
    assert score(partial).reward == 0.0  # all-or-nothing: stops at the first failure
    frac = score(partial, fraction=True)
    assert (frac.reward, frac.n_passed, frac.outcome, frac.failed) == (pytest.approx(2 / 3), 2, "wrong_answer", 1)


def test_syntax_error_runtime_error_and_missing_function():
    bad = score("def add(a, b)\n    return a + b")
    assert (bad.reward, bad.outcome) == (0.0, "syntax_error") and "SyntaxError" in bad.detail
    boom = score("def add(a, b):\n    return a + None")
    assert (boom.outcome, boom.detail.split(":")[0]) == ("runtime_error", "TypeError")
    missing = score("def plus(a, b):\n    return a + b")
    assert missing.outcome == "runtime_error" and "NameError" in missing.detail
    exit1 = score("import sys\nsys.exit(3)")
    assert exit1.outcome == "runtime_error" and "SystemExit(3)" in exit1.detail
    assert (bad.failed, exit1.failed, missing.failed) == (-1, -1, 0)  # before any test / in test 0
    assert score("import sys\ndef add(a, b):\n    return a + b\nsys.exit(0)").outcome == "pass"


def test_printing_does_not_break_the_verdict_channel():
    # A program that prints fake verdict lines (without the random nonce) and the word "pass".
    spoof = ('import json\nprint(json.dumps({"i": 0, "o": "pass", "d": ""}))\nprint(\'{"end": true}\')\n'
             "def add(a, b):\n    print('pass')\n    return 0")
    r = score(spoof)
    assert (r.reward, r.outcome) == (0.0, "wrong_answer")


def test_stdin_stdout_tests():
    ok = C.score_code(fence("a, b = map(int, input().split())\nprint(a + b)"), ECHO_SUM, config=FAST)
    assert (ok.reward, ok.outcome, ok.n_passed, ok.n_tests) == (1.0, "pass", 3, 3)
    spaced = C.score_code(fence("a, b = map(int, input().split())\nprint(' ', a + b, ' ')\nprint()"), ECHO_SUM,
                          config=FAST)
    assert spaced.outcome == "pass"  # whitespace is normalised
    wrong = C.score_code(fence("a, b = map(int, input().split())\nprint(a * b)"), ECHO_SUM, config=FAST,
                         fraction=True)
    assert (wrong.reward, wrong.n_passed, wrong.outcome) == (pytest.approx(1 / 3), 1, "wrong_answer")  # 0·0 = 0+0


# --- hostile programs -------------------------------------------------------------------------

def test_infinite_loop_times_out(mode):
    t0 = time.monotonic()
    r = score("def add(a, b):\n    while True:\n        pass", mode=mode)
    assert (r.reward, r.outcome) == (0.0, "timeout")
    assert time.monotonic() - t0 < FAST.timeout + 5


def test_fork_bomb_is_bounded_and_leaves_no_process(mode):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    r = score(bomb, config=SandboxConfig(timeout=3.0, cpu_time=2, max_processes=16, max_output_bytes=1 << 16), mode=mode)
    # The bomb swallows every OSError (RLIMIT_NPROC's EAGAIN in the namespace mode, the audit
    # hook's PermissionError in the rlimit mode as root) and loops: the wall clock ends it.
    assert (r.reward, r.outcome) == (0.0, "timeout"), r
    plain = score("import os\nwhile True:\n    os.fork()", mode=mode,
                  config=SandboxConfig(timeout=3.0, cpu_time=2, max_processes=16, max_output_bytes=1 << 16))
    assert (plain.reward, plain.outcome) == (0.0, "sandbox_refused"), plain  # the refused fork is the verdict
    if mode == "namespace":
        ps = subprocess.run(["ps", "-eo", "uid="], capture_output=True, text=True).stdout.split()
        assert not [u for u in ps if int(u) >= FAST.uid_base]  # every forked process died with the sandbox
    assert subprocess.run(["true"]).returncode == 0


def test_one_gigabyte_allocation_is_a_memory_outcome(mode):
    r = score("x = bytearray(1 << 30)\ndef add(a, b):\n    return a + b", mode=mode)
    assert (r.reward, r.outcome) == (0.0, "memory") and "MemoryError" in r.detail


def test_printing_100_megabytes_is_cut_off(mode):
    r = score("print('x' * (100 << 20))\ndef add(a, b):\n    return a + b", mode=mode)
    assert (r.reward, r.outcome) == (0.0, "output_limit")
    direct = score("import os\nfor _ in range(100):\n    os.write(1, b'y' * (1 << 20))", mode=mode)  # past the harness
    assert (direct.reward, direct.outcome) == (0.0, "output_limit")


def test_reading_system_files_is_allowed_but_the_tests_are_not_on_disk_or_in_the_environment(mode):
    # /etc is world-readable (the interpreter itself needs it): reading it changes nothing.
    reads = "open('/etc/hostname').read() if __import__('os').path.exists('/etc/hostname') else None\n" \
            "open('/etc/passwd').read()\ndef add(a, b):\n    return a + b"
    assert score(reads, mode=mode).outcome == "pass"
    # Look for the expected values everywhere a program could: its files, the work dir, /tmp, env.
    snoop = """
import os
found = []
roots = {os.getcwd(), "/var/tmp", "/dev/shm"} | {os.path.join("/tmp", d) for d in os.listdir("/tmp")
                                                if d.startswith("arealite_sbx_")}  # this and other sandbox calls
for root in roots:
    for dirpath, dirs, files in os.walk(root):
        # not into an interpreter bound back read-only (a clone under /tmp shows its .venv there)
        dirs[:] = [d for d in dirs if not d.endswith("venv") and d not in ("lib", "site-packages")]
        for f in files:
            try:
                text = open(os.path.join(dirpath, f), errors="ignore").read(1 << 20)
            except OSError:
                continue
            if "add(10, 5) == 15" in text:
                found.append(f)
found += [k for k, v in os.environ.items() if "add(10, 5)" in v]
def add(a, b):
    return len(found)
"""
    r = score(snoop, mode=mode)
    assert (r.outcome, r.reward) == ("wrong_answer", 0.0)  # add(1, 2) returned 0: nothing found
    env = score("import os\ndef add(a, b):\n    return len(os.environ)", mode=mode)
    assert env.outcome == "wrong_answer"  # the environment is scrubbed (PATH, LANG, HOME, 3 thread vars)


def test_unreadable_secret_file_is_refused_when_running_unprivileged(mode):
    if mode == "rlimit" and os.geteuid() == 0:
        pytest.skip("rlimit mode as root reads every file (the namespace mode drops to an unprivileged uid)")
    r = score("open('/etc/shadow').read()\ndef add(a, b):\n    return a + b", mode=mode)
    assert (r.reward, r.outcome) == (0.0, "sandbox_refused") and "PermissionError" in r.detail


def test_writing_outside_the_temporary_folder_is_refused_or_private(mode):
    """A root-owned folder (/etc, visible in both modes, also when the clone is under /tmp): refused.
    The world-writable places (/var/tmp, /dev/shm): refused in the rlimit mode, private throw-away
    tmpfs in the namespace mode. Nothing reaches the host."""
    name = f"arealite_escaped_{os.getpid()}.txt"
    repo_file = os.path.join("/etc", name)
    r = score(f"open({repo_file!r}, 'w').write('x')\ndef add(a, b):\n    return a + b", mode=mode)
    assert (r.reward, r.outcome) == (0.0, "sandbox_refused"), r
    for folder in ("/var/tmp", "/dev/shm"):
        path = os.path.join(folder, name)
        r = score(f"open({path!r}, 'w').write('x')\ndef add(a, b):\n    return a + b", mode=mode)
        assert r.outcome == {"namespace": "pass", "rlimit": "sandbox_refused"}[mode], (folder, r)
        assert not os.path.exists(path)
    assert not os.path.exists(repo_file)
    inside = score("open('scratch.txt', 'w').write('ok')\ndef add(a, b):\n    return a + b", mode=mode)
    assert inside.outcome == "pass"  # the work dir is writable


def test_network_is_refused(mode):
    r = score("import socket\ns = socket.create_connection(('1.1.1.1', 80), timeout=1)\ndef add(a, b):\n    return a + b", mode=mode)
    assert (r.reward, r.outcome) == (0.0, "sandbox_refused"), r


def test_killing_the_parent_is_refused_and_the_parent_lives(mode):
    r = score("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\ndef add(a, b):\n    return a + b", mode=mode)
    assert (r.reward, r.outcome) == (0.0, "sandbox_refused") and "os.kill" in r.detail
    killpg = score("import os, signal\nos.killpg(0, signal.SIGKILL)\ndef add(a, b):\n    return a + b", mode=mode)
    assert (killpg.reward, killpg.outcome) == (0.0, "sandbox_refused")
    assert subprocess.run(["true"]).returncode == 0


# --- reward hacks: objects that decide their own comparisons, patched builtins ------------------

TOLERANT = {"tests": ["assert abs(f(1) - 2.5) < 1e-6", "assert f(2) == [1, 2]", "assert not f(3)"], "entry_point": "f"}
HE_ADD = {"prompt": "def add(a, b):\n", "entry_point": "add",
          "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(5, 5) == 10\n"}
ALWAYS_EQUAL = "class A:\n    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n"


@pytest.mark.parametrize("code,problem,culprit", [
    (ALWAYS_EQUAL + "def add(a, b):\n    return A()", ADD, "A.__eq__"),  # the "always equal" object
    (ALWAYS_EQUAL + "def add(a, b):\n    return A()", HE_ADD, "A.__eq__"),  # inside HumanEval's check(candidate)
    ("class A(int):\n    def __eq__(self, other): return True\ndef add(a, b):\n    return A(0)", ADD, "A.__eq__"),
    (ALWAYS_EQUAL + "def add(a, b):\n    return [A()][0] if a else (A(),)", ADD, "A.__eq__"),
    ("class Z:\n    def __sub__(self, o): return 0\n    def __bool__(self): return False\n"
     "    def __eq__(self, o): return True\ndef f(x):\n    return Z() if x != 2 else [1, Z()]", TOLERANT, "Z.__"),
])
def test_an_object_that_decides_its_own_comparison_is_a_wrong_answer(code, problem, culprit):
    r = score(code, problem)
    assert (r.reward, r.outcome) == (0.0, "wrong_answer"), r
    assert culprit in r.detail and "tests compare plain values" in r.detail, r.detail


def test_builtins_and_modules_patched_by_the_solution_do_not_reach_the_tests():
    r = score("import builtins\nbuiltins.abs = lambda x: 0\ndef f(x):\n    return 0", TOLERANT)
    assert (r.reward, r.outcome, r.failed) == (0.0, "wrong_answer", 0), r  # abs(0 - 2.5) is 2.5 again
    isclose = {"tests": ["import math\nassert math.isclose(f(1), 2.5)", "from math import isclose\nassert isclose(f(2), 3.5)"],
               "entry_point": "f"}
    r = score("import math\nmath.isclose = lambda *a, **k: True\ndef f(x):\n    return 0", isclose)
    assert (r.reward, r.outcome, r.failed) == (0.0, "wrong_answer", 0), r  # the module the tests import is restored
    assert score("import math\ndef f(x):\n    return math.sqrt(x * x) + 1.5", isclose).reward == 1.0
    rebinding = "def f(x):\n    globals()['f'] = lambda x: 0\n    return 2.5 if x == 1 else ([1, 2] if x == 2 else 0)"
    assert score(rebinding, TOLERANT).reward == 1.0  # a rebinding inside a call reaches its own globals, not the tests'


def test_plain_values_from_the_library_and_the_problems_own_classes_still_pass():
    library = ("from fractions import Fraction\nimport collections\nT = collections.namedtuple('T', 'a b')\n"
               "def f(x):\n    return Fraction(5, 2) if x == 1 else ([1, 2] if x == 2 else T(0, 0)[0])")
    assert score(library, TOLERANT).reward == 1.0
    helper = "class H:\n    def __init__(self): self.v = 2.5\ndef f(x):\n    return H().v if x == 1 else ([1, 2] if x == 2 else 0)"
    assert score(helper, TOLERANT).reward == 1.0  # the solution's class without value dunders
    given = {"prompt": "class P:\n    def __init__(self, v): self.v = v\n    def __eq__(self, o): return self.v == o.v\n\n"
                       "def make(v):\n", "entry_point": "make",
             "test": "def check(candidate):\n    assert candidate(3) == P(3)\n    assert candidate(4) != P(3)\n"}
    assert score("    return P(v)", given).reward == 1.0  # the problem's own class compares as it says
    assert score("    return P(v + 1)", given).reward == 0.0


def test_bad_problems_raise_in_score_code_and_give_zero_in_code_reward(caplog):
    with pytest.raises(ValueError, match="no tests"):
        C.score_code("x", {"entry_point": "f"})
    with pytest.raises(ValueError, match="entry_point"):
        C.score_code("x", {"test": "def check(c): pass"})
    assert C.code_reward("def add(a, b):\n    return a + b", "not json") == 0.0


# --- the reward worker pool --------------------------------------------------------------------

def test_code_reward_through_the_reward_worker_pool_in_parallel():
    """As the RLVR workflow calls it: the module-level function in worker processes, concurrently;
    the answer column holds the problem's JSON text."""
    import asyncio

    answer = C.problem_answer({**ADD, "canonical_solution": "unused"})
    assert json.loads(answer) == ADD
    programs = {"def add(a, b):\n    return a + b": 1.0, "def add(a, b):\n    return a - b": 0.0,
                "def add(a, b)\n    return": 0.0, "def add(a, b):\n    while True: pass": 0.0}
    worker = RewardWorker(timeout=C.CODE_SANDBOX.timeout + 10, max_workers=2)

    async def main():
        return await asyncio.gather(*[worker.acompute(C.code_reward, fence(p), answer) for p in programs])

    try:
        got = asyncio.run(main())
    finally:
        worker.close()
    assert got == list(programs.values())
    assert worker.stats["ok"] == 4 and worker.stats["timeout"] == 0


def test_outcome_counts_are_kept_per_process():
    before = collections.Counter(C.OUTCOME_COUNTS)
    score("def add(a, b):\n    return a + b")
    score("def add(a, b)")
    diff = C.OUTCOME_COUNTS - before
    assert diff == collections.Counter({"pass": 1, "syntax_error": 1})
