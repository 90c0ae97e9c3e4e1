"""Reward sources: where a sample's reward comes from, behind one async interface.

A :class:`RewardSource` scores one finished sample (:class:`Sample`: the prompt, the completion's
text and token ids, the dataset row) as soon as it finishes — the workflow awaits each sample's
score right after its generation, not after the group or the batch (verl's "streaming" reward
loop). Sources:

* :class:`FunctionReward` — a Python function ``fn(completion, answer) -> float`` (a verifier such
  as :func:`arealite.reward.math.math_reward`) in a worker process with a timeout
  (:class:`~arealite.reward.worker.RewardWorker`: a crash, hang or bad value scores 0, counted).
* :class:`RemoteRewardModel` — a reward-model server over HTTP, either protocol: SGLang's / verl's
  ``POST /classify`` (token ids, or text) and OpenRLHF's ``POST /get_reward`` (text); ours is
  :mod:`arealite.server.reward_model`.
* :class:`LLMJudge` — any :class:`~arealite.api.engine.InferenceEngine` answering a rubric prompt;
  the score is parsed from its reply (generative reward model, LLM-as-judge);
  :class:`OpenAIJudge` — the same behind an OpenAI-compatible ``/chat/completions`` endpoint.
* :class:`LengthPenalty` — ``−coef × completion tokens``.
* :class:`CombinedReward` — Σ_k w_k · source_k, every component reported separately.

Failures. A learned source that cannot score a sample (server down, timeout, HTTP error, a bad
reply, a judge reply with no score) raises :class:`RewardFailure`; the source counts it under
its reason, and the workflow drops the whole group (the episode is rejected, counted by the
executor), so a guessed value never enters a group's advantages. A function reward keeps the
worker's rule (0, counted), as for verifiers it is the right value of a broken answer.

Concurrency and timeouts are per source (``max_concurrency`` requests in flight per event loop,
``timeout`` seconds per request). Counters (:meth:`RewardSource.counters`), cumulative and the
same keys on every rank, are logged by the RL loop: ``reward/<name>/calls``, ``ok``,
``failed_<reason>``, ``score_sum`` (mean = score_sum / ok), ``seconds`` (wall time of the
calls) and, for a judge, its cost (``prompt_tokens``, ``completion_tokens``).
"""

from __future__ import annotations

import abc
import asyncio
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from arealite.api.config import GenerationConfig
from arealite.api.engine import InferenceEngine
from arealite.api.io_struct import ModelRequest
from arealite.reward.worker import RewardWorker
from arealite.utils.hf import tokenize_chat


@dataclass
class Sample:
    """One finished completion, as a reward source sees it.

    Attributes:
        messages: the prompt (chat list). completion: the decoded completion text.
        prompt_ids, completion_ids: the exact token ids the policy saw and produced.
        data: the dataset row (``answer`` for verifiers and judges with a reference).
        ended: True when the completion stopped by itself (EOS/stop), False when cut by the budget.
    """

    messages: list[dict[str, str]]
    completion: str
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    ended: bool = True


class RewardFailure(Exception):
    """A source could not score a sample; ``reason`` is the counter suffix (``timeout``,
    ``connection``, ``http_503``, ``bad_reply``, ``unparseable``, ...)."""

    def __init__(self, reason: str, message: str = ""):
        super().__init__(message or reason)
        self.reason = reason


class _Counters:
    """Thread-safe cumulative counters of one source (keys ``<name>/<counter>``)."""

    def __init__(self, name: str, keys: tuple[str, ...] = ()):
        self.name, self._lock = name, threading.Lock()
        self.values = {k: 0.0 for k in ("calls", "ok", "score_sum", "seconds", "failed_other", *keys)}

    def fail(self, reason: str, seconds: float) -> None:
        """One failed call, under ``failed_<reason>`` when that counter exists, else ``failed_other``
        (keys never appear mid-run: the loop sums them over ranks)."""
        key = f"failed_{reason}" if f"failed_{reason}" in self.values else "failed_other"
        self.add(calls=1, seconds=seconds, **{key: 1})

    def add(self, **kw: float) -> None:
        with self._lock:
            for k, v in kw.items():
                self.values[k] = self.values.get(k, 0.0) + float(v)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {f"{self.name}/{k}": v for k, v in self.values.items()}


