"""The typed messages between the server's HTTP thread and its scheduler thread: one frozen
dataclass per request kind, each saying what its future resolves to, and the scheduler's
record of one running request.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from arealite.server.protocol import SamplingParams


@dataclass(frozen=True)
class Generate:
    """Run one ``/generate`` request. Resolves to SGLang's reply ``{"output_ids",
    "meta_info", "text"?}`` (see :meth:`Scheduler._finish`), or to the exception that failed the
    scheduler step."""

    rid: str
    input_ids: list
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int = -1  # >= 0 (with return_logprob): also the prompt's logprobs from here


@dataclass(frozen=True)
class Pause:
    """Abort every running request (partial output) and waiting one (zero tokens). Resolves to
    the number of requests aborted."""


@dataclass(frozen=True)
class Abort:
    """Drop the request whose future is ``future`` (its client went away); no reply."""

    future: asyncio.Future


@dataclass(frozen=True)
class LoadFromDisk:
    """Load the safetensors of folder ``model_path``; with ``abort_all_requests`` first abort
    everything in flight. Resolves to ``(HTTP status, body)``: 200 with
    :func:`~arealite.api.weight_update.reply` (plus ``num_paused_requests``), or 400 with
    :func:`~arealite.server.protocol.error_body` and the old weights kept."""

    model_path: str
    weight_version: int | None = None
    abort_all_requests: bool = False


@dataclass(frozen=True)
class LoadTensors:
    """Copy one received bucket ``{name: tensor}`` into the model. Resolves like
    :class:`LoadFromDisk`."""

    tensors: dict
    weight_version: int | None = None


@dataclass(frozen=True)
class SetThreads:
    """Run the model with ``num_threads`` torch intra-op threads from the next scheduler
    iteration on (``torch.set_num_threads`` on the scheduler thread: OpenMP's thread count
    belongs to the calling thread). Resolves to the count used before."""

    num_threads: int


Message = Generate | Pause | Abort | LoadFromDisk | LoadTensors | SetThreads


@dataclass
class Envelope:
    """A message on the scheduler's queue, with where to send its answer."""

    message: Message
    future: asyncio.Future | None  # None: no reply (Abort)
    loop: asyncio.AbstractEventLoop | None


@dataclass
class Request:
    """One /generate request as seen by the scheduler thread."""

    rid: str
    input_ids: list
    params: SamplingParams
    return_logprob: bool
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    logprob_start_len: int = -1
    output_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finished: bool = False
    kv_len: int = 0  # tokens in this request's KV-cache row
    last: int = -1  # the next token to feed (not yet in the cache)
    kv_epoch: int = -1  # Scheduler._weights_epoch when its prompt KV was computed
