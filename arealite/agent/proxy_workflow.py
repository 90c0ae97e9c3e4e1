"""Train an agent that talks to the OpenAI-compatible training proxy (:mod:`arealite.agent.proxy`),
in this process or as a subprocess, through the same executor and staleness rule as every
workflow.

    workflow = ProxyAgentWorkflow(["python", "my_agent.py"], tokenizer, gconfig,
                                  reward_fn=lambda data, text: math_reward(text, data["answer"]))

One episode = one proxy session: the workflow opens it, starts the agent with the session's
``base_url`` / ``api_key``, awaits it (at most ``proxy.session_timeout`` seconds), and exports
the session's trajectory (:meth:`ArealOpenAI.export_episode`). The episode is an ordinary
``arun_episode`` of the executor, so the executor's capacity and staleness rule admit it and its
tokens carry the engine's weight versions (a proxy that served agents outside the executor
would bypass both, the bug reported as AReaL#1481).

The agent is one of:

- a command (``list[str]`` or a string split by :func:`shlex.split`): run as a subprocess with
  ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``AREALITE_SESSION_ID`` and ``AREALITE_REWARD_URL`` in
  its environment and the data row as JSON on stdin; a non-zero exit fails the episode;
- a callable ``agent(data, base_url, api_key) -> float | None`` (``async def`` or a plain
  function, which runs in a thread).

Reward, first that applies: the value the agent posted to ``/s/<id>/reward``; the number the
callable returned; ``reward_fn(data, text)`` (sync or async) on the text of the episode's last
reply. None of them → the episode fails with an error saying so.

Hanging sessions: an agent still running after ``session_timeout`` is stopped (the subprocess is
killed, the task cancelled), its session closed (late requests get 404) and counted in
``stats["timed_out"]`` and the proxy's ``sessions_timed_out``, with a warning; its whole group
is dropped (``arun_episode`` returns None, counted as ``rollout/rejected``) so that a GRPO group
never mixes in a short or foreign trajectory.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import shlex
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from arealite.agent.proxy import Session, TrainingProxy
from arealite.api.config import GenerationConfig, ProxyConfig
from arealite.api.engine import InferenceEngine
from arealite.api.workflow import RolloutWorkflow
from arealite.workflow.multi_turn import Episode, dump_episodes, episodes_to_batch, rollouts_path, summarize_episodes

logger = logging.getLogger("arealite.proxy")


class ProxyAgentWorkflow(RolloutWorkflow):
    """``gconfig.n_samples`` proxy sessions per row (a GRPO group); see the module docstring.

    Args:
        agent: a command (list or string) or a callable ``agent(data, base_url, api_key)``.
        tokenizer: the policy's tokenizer.
        gconfig: sampling defaults of every session (``temperature`` is the trainer's).
        reward_fn: optional ``fn(data, last_reply_text) -> float`` (sync or async).
        config: the proxy (host, port, ``session_timeout``).
        env: extra environment variables for a subprocess agent.
        cwd: working directory of a subprocess agent.
        dump_dir: if set, each finished group goes to ``dump_dir/rollouts.jsonl``
            (:func:`~arealite.workflow.multi_turn.dump_episodes`: rewards, turns, each reply's text).

    Raises:
        ValueError: ``proxy.session_timeout <= 0`` or an empty command.
    """

    stat_keys = ("turns",)

    def __init__(self, agent: Callable | Sequence[str] | str, tokenizer, gconfig: GenerationConfig,
                 reward_fn: Callable | None = None, config: ProxyConfig | None = None,
                 env: dict[str, str] | None = None, cwd: str | None = None, dump_dir: str | None = None):
        self.config = config or ProxyConfig()
        if not self.config.session_timeout > 0:
            raise ValueError(f"proxy.session_timeout={self.config.session_timeout}: must be > 0 [s]")
        if isinstance(agent, str):
            agent = shlex.split(agent)
        if not callable(agent) and not agent:
            raise ValueError("ProxyAgentWorkflow: the agent command is empty")
        self.agent, self.tokenizer, self.gconfig, self.reward_fn = agent, tokenizer, gconfig, reward_fn
        self.env, self.cwd = dict(env or {}), cwd
        self.dump_path = rollouts_path(dump_dir)
        self.stats = {"episodes": 0, "timed_out": 0, "failed": 0}
        self._proxies: dict[Any, asyncio.Task] = {}  # event loop -> task starting its proxy
        self._lock = threading.Lock()  # the executor's loop and an evaluation thread's loop

    def counters(self) -> dict[str, float]:
        """``episodes`` finished, sessions ``timed_out`` (their groups dropped) and ``failed``
        (the agent raised or exited non-zero), cumulative; logged as ``workflow/<name>``."""
        return {k: float(v) for k, v in self.stats.items()}

    async def proxy(self) -> TrainingProxy:
        """The proxy serving this event loop (started on first use; the engine's HTTP session
        and the episodes live on this loop)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            for other in [lp for lp in self._proxies if lp is not loop and lp.is_closed()]:
                del self._proxies[other]  # e.g. an evaluation's asyncio.run loop
            if loop not in self._proxies:
                # a fixed proxy.port serves the first loop; another (an evaluation's) takes a free port
                config = replace(self.config, port=0) if self._proxies else self.config
                proxy = TrainingProxy(self.tokenizer, self.gconfig, config)
                self._proxies[loop] = loop.create_task(proxy.start())
            task = self._proxies[loop]
        return await task

    async def aclose(self) -> None:
        """Stop the proxy of the running event loop."""
        with self._lock:
            task = self._proxies.pop(asyncio.get_running_loop(), None)
        if task is not None:
            await (await task).aclose()

    # -- one session -----------------------------------------------------------------------------
    async def _run_agent(self, session: Session, data: dict[str, Any]) -> Any:
        if callable(self.agent):
            if inspect.iscoroutinefunction(self.agent):
                return await self.agent(data, session.base_url, session.api_key)
            return await asyncio.to_thread(self.agent, data, session.base_url, session.api_key)
        env = {**os.environ, **self.env, "OPENAI_BASE_URL": session.base_url, "OPENAI_API_KEY": session.api_key,
               "AREALITE_SESSION_ID": session.id, "AREALITE_REWARD_URL": session.base_url[:-3] + "/reward"}
        proc = await asyncio.create_subprocess_exec(
            *self.agent, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, cwd=self.cwd)
        try:
            out, err = await proc.communicate(json.dumps(data).encode())
        finally:
            if proc.returncode is None:  # cancelled (timeout): no orphan keeps calling the proxy
                proc.kill()
                await proc.wait()
        if proc.returncode != 0:
            raise RuntimeError(f"agent command {self.agent} exited with {proc.returncode}; stderr tail:\n"
                               f"{err.decode(errors='replace')[-2000:]}")
        return None

    async def _reward(self, session: Session, result: Any, data: dict[str, Any]) -> float:
        if session.reward is not None:
            return session.reward
        if isinstance(result, (int, float)) and not isinstance(result, bool):
            return float(result)
        if self.reward_fn is not None:
            text = session.client.records[-1].text if session.client.records else ""
            value = self.reward_fn(data, text)
            return float(await value if inspect.isawaitable(value) else value)
        raise RuntimeError("ProxyAgentWorkflow: no reward for the episode: the agent posted none to "
                           "/s/<id>/reward, the callable returned none, and no reward_fn was given")

    async def run_one(self, engine: InferenceEngine, data: dict[str, Any],
                      gconfig: GenerationConfig | None = None) -> Episode | None:
        """One session → one :class:`Episode`, or None when the agent timed out."""
        proxy = await self.proxy()
        session = proxy.open_session(engine, gconfig or self.gconfig)
        timed_out = False
        try:
            result = await asyncio.wait_for(self._run_agent(session, data), self.config.session_timeout)
        except asyncio.TimeoutError:
            timed_out = True
        except Exception:
            self.stats["failed"] += 1
            raise
        finally:
            proxy.close_session(session.id, timed_out=timed_out)
        if timed_out:
            self.stats["timed_out"] += 1
            logger.warning("proxy session %s timed out after proxy.session_timeout=%.1f s (%d calls); its group "
                           "is dropped (%d timed-out sessions so far)", session.id, self.config.session_timeout,
                           len(session.client.records), self.stats["timed_out"])
            return None
        reward = await self._reward(session, result, data)
        self.stats["episodes"] += 1
        return session.client.export_episode(reward)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        start = time.time()
        results = await asyncio.gather(*[self.run_one(engine, data) for _ in range(self.gconfig.n_samples)],
                                       return_exceptions=True)  # every session finishes and is closed
        for r in results:
            if isinstance(r, BaseException):
                raise r
        if any(r is None for r in results):
            return None  # a timed-out session: the whole group is dropped (logged in run_one)
        if self.dump_path:
            dump_episodes(self.dump_path, data, list(results), start)
        return episodes_to_batch(list(results))

    async def aevaluate(self, engine: InferenceEngine, rows: list[dict[str, Any]]) -> dict[str, float]:
        """One greedy session per row (from a fresh event loop, e.g. in a recipe): ``{"reward",
        "solved", "turns"}`` as :func:`summarize_episodes`; a timed-out session counts as
        reward 0 with 0 turns."""
        greedy = replace(self.gconfig, greedy=True, n_samples=1)

        async def one(eng, row):
            return await self.run_one(eng, row, greedy) or Episode()
        try:
            return await summarize_episodes(one, engine, rows)
        finally:
            await self.aclose()