class RewardSource(abc.ABC):
    """One way of scoring a :class:`Sample` (module doc). Subclasses implement :meth:`_score`.

    Attributes: name: the counter prefix and the component name in :class:`CombinedReward`.
    """

    name: str = "reward"
    failure_keys: tuple[str, ...] = ()  # failure counters present from the start (same keys everywhere)

    def __init__(self, name: str | None = None):
        if name is not None:
            self.name = name
        self._counters = _Counters(self.name, tuple(f"failed_{k}" for k in self.failure_keys))

    @abc.abstractmethod
    async def _score(self, sample: Sample) -> float:
        """The score; raise :class:`RewardFailure` when there is none."""

    async def ascore(self, sample: Sample) -> float:
        """The sample's score, counted (calls, ok, failures by reason, sum, seconds).

        Raises: RewardFailure: the source could not score it (counted as ``failed_<reason>``)."""
        start = time.perf_counter()
        try:
            value = float(await self._score(sample))
        except RewardFailure as e:
            self._counters.fail(e.reason, time.perf_counter() - start)
            raise
        self._counters.add(calls=1, ok=1, score_sum=value, seconds=time.perf_counter() - start)
        return value

    async def ascore_parts(self, sample: Sample) -> tuple[float, dict[str, float]]:
        """``(reward, {component name: value})``; one component, this source, by default."""
        value = await self.ascore(sample)
        return value, {self.name: value}

    def counters(self) -> dict[str, float]:
        """Cumulative counters ``{"<name>/calls": n, ...}`` (module doc)."""
        return self._counters.snapshot()

    def components(self) -> tuple[str, ...]:
        """The component names :meth:`ascore_parts` returns."""
        return (self.name,)

    def start(self) -> None:
        """Called once before the run's models load (e.g. start worker processes)."""

    def close(self) -> None:
        """Release processes and connections (once, at the end of a run)."""

    async def aclose(self) -> None:
        """Close what is bound to the running event loop (HTTP sessions); called when it ends."""


class _PerLoop:
    """One object per running event loop (aiohttp sessions and semaphores are bound to one)."""

    def __init__(self, make: Callable[[], Any]):
        self.make, self.items, self.lock = make, {}, threading.Lock()

    def get(self):
        loop = asyncio.get_running_loop()
        with self.lock:
            if loop not in self.items:
                self.items[loop] = self.make()
            return self.items[loop]

    def pop_current(self):
        """This loop's object (None if it made none), forgotten."""
        with self.lock:
            return self.items.pop(asyncio.get_running_loop(), None)


async def post_with_retries(session, url: str, body: dict, retries: int, timeout: float):
    """POST ``body`` as JSON to ``url`` and return the decoded reply, trying up to ``retries``
    times on a connection error, a timeout (``timeout`` s, the session's) or a 5xx; a 4xx is not
    retried (the request is bad).

    Raises: RewardFailure: ``http`` (the last reply's status and body), ``timeout``, ``connection``,
        or ``bad_reply`` (a 200 whose body is not JSON)."""
    import aiohttp

    reason, detail = "connection", ""
    for _ in range(max(1, retries)):
        try:
            async with session.post(url, json=body) as resp:
                if resp.status == 200:
                    try:
                        return await resp.json(content_type=None)
                    except ValueError as e:  # not JSON
                        raise RewardFailure("bad_reply", f"{url}: reply is not JSON ({e!r})") from None
                reason, detail = "http", f"answered {resp.status}: {(await resp.text())[:300]}"
                if resp.status < 500:
                    break
        except asyncio.TimeoutError:
            reason, detail = "timeout", f"no reply within {timeout} s"
        except aiohttp.ClientError as e:
            reason, detail = "connection", repr(e)
    raise RewardFailure(reason, f"{url} {detail}")


