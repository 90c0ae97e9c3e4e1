"""Code reward: run a completion's program against a problem's tests in the sandbox.

The program runs in :mod:`arealite.sandbox` (namespaces + rlimits, or the rlimit fallback), inside
a small harness that executes the tests and reports one JSON line per test, tagged with a random
nonce, on the real stdout (file descriptor 1). The candidate's own ``print`` output goes to a capped
in-memory buffer, never to the verdict channel.

Problem format (a dict, or its JSON text as the row's ``answer`` field, see :func:`problem_answer`):

* function tests: ``{"tests": ["assert f(1) == 2", ...], "entry_point": "f"}`` (each assert is one
  test), or HumanEval style ``{"test": "def check(candidate): ...", "entry_point": "f",
  "prompt": "def f(...):\\n    \\"\\"\\"...\\"\\"\\"\\n"}`` (one test: ``check(f)``).
* stdin/stdout tests: ``{"io": [{"input": "1 2\\n", "output": "3\\n"}, ...]}``: the program runs once
  per pair with that stdin; outputs compare after whitespace normalisation (each line's runs of
  whitespace collapsed, leading/trailing blank space of the whole output dropped).

Outcomes (:data:`OUTCOMES`, one per scored program; the first failing test decides):

* ``pass``: every test passed.
* ``wrong_answer``: an ``assert`` failed (function tests) or the output differed (stdin/stdout).
* ``syntax_error``: the extracted program does not compile (checked before anything runs).
* ``timeout``: the sandbox's wall-clock or CPU-time limit ended the program (infinite loop, a
  fork bomb that keeps retrying).
* ``runtime_error``: any other exception (TypeError, RecursionError, ...), a non-zero
  ``sys.exit``, death by a signal, or a program that exited before the tests finished.
* ``memory``: ``MemoryError`` (RLIMIT_AS of the sandbox; e.g. a 1 GB allocation).
* ``output_limit``: the program printed more than ``max_stdout_bytes`` (harness cap), or wrote
  past the sandbox's ``max_output_bytes`` to file descriptor 1 directly.
* ``sandbox_refused``: the sandbox or harness refused an action: ``PermissionError`` (writing
  outside the work dir, the rlimit mode's audit hooks, ``os.kill`` of another process), or an
  ``OSError`` whose errno means "not allowed/unreachable" (ENETUNREACH, EACCES, EPERM, EAGAIN from
  a refused fork, ...); also the host could not start the sandbox at all.

Reward: 1.0 when every test passes, else 0.0 (:func:`code_reward`); or the fraction of tests
passed (:func:`code_reward_fraction`). Tests after a failure are not run in the all-pass mode.

Code extraction (:func:`extract_code`): the last fenced block tagged python/py/python3 that defines
the entry point (else the last such block), else the last fenced block of any language, else the
raw text; an unterminated fence runs to the end of the text. HumanEval style: when the extracted code does not define the ``entry_point`` and the problem
has a ``prompt``, the prompt is prepended (the completion continues the function body); the
prompt's import lines are always prepended.

Harness guard rails (in the sandboxed process, not a security boundary): the harness file is
deleted before the candidate runs (the tests' source is not on disk), ``os.kill``/``os.killpg`` of
any process but itself are refused by an audit hook (in the rlimit mode the parent is the reward
worker), verdicts from forked children are dropped. The tests run in globals of their own, with
the builtins as they were before the program ran, and call the program's functions through a
wrapper that fails the test (``wrong_answer``) when the returned value holds an object whose class
the program wrote with a value method (``__eq__``, ``__lt__``, ``__bool__``, ``__sub__``, ``__len__``,
``__str__``, ``__getattr__``, ...): the "always equal" reward hack. Classes defined in the problem's
``prompt`` are exempt. The modules the tests' source imports are imported before the program
runs and restored after it (``math.isclose = lambda *a, **k: True`` does not reach the tests). The tests still live in the harness's memory,
so a program that introspects its caller's frames could find them.

All functions are module-level and picklable: ``code_reward`` runs under
:class:`arealite.reward.worker.RewardWorker` (``reward_fn="arealite.reward.code:code_reward"``).
Outcome counts of this process: :data:`OUTCOME_COUNTS`; a worker's counts stay in the worker, so
callers that need them per batch call :func:`score_code` (it returns the outcome).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import re
import secrets
import threading
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from arealite.sandbox import SandboxConfig, SandboxResult, arun_python

__all__ = ["OUTCOMES", "OUTCOME_COUNTS", "CODE_SANDBOX", "CodeResult", "extract_code", "assemble_program",
           "problem_answer", "visible_problem", "test_source", "ascore_code", "ascore_many", "score_code",
           "run_sync", "code_reward", "code_reward_fraction"]
logger = logging.getLogger("arealite.reward")

OUTCOMES = ("pass", "wrong_answer", "syntax_error", "timeout", "runtime_error", "memory", "output_limit",
            "sandbox_refused")
OUTCOME_COUNTS: collections.Counter = collections.Counter()  # this process's scored programs by outcome
# Default limits of one scored program (all of its tests run in one sandbox call).
CODE_SANDBOX = SandboxConfig(timeout=5.0, cpu_time=5, memory_mb=512, max_output_bytes=1 << 16)
MAX_STDOUT_BYTES = 1 << 20  # what the candidate may print per program run (harness cap) [bytes]
MAX_CODE_CHARS = 100_000  # longer extracted programs are cut (a syntax error at worst)


@dataclass
class CodeResult:
    """One scored program.

    Attributes:
        reward: 1.0/0.0 (all-pass mode) or n_passed / n_tests (fraction mode).
        outcome: one of :data:`OUTCOMES`.
        n_passed: tests passed (tests after the first failure are not run in all-pass mode).
        n_tests: tests of the problem.
        code: the code the extractor took from the completion (before any prompt was prepended).
        detail: a short reason (the failing test's exception or the sandbox error), "" on pass.
        failed: index of the first failing test in the problem's test list, -1 when none failed
            or the program failed before any test ran (syntax error, top-level crash, timeout).
    """

    reward: float
    outcome: str
    n_passed: int
    n_tests: int
    code: str
    detail: str = ""
    failed: int = -1


_FENCE = re.compile(r"^[ \t]*```[ \t]*([A-Za-z0-9_+.#-]*)")
_PY_TAGS = {"python", "py", "python3", "py3"}


def extract_code(text: str, entry_point: str | None = None) -> str:
    """The program in a completion: the last ```python block that defines ``entry_point`` (when
    given and one does), else the last ```python block, else the last fenced block of any
    language, else ``text`` itself. A fence line is a line starting (after blanks) with three
    backticks; an opening fence without a closing one runs to the end of the text. (Models often
    end with a placeholder block such as ``# your code here`` after the real one.)"""
    if not isinstance(text, str):
        return ""
    blocks: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if current is None:
            if m:
                current = []
                blocks.append((m.group(1).lower(), current))
        elif m and not m.group(1) and line.strip().strip("`") == "":
            current = None  # a closing fence
        elif m and m.group(1):  # a new opening fence inside an unterminated block: start over
            current = []
            blocks.append((m.group(1).lower(), current))
        else:
            current.append(line)
    if not blocks:
        return text
    py = [b for b in blocks if b[0] in _PY_TAGS] or blocks
    if entry_point:
        py = [b for b in py if _defines("\n".join(b[1]), entry_point)] or py
    lang, lines = py[-1]
    return "\n".join(lines) + "\n"


def _defines(code: str, name: str) -> bool:
    return bool(re.search(rf"^\s*(async\s+)?def\s+{re.escape(name)}\s*\(|^\s*{re.escape(name)}\s*=", code, re.M))


def assemble_program(code: str, problem: dict) -> str:
    """The program that runs: ``code``, with the HumanEval prompt prepended when ``code`` does
    not define the problem's ``entry_point`` (a body continuation), and the prompt's import lines
    before it otherwise."""
    prompt, entry = problem.get("prompt") or "", problem.get("entry_point") or ""
    if prompt and entry and not _defines(code, entry):
        return prompt + code
    imports = [ln for ln in prompt.splitlines() if ln.startswith(("import ", "from "))]
    return ("\n".join(imports) + "\n" + code) if imports else code


def problem_answer(problem: dict) -> str:
    """The problem as the JSON text a dataset row carries in ``answer`` (what :func:`code_reward`
    takes), keeping only the fields the reward reads."""
    keys = ("tests", "test", "io", "entry_point", "prompt")
    return json.dumps({k: problem[k] for k in keys if problem.get(k) is not None})


def visible_problem(problem: dict | str, k: int) -> dict:
    """The problem with only its first ``k`` tests (asserts or stdin/stdout pairs): what a code agent
    may see between turns, while the whole list stays hidden for the reward. A HumanEval-style
    ``check`` is one test and is kept whole.

    Raises:
        ValueError: ``k`` < 1, or a malformed problem (as :func:`ascore_code`).
    """
    if not (isinstance(k, int) and k >= 1):
        raise ValueError(f"visible tests k={k!r}: must be an int >= 1")
    problem = dict(_as_problem(problem))
    _tests_of(problem)  # a malformed problem fails here
    for key in ("io", "tests"):
        if problem.get(key):
            problem[key] = list(problem[key])[:k]
            break
    return problem


def test_source(problem: dict | str, i: int) -> str:
    """Test ``i`` of the problem as text for the model: the assert, the HumanEval ``check`` body,
    or ``input``/``expected output`` of a stdin/stdout pair."""
    style, tests = _tests_of(_as_problem(problem))
    t = tests[i]
    if style == "stdio":
        return f"input:\n{t['input']}\nexpected output:\n{t['output']}"
    return t.replace("\n\ncheck(", "\ncheck(").strip()


def _as_problem(problem: Any) -> dict:
    if isinstance(problem, str):
        problem = json.loads(problem)
    if not isinstance(problem, dict):
        raise ValueError(f"problem must be a dict or its JSON text, got {type(problem).__name__}")
    return problem


def _tests_of(problem: dict) -> tuple[str, list]:
    """("function", [test source, ...]) or ("stdio", [{"input", "output"}, ...])."""
    if problem.get("io"):
        cases = [{"input": str(c.get("input", "")), "output": str(c.get("output", ""))} for c in problem["io"]]
        return "stdio", cases
    if problem.get("test"):
        entry = problem.get("entry_point")
        if not entry:
            raise ValueError("a HumanEval-style 'test' needs the problem's 'entry_point'")
        return "function", [problem["test"] + f"\n\ncheck({entry})\n"]
    if problem.get("tests"):
        return "function", [str(t) for t in problem["tests"]]
    raise ValueError("problem has no tests: give 'tests' (asserts), 'test' + 'entry_point' (HumanEval) or 'io'")


# The harness: runs in the sandbox; the payload (code, tests, nonce) is appended as a JSON literal.
_HARNESS = r'''
def _harness(_payload):
    import builtins, errno, functools, io, itertools, json, os, sys, types
    P = json.loads(_payload)
    del _payload
    me, nonce, limit = os.getpid(), P["nonce"], P["max_stdout"]
    clean_builtins = dict(vars(builtins))  # before the solution runs: what it does to builtins stays out of the tests
    try:
        os.remove(os.path.abspath(__file__))  # the tests are not left on disk
    except Exception:
        pass

    def hook(event, args):
        if event in ("os.kill", "os.killpg") and not (event == "os.kill" and args[0] == os.getpid()):
            raise PermissionError(f"sandbox: {event} of another process is not allowed")
    sys.addaudithook(hook)

    class OutputLimit(Exception):
        pass

    class Cap(io.StringIO):
        exceeded = False
        def write(self, s):
            if self.exceeded or self.tell() + len(s) > limit:
                self.exceeded = True
                raise OutputLimit(f"printed more than {limit} bytes")
            return super().write(s)

    refused = {errno.EPERM, errno.EACCES, errno.ENETUNREACH, errno.ENETDOWN, errno.EROFS, errno.EAGAIN,
               errno.EHOSTUNREACH, errno.EAFNOSUPPORT}

    def classify(e, cap):
        if cap.exceeded or isinstance(e, OutputLimit):
            return "output_limit"
        if isinstance(e, AssertionError):
            return "wrong_answer"
        if isinstance(e, MemoryError):
            return "memory"
        if isinstance(e, SyntaxError):
            return "syntax_error"
        if isinstance(e, PermissionError) or (isinstance(e, OSError) and e.errno in refused):
            return "sandbox_refused"
        return "runtime_error"

    def emit(rec):
        if os.getpid() != me:  # a forked child never reports
            os._exit(1)
        rec["n"] = nonce
        os.write(1, ("\n" + json.dumps(rec) + "\n").encode())

    def run(code, g, cap, stdin=""):
        sys.stdout = sys.stderr = sys.__stdout__ = sys.__stderr__ = cap
        sys.stdin = sys.__stdin__ = io.StringIO(stdin)
        try:
            exec(code, g)
            return None
        except SystemExit as e:
            if e.code in (None, 0):
                return None
            return ("runtime_error", f"SystemExit({e.code!r})")
        except BaseException as e:
            return (classify(e, cap), f"{type(e).__name__}: {e}"[:300])
        finally:
            if os.getpid() != me:
                os._exit(1)
            if cap.exceeded:
                pass

    def norm(s):
        return [" ".join(ln.split()) for ln in s.strip().splitlines()]

    # A value decides what a test sees of it through these: ==, <, bool(), abs(x - y), len(), str(), isinstance.
    dunders = {"__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__bool__", "__len__", "__abs__", "__neg__",
               "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
               "__mod__", "__pow__", "__round__", "__float__", "__int__", "__index__", "__str__", "__repr__",
               "__format__", "__hash__", "__contains__", "__iter__", "__getitem__", "__getattr__", "__getattribute__",
               "__class__", "__instancecheck__"}
    roots = tuple({os.path.join(os.path.realpath(p), "") for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
    builtin_code = (types.WrapperDescriptorType, types.MethodDescriptorType, types.BuiltinFunctionType,
                    types.MethodWrapperType, types.ClassMethodDescriptorType, type(None))

    def own_dunder(t):
        """'Class.__eq__' when class t (not one of the problem's own) has a value dunder the solution
        wrote (Python code outside the installed interpreter and packages), else None."""
        if t.__qualname__ in P["given"]:
            return None
        for c in t.__mro__[:-1]:
            for name in sorted(dunders & vars(c).keys()):
                fn = getattr(vars(c)[name], "__func__", vars(c)[name])
                if isinstance(fn, builtin_code):
                    continue
                code = getattr(fn, "__code__", None)
                if code is None or not os.path.realpath(code.co_filename).startswith(roots):
                    return f"{c.__qualname__}.{name}"
        return None

    def foreign(value):
        stack, seen = [value], 0
        while stack and seen < 10000:
            x = stack.pop()
            seen += 1
            t = type(x)
            if t in (list, tuple, set, frozenset):
                stack.extend(itertools.islice(x, 10000))
            elif t is dict:
                stack.extend(itertools.islice(itertools.chain.from_iterable(x.items()), 20000))
            elif t not in (int, float, str, bool, bytes, complex, type(None)) and (bad := own_dunder(t)):
                return bad
        return None

    def plain_results(f, name):
        """``f`` whose return value may not hold an object of the solution's own class that defines
        how it compares or reads (the "always equal" object): such a call fails the test."""
        @functools.wraps(f)
        def call(*args, **kwargs):
            value = f(*args, **kwargs)
            if (bad := foreign(value)) is not None:
                raise AssertionError(f"{name}() returned an object whose {bad} the solution defines: "
                                     "tests compare plain values")
            return value
        return call

    try:
        code = compile(P["code"], "<solution>", "exec")
    except BaseException as e:
        emit({"i": -1, "o": "syntax_error", "d": f"{type(e).__name__}: {e}"[:300]})
        emit({"end": True})
        return
    if P["style"] == "function":
        modules = []  # the modules the tests import, as they were before the solution ran
        for name in P["imports"]:
            try:
                m = __import__(name, fromlist=["_"])
                modules.append((m, dict(vars(m))))
            except Exception:
                pass
        g = {"__name__": "solution", "__builtins__": builtins}
        cap = Cap()
        bad = run(code, g, cap)
        if bad is None and cap.exceeded:
            bad = ("output_limit", "printed too much")
        if bad is not None:
            emit({"i": -1, "o": bad[0], "d": bad[1]})
            emit({"end": True})
            return
        # The tests see the solution's functions through plain_results, in their own globals with the
        # builtins as they were before the solution ran (a rebinding inside a call does not reach them).
        gt = {k: plain_results(v, k) if isinstance(v, types.FunctionType) and v.__code__.co_filename == "<solution>"
              else v for k, v in g.items()}
        gt["__builtins__"] = clean_builtins
        for m, saved in modules:  # "math.isclose = lambda *a, **k: True" does not reach the tests either
            vars(m).clear()
            vars(m).update(saved)
        for i, t in enumerate(P["tests"]):
            cap = Cap()
            try:
                tc = compile(t, f"<test {i}>", "exec")
            except BaseException as e:
                emit({"i": i, "o": "runtime_error", "d": f"bad test: {type(e).__name__}: {e}"[:300]})
                break
            bad = run(tc, gt, cap)
            if bad is None and cap.exceeded:
                bad = ("output_limit", "printed too much")
            emit({"i": i, "o": "pass", "d": ""} if bad is None else {"i": i, "o": bad[0], "d": bad[1]})
            if bad is not None and not P["fraction"]:
                break
    else:
        for i, case in enumerate(P["tests"]):
            cap = Cap()
            bad = run(code, {"__name__": "__main__", "__builtins__": builtins}, cap, case["input"])
            if bad is None and cap.exceeded:
                bad = ("output_limit", "printed too much")
            if bad is None and norm(cap.getvalue()) != norm(case["output"]):
                bad = ("wrong_answer", f"output {cap.getvalue()[:100]!r} != expected {case['output'][:100]!r}")
            emit({"i": i, "o": "pass", "d": ""} if bad is None else {"i": i, "o": bad[0], "d": bad[1]})
            if bad is not None and not P["fraction"]:
                break
    emit({"end": True})
'''


def _parse(result: SandboxResult, nonce: str) -> tuple[list[dict], bool]:
    records, ended = [], False
    for line in result.output.splitlines():
        if nonce not in line:
            continue
        try:
            rec = json.loads(line.strip())
        except ValueError:
            continue
        if not isinstance(rec, dict) or rec.get("n") != nonce:
            continue
        if rec.get("end"):
            ended = True
        else:
            records.append(rec)
    return records, ended


def _sandbox_outcome(result: SandboxResult) -> str:
    err = result.error or ""
    if err.startswith("timeout") or err.startswith("CPU time limit"):
        return "timeout"
    if err.startswith("output limit"):
        return "output_limit"
    if "MemoryError" in err:
        return "memory"
    return "runtime_error"


def _finish(code: str, n: int, passed: int, outcome: str, detail: str, fraction: bool, failed: int = -1) -> CodeResult:
    reward = (passed / n if n else 0.0) if fraction else (1.0 if n and passed == n else 0.0)
    OUTCOME_COUNTS[outcome] += 1
    logger.debug("code reward %.3f outcome=%s passed=%d/%d %s", reward, outcome, passed, n, detail)
    return CodeResult(reward=reward, outcome=outcome, n_passed=passed, n_tests=n, code=code, detail=detail,
                      failed=failed)


async def ascore_code(completion: str, problem: dict | str, fraction: bool = False,
                      config: SandboxConfig | None = None, max_stdout_bytes: int = MAX_STDOUT_BYTES) -> CodeResult:
    """Score ``completion`` against ``problem``'s tests in one sandbox call (see the module doc).

    Args:
        completion: the model's text (code extracted by :func:`extract_code`).
        problem: a problem dict or its JSON text (module doc).
        fraction: reward = fraction of tests passed (all tests run) instead of all-or-nothing.
        config: sandbox limits (:data:`CODE_SANDBOX` when None); ``max_output_bytes`` is raised to
            at least 64 KiB so the verdict lines fit.
        max_stdout_bytes: how much the candidate may print per run before ``output_limit``.

    Returns: a :class:`CodeResult`.

    Raises:
        ValueError: a malformed problem (no tests, HumanEval test without entry point, bad JSON).
    """
    problem = _as_problem(problem)
    style, tests = _tests_of(problem)
    n = len(tests)
    code = extract_code(completion, problem.get("entry_point"))[:MAX_CODE_CHARS]
    program = assemble_program(code, problem)
    try:
        compile(program, "<solution>", "exec")
    except BaseException as e:  # SyntaxError, ValueError (NUL bytes), RecursionError, MemoryError
        return _finish(code, n, 0, "syntax_error", f"{type(e).__name__}: {e}"[:300], fraction)
    cfg = config or CODE_SANDBOX
    cfg = dataclasses.replace(cfg, max_output_bytes=max(cfg.max_output_bytes, 1 << 16))
    nonce = secrets.token_hex(16)
    given = sorted(set(re.findall(r"^\s*class\s+([A-Za-z_]\w*)", problem.get("prompt") or "", re.M)))
    payload = json.dumps({"nonce": nonce, "code": program, "style": style, "tests": tests, "fraction": fraction,
                          "max_stdout": int(max_stdout_bytes), "given": given,
                          "imports": sorted(set(re.findall(r"^\s*(?:import|from)\s+([\w.]+)", "\n".join(map(str, tests)), re.M)))
                          if style == "function" else []})
    source = _HARNESS + f"\n_harness({payload!r})\n"
    try:
        result = await arun_python(source, cfg)
    except (RuntimeError, OSError) as e:  # the host could not start the sandbox
        logger.warning("code reward: the sandbox could not run (%r); reward=0.0", e)
        return _finish(code, n, 0, "sandbox_refused", f"sandbox unavailable: {e}"[:300], fraction)
    records, ended = _parse(result, nonce)
    passed = sum(1 for r in records if r.get("o") == "pass")
    failed, first = [r for r in records if r.get("o") != "pass"], -1
    if failed:
        outcome, detail = failed[0].get("o", "runtime_error"), str(failed[0].get("d", ""))
        if outcome not in OUTCOMES:
            outcome = "runtime_error"
        i = failed[0].get("i")  # -1: the program's own top level failed, before any test
        first = i if isinstance(i, int) and 0 <= i < n else -1
    elif not ended:  # the program was stopped (or stopped itself) before the tests finished
        outcome = _sandbox_outcome(result) if result.error else "runtime_error"
        detail = result.error or "the program exited before the tests finished"
    elif passed == n:
        outcome, detail = "pass", ""
    else:
        outcome, detail = "runtime_error", f"only {passed} of {n} tests reported"
    return _finish(code, n, passed, outcome, detail, fraction, first)


def run_sync(make_coro: Callable[[], Awaitable[Any]]) -> Any:
    """``asyncio.run(make_coro())`` from synchronous code, in a helper thread when the calling
    thread already runs an event loop (e.g. a workflow's in-process evaluation). Exceptions of the
    coroutine are re-raised here."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make_coro())
    box: list = []

    def target() -> None:
        try:
            box.append(asyncio.run(make_coro()))
        except BaseException as e:  # re-raised below
            box.append(e)

    t = threading.Thread(target=target, name="arealite-run-sync")
    t.start()
    t.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def score_code(completion: str, problem: dict | str, fraction: bool = False,
               config: SandboxConfig | None = None, max_stdout_bytes: int = MAX_STDOUT_BYTES) -> CodeResult:
    """Blocking :func:`ascore_code` (through :func:`run_sync`)."""
    return run_sync(lambda: ascore_code(completion, problem, fraction, config, max_stdout_bytes))


async def ascore_many(pairs: list[tuple[str, dict | str]], parallel: int = 4, fraction: bool = False,
                      config: SandboxConfig | None = None) -> list[CodeResult]:
    """:func:`ascore_code` of every ``(completion, problem)`` pair, at most ``parallel`` sandbox
    processes at a time; results in the order of ``pairs``.

    Raises:
        ValueError: ``parallel`` < 1, or a malformed problem (as :func:`ascore_code`).
    """
    if not (isinstance(parallel, int) and parallel >= 1):
        raise ValueError(f"parallel={parallel!r}: programs scored at once must be an int >= 1")
    sem = asyncio.Semaphore(parallel)

    async def one(text: str, problem: dict | str) -> CodeResult:
        async with sem:
            return await ascore_code(text, problem, fraction, config)

    return list(await asyncio.gather(*[one(t, p) for t, p in pairs]))


def code_reward(completion: str, answer: str) -> float:
    """1.0 if the completion's program passes every test of the problem ``answer`` (its JSON
    text, :func:`problem_answer`), else 0.0. Same call shape as
    :func:`arealite.reward.math.math_reward`; never raises (a bad problem gives 0.0 and a warning)."""
    try:
        return score_code(completion, answer).reward
    except Exception as e:  # never raise into the RL loop
        logger.warning("code_reward failed, returning 0.0: %r", e)
        return 0.0


def code_reward_fraction(completion: str, answer: str) -> float:
    """The fraction of the problem's tests the completion's program passes (all tests run)."""
    try:
        return score_code(completion, answer, fraction=True).reward
    except Exception as e:
        logger.warning("code_reward_fraction failed, returning 0.0: %r", e)
        return 0.0