# ----------------------------------------------------------------------------------- sources


class FunctionReward(RewardSource):
    """A picklable module-level ``fn(completion: str, answer: str) -> float`` run in a worker
    process with a timeout (failures score 0 and are counted by the worker: ``<name>/timeout``,
    ``crash``, ``error``, ...). The row must have ``answer``.

    Raises (from :meth:`ascore`): KeyError: the row has no ``answer``.
    """

    def __init__(self, fn: Callable[[str, str], float], timeout: float = 10.0, name: str = "verifier"):
        super().__init__(name)
        self.fn, self.worker = fn, RewardWorker(timeout=timeout)

    async def _score(self, sample: Sample) -> float:
        if "answer" not in sample.data:
            raise KeyError("dataset row has no 'answer' field; a function reward needs it")
        return await self.worker.acompute(self.fn, sample.completion, sample.data["answer"])

    def counters(self) -> dict[str, float]:
        out = super().counters()
        out.update({f"{self.name}/{k}": float(v) for k, v in self.worker.stats_snapshot(prefix="").items() if k != "calls"})
        return out

    def start(self) -> None:
        self.worker.prewarm(self.fn)

    def close(self) -> None:
        self.worker.close()


class LengthPenalty(RewardSource):
    """``−coef × len(completion_ids)``: a per-token cost (e.g. against verbose answers an RM
    pays for)."""

    def __init__(self, coef: float, name: str = "length"):
        super().__init__(name)
        self.coef = coef

    async def _score(self, sample: Sample) -> float:
        return -self.coef * len(sample.completion_ids)


def rm_text(tokenizer, sample: Sample) -> str:
    """The text a text-protocol reward model scores: the prompt under ``tokenizer``'s chat
    template (with the generation prompt), the completion, and the EOS token when the completion
    ended by itself — the sequence :func:`arealite.dataset.sft_data.tokenize_example` trains on."""
    prompt = tokenizer.apply_chat_template(sample.messages, add_generation_prompt=True, tokenize=False)
    return prompt + sample.completion + (tokenizer.eos_token if sample.ended and tokenizer.eos_token else "")


class RemoteRewardModel(RewardSource):
    """A reward-model server over HTTP (ours: :mod:`arealite.server.reward_model`; SGLang with a
    reward model; OpenRLHF's ``serve_rm``).

    Args:
        url: ``http://host:port`` of the server.
        protocol: ``classify`` (``POST /classify``; reads ``embedding[0]``) or ``get_reward``
            (``POST /get_reward``; reads ``rewards[0]``).
        tokenizer: the reward model's tokenizer, for text requests (:func:`rm_text`). With
            ``classify`` and no tokenizer the exact token ids ``prompt_ids + completion_ids``
            are sent — right only when the reward model shares the policy's tokenizer.
        timeout: seconds per request. retries: attempts for a connection error, timeout or 5xx.
        max_concurrency: requests in flight per event loop.

    Raises:
        ValueError: an unknown ``protocol``, or ``get_reward`` without a tokenizer.
    """

    failure_keys = ("timeout", "connection", "http", "bad_reply")

    def __init__(self, url: str, protocol: str = "classify", tokenizer=None, timeout: float = 30.0,
                 retries: int = 2, max_concurrency: int = 16, name: str = "rm"):
        super().__init__(name)
        if protocol not in ("classify", "get_reward"):
            raise ValueError(f"reward.model_protocol: unknown {protocol!r}; use 'classify' or 'get_reward'")
        if protocol == "get_reward" and tokenizer is None:
            raise ValueError("reward.model_protocol get_reward sends text: give the reward model's tokenizer")
        self.url = url.rstrip("/") if "://" in url else f"http://{url.rstrip('/')}"
        self.protocol, self.tokenizer = protocol, tokenizer
        self.timeout, self.retries = timeout, max(1, retries)
        self._sem = _PerLoop(lambda: asyncio.Semaphore(max_concurrency))
        self._sessions = _PerLoop(self._new_session)

    def _new_session(self):
        import aiohttp

        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))

    def body(self, sample: Sample) -> tuple[str, dict]:
        """``(endpoint, JSON body)`` of one request for ``sample``."""
        if self.protocol == "get_reward":
            return "/get_reward", {"query": [rm_text(self.tokenizer, sample)]}
        if self.tokenizer is not None:
            return "/classify", {"text": rm_text(self.tokenizer, sample)}
        return "/classify", {"input_ids": list(sample.prompt_ids) + list(sample.completion_ids)}

    def parse(self, reply) -> float:
        """The reward in a reply. Raises RewardFailure(``bad_reply``)."""
        try:
            if self.protocol == "get_reward":
                value = reply["rewards"][0]
            else:
                value = (reply[0] if isinstance(reply, list) else reply)["embedding"][0]
            value = float(value)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise RewardFailure("bad_reply", f"{self.url}: unexpected reply {str(reply)[:200]!r} ({e!r})") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise RewardFailure("bad_reply", f"{self.url}: non-finite reward {value}")
        return value

    async def _score(self, sample: Sample) -> float:
        endpoint, body = self.body(sample)
        async with self._sem.get():
            return self.parse(await post_with_retries(self._sessions.get(), self.url + endpoint, body,
                                                      self.retries, self.timeout))

    async def aclose(self) -> None:
        session = self._sessions.pop_current()
        if session is not None:
            await session.close()


JUDGE_TEMPLATE = (
    "You are grading a response to a question.\n\n"
    "Question:\n{question}\n\n"
    "{reference_block}"
    "Response:\n{response}\n\n"
    "{rubric}\n"
    "Reply with one line of the form \"Score: N\" where N is an integer from 0 to {max_score}."
)
DEFAULT_RUBRIC = "Grade the response for correctness of its final answer and clarity of its reasoning."

_SCORE_PATTERNS = (
    re.compile(r"score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)\s*(?:/\s*(\d+(?:\.\d+)?))?", re.I),
    re.compile(r"\\boxed\{\s*(-?\d+(?:\.\d+)?)\s*\}"),
    re.compile(r"(-?\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)"),
    re.compile(r"(?:rating|grade)\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.I),
)


def parse_judge_score(text: str, max_score: float) -> float | None:
    """The judge's score in ``text`` scaled to [0, 1] (score / ``max_score``), or None when it
    holds none. The first pattern that matches wins, and within it the LAST match (a judge that
    reasons first ends with its verdict): ``Score: N`` (``Score: N/M`` rescales by M),
    ``\\boxed{N}``, ``N/M``, ``Rating: N``. A score outside [0, max] is no score."""
    for pattern in _SCORE_PATTERNS:
        matches = pattern.findall(text)
        if not matches:
            continue
        last = matches[-1]
        value, scale = (last[0], last[1] if len(last) > 1 else "") if isinstance(last, tuple) else (last, "")
        top = float(scale) if scale else float(max_score)
        v = float(value)
        if top <= 0 or not 0 <= v <= top:
            return None
        return v / top
    return None


class LLMJudge(RewardSource):
    """An LLM judge: any :class:`~arealite.api.engine.InferenceEngine` (our server, SGLang, vLLM
    through :class:`~arealite.inference.remote.RemoteInferenceEngine`) answers a rubric prompt
    about the sample; the reward is its parsed score / ``max_score`` in [0, 1].

    Args:
        engine: the judge's engine (its own servers, not the policy's).
        tokenizer: the judge model's tokenizer (chat template).
        template: prompt with ``{question}``, ``{response}``, ``{reference_block}``, ``{rubric}``,
            ``{max_score}`` (:data:`JUDGE_TEMPLATE`). The question is the prompt's last user
            message; the reference block is ``"Reference answer: …"`` when ``use_reference`` and
            the row has ``answer``.
        gconfig: the judge's sampling (greedy, 64 new tokens by default).
        timeout: seconds per judgement. max_concurrency: judgements in flight per event loop.
        owns_engine: :meth:`close` destroys ``engine`` (one built for the judge alone).

    A reply without a parseable score raises RewardFailure(``unparseable``) — counted, never a
    silent 0. Cost counters: ``<name>/prompt_tokens``, ``completion_tokens``, ``seconds``.
    """

    failure_keys = ("timeout", "unparseable", "engine")

    def __init__(self, engine: InferenceEngine, tokenizer, template: str = JUDGE_TEMPLATE,
                 rubric: str = DEFAULT_RUBRIC, max_score: float = 10, use_reference: bool = True,
                 gconfig: GenerationConfig | None = None, timeout: float = 60.0, max_concurrency: int = 16,
                 name: str = "judge", owns_engine: bool = False):
        super().__init__(name)
        self.owns_engine = owns_engine
        self.engine, self.tokenizer, self.template, self.rubric = engine, tokenizer, template, rubric
        self.max_score, self.use_reference, self.timeout = max_score, use_reference, timeout
        self.gconfig = gconfig or GenerationConfig(max_new_tokens=64, greedy=True)
        self._sem = _PerLoop(lambda: asyncio.Semaphore(max_concurrency))
        self._counters.values.update(prompt_tokens=0.0, completion_tokens=0.0)

    def prompt(self, sample: Sample) -> str:
        """The judge's user message for ``sample``."""
        question = next((m["content"] for m in reversed(sample.messages) if m.get("role") == "user"), "")
        ref = sample.data.get("answer") if self.use_reference else None
        return self.template.format(question=question, response=sample.completion, rubric=self.rubric,
                                    reference_block=f"Reference answer: {ref}\n\n" if ref is not None else "",
                                    max_score=self.max_score)

    async def _reply(self, prompt: str) -> tuple[str, int, int]:
        """``(reply text, prompt tokens, completion tokens)`` of the judge for ``prompt``.
        Raises RewardFailure (``timeout``, ``engine``)."""
        ids = tokenize_chat(self.tokenizer, [{"role": "user", "content": prompt}])
        async with self._sem.get():
            try:
                resp = await asyncio.wait_for(self.engine.agenerate(ModelRequest(input_ids=ids, gconfig=self.gconfig)),
                                              self.timeout)
            except asyncio.TimeoutError:
                raise RewardFailure("timeout", f"judge: no reply within {self.timeout} s") from None
            except (RuntimeError, OSError) as e:
                raise RewardFailure("engine", f"judge: {e!r}") from None
        return self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True), len(ids), resp.output_len

    async def _score(self, sample: Sample) -> float:
        text, n_prompt, n_completion = await self._reply(self.prompt(sample))
        self._counters.add(prompt_tokens=n_prompt, completion_tokens=n_completion)
        score = parse_judge_score(text, self.max_score)
        if score is None:
            raise RewardFailure("unparseable", f"judge reply has no score in [0, {self.max_score}]: {text[:200]!r}")
        return score

    async def aclose(self) -> None:
        await self.engine.aclose()

    def close(self) -> None:
        if self.owns_engine:
            self.engine.destroy()


class OpenAIJudge(LLMJudge):
    """An LLM judge behind an OpenAI-compatible chat endpoint (a hosted API, vLLM's or SGLang's
    OpenAI server, any router): ``POST {url}/chat/completions`` with the rubric prompt as one user
    message, ``temperature`` 0 and ``max_tokens``; the text is ``choices[0].message.content``, the
    cost ``usage.prompt_tokens`` / ``completion_tokens``. Same prompt, parsing, counters and
    failure rules as :class:`LLMJudge`; no tokenizer is needed.

    Args:
        url: the API base, e.g. ``http://host:8000/v1``. model: the ``model`` field.
        api_key: sent as ``Authorization: Bearer`` when set. max_tokens: the reply budget.
        retries: attempts for a connection error, a timeout or a 5xx (a 4xx is not retried).
    """

    failure_keys = ("timeout", "unparseable", "engine", "connection", "http", "bad_reply")

    def __init__(self, url: str, model: str, api_key: str = "", max_tokens: int = 64, retries: int = 2,
                 timeout: float = 60.0, max_concurrency: int = 16, name: str = "judge", **kwargs):
        super().__init__(None, None, timeout=timeout, max_concurrency=max_concurrency, name=name, **kwargs)
        self.url = (url if "://" in url else f"http://{url}").rstrip("/")
        self.model, self.api_key, self.max_tokens, self.retries = model, api_key, max_tokens, max(1, retries)
        self._sessions = _PerLoop(self._new_session)

    def _new_session(self):
        import aiohttp

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout), headers=headers)

    async def _reply(self, prompt: str) -> tuple[str, int, int]:
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                "max_tokens": self.max_tokens}
        async with self._sem.get():
            reply = await post_with_retries(self._sessions.get(), self.url + "/chat/completions", body,
                                            self.retries, self.timeout)
        try:
            text = reply["choices"][0]["message"]["content"] or ""
            usage = reply.get("usage") or {}
            return str(text), int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise RewardFailure("bad_reply", f"{self.url}: unexpected reply {str(reply)[:200]!r} ({e!r})") from None

    async def aclose(self) -> None:
        session = self._sessions.pop_current()
        if session is not None:
            await session.close()

    def close(self) -> None:
        pass


class CombinedReward(RewardSource):
    """``Σ_k w_k · source_k(sample)``; every component is reported (:meth:`ascore_parts`) and keeps
    its own counters. Components run concurrently; if one fails the sample fails.

    Args: parts: ``[(source, weight), ...]`` with distinct source names (a weight of 0 reports a
        component without paying for it, e.g. a verifier beside a reward model).

    Raises: ValueError: no parts, or two parts with the same name.
    """

    def __init__(self, parts: list[tuple[RewardSource, float]], name: str = "total"):
        self.failure_keys = tuple(sorted({k for s, _ in parts for k in s.failure_keys}))
        super().__init__(name)
        names = [s.name for s, _ in parts]
        if not parts or len(set(names)) != len(names):
            raise ValueError(f"CombinedReward needs sources with distinct names, got {names}")
        self.parts = parts

    async def _score(self, sample: Sample) -> float:
        return (await self.ascore_parts(sample))[0]

    async def ascore(self, sample: Sample) -> float:
        return (await self.ascore_parts(sample))[0]

    async def ascore_parts(self, sample: Sample) -> tuple[float, dict[str, float]]:
        """``(Σ w_k v_k, {name_k: v_k})``. Raises the first component's RewardFailure."""
        start = time.perf_counter()
        values = await asyncio.gather(*[s.ascore(sample) for s, _ in self.parts], return_exceptions=True)
        for v in values:
            if isinstance(v, BaseException):
                self._counters.fail(v.reason if isinstance(v, RewardFailure) else "other", time.perf_counter() - start)
                raise v
        total = sum(w * v for (_, w), v in zip(self.parts, values))
        self._counters.add(calls=1, ok=1, score_sum=total, seconds=time.perf_counter() - start)
        return total, {s.name: v for (s, _), v in zip(self.parts, values)}

    def components(self) -> tuple[str, ...]:
        return tuple(s.name for s, _ in self.parts)

    def counters(self) -> dict[str, float]:
        out = super().counters()
        for s, _ in self.parts:
            out.update(s.counters())
        return out

    def start(self) -> None:
        for s, _ in self.parts:
            s.start()

    def close(self) -> None:
        for s, _ in self.parts:
            s.close()

    async def aclose(self) -> None:
        for s, _ in self.parts:
            await s.aclose()
