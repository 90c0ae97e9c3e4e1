"""The server's request protocol: parsing and validating ``/generate`` bodies, the sampling
parameters they carry, the abort reasons of a reply, and the one error-reply shape of every
endpoint.

Pure data (no model, no HTTP). The weight-update bodies are :mod:`arealite.api.weight_update`,
shared with the trainer and the vLLM extension.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from arealite.api.weight_update import ProtocolError

ABORT_BY_PAUSE = "Abort by pause_generation"  # finish_reason.message of a running request
ABORT_BEFORE_PREFILL = "Abort before prefill"  # ... of a waiting one (zero tokens), as SGLang


def error_body(message: str, field_name: str = "") -> dict:
    """The body of every error reply (4xx/5xx) of every endpoint: ``{"success": false,
    "message": str, "error": {"message": str, "field": str}}``.

    Both shapes SGLang's clients read: its weight-update endpoints answer ``{"success",
    "message"}``, its ``/generate`` ``{"error": {"message"}}``; ``field`` names the offending
    request field ("" when none does)."""
    return {"success": False, "message": message, "error": {"message": message, "field": field_name}}


class RequestError(ProtocolError):
    """A malformed ``/generate`` request; rendered as HTTP 400 :func:`error_body` naming
    ``field``."""


@dataclass
class SamplingParams:
    """Per-request sampling parameters (SGLang names and defaults)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0 or >= vocab size: disabled
    max_new_tokens: int = 128
    stop_token_ids: frozenset = frozenset()
    ignore_eos: bool = False
    stop: tuple = ()  # stop strings


def is_int(x) -> bool:
    """An int that is not a bool (JSON ``true`` must not pass as 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def parse_logprob_start_len(body: dict, n_input: int) -> int:
    """SGLang's ``logprob_start_len`` of a ``/generate`` body: -1 (absent: no prompt logprobs) or
    the first prompt position whose logprob comes back in ``meta_info.input_token_logprobs``
    (needs ``return_logprob: true``). Raises ``RequestError`` for a non-integer or a position
    outside [-1, len(input_ids))."""
    start = body.get("logprob_start_len", -1)
    if start is None:
        start = -1
    if not is_int(start) or not -1 <= start < n_input:
        raise RequestError("logprob_start_len", f"logprob_start_len must be an integer in [-1, {n_input}) "
                           "(-1: no prompt logprobs)")
    if start >= 0 and body.get("return_logprob") is not True:
        raise RequestError("logprob_start_len", "logprob_start_len needs return_logprob: true")
    return start


def parse_generate_request(body, vocab_size: int, max_positions: int | None,
                           has_tokenizer: bool = True):
    """Validate a ``/generate`` body; return ``(input_ids, SamplingParams, return_logprob, rid)``.

    Raises ``RequestError`` naming the offending field and how to fix it.
    Unknown keys in ``sampling_params`` are ignored, as SGLang does for most of them.
    """
    if not isinstance(body, dict):
        raise RequestError("body", "request body must be a JSON object")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise RequestError("input_ids", "input_ids must be a non-empty list of token ids "
                           "(text prompts are not supported; tokenize on the client)")
    if not all(is_int(t) for t in ids):
        raise RequestError("input_ids", "input_ids must contain only integers")
    if not all(0 <= t < vocab_size for t in ids):
        raise RequestError("input_ids", f"token ids must be in [0, {vocab_size}) for this model")
    sp = body.get("sampling_params", {})
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise RequestError("sampling_params", "sampling_params must be a JSON object")
    for where, holder in (("n", body), ("sampling_params.n", sp)):
        if "n" in holder and holder["n"] != 1:
            raise RequestError(where, "n must be 1: send one request per sample")
    p = SamplingParams()
    t = sp.get("temperature", p.temperature)
    if not _is_number(t) or not math.isfinite(t) or t < 0:
        raise RequestError("sampling_params.temperature",
                           "temperature must be a number >= 0 (0 means greedy)")
    top_p = sp.get("top_p", p.top_p)
    if not _is_number(top_p) or not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise RequestError("sampling_params.top_p", "top_p must be a number in (0, 1]")
    top_k = sp.get("top_k", p.top_k)
    if not is_int(top_k):
        raise RequestError("sampling_params.top_k", "top_k must be an integer (-1 disables it)")
    if top_k <= 0 or top_k >= vocab_size:
        top_k = -1  # disabled (also keeps huge values out of the batch's int64 tensor)
    max_new = sp.get("max_new_tokens", p.max_new_tokens)
    if not is_int(max_new) or max_new < 0:
        raise RequestError("sampling_params.max_new_tokens",
                           "max_new_tokens must be an integer >= 0")
    stop = sp.get("stop_token_ids", [])
    if stop is None:
        stop = []
    if not isinstance(stop, list) or not all(is_int(s) for s in stop):
        raise RequestError("sampling_params.stop_token_ids",
                           "stop_token_ids must be a list of integers")
    stop_str = sp.get("stop", [])
    if stop_str is None:
        stop_str = []
    if isinstance(stop_str, str):
        stop_str = [stop_str]
    if not isinstance(stop_str, list) or not all(isinstance(x, str) and x for x in stop_str):
        raise RequestError("sampling_params.stop",
                           "stop must be a non-empty string or a list of non-empty strings")
    if stop_str and not has_tokenizer:
        raise RequestError("sampling_params.stop",
                           "stop strings need a tokenizer in the server's model folder; save "
                           "one there or use stop_token_ids")
    ignore_eos = sp.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise RequestError("sampling_params.ignore_eos", "ignore_eos must be true or false")
    return_logprob = body.get("return_logprob", False)
    if not isinstance(return_logprob, bool):
        raise RequestError("return_logprob", "return_logprob must be true or false")
    if max_positions is not None and len(ids) + max_new > max_positions:
        raise RequestError(
            "sampling_params.max_new_tokens",
            f"len(input_ids) + max_new_tokens = {len(ids)} + {max_new} exceeds the model's "
            f"max_position_embeddings ({max_positions}); lower max_new_tokens to at most "
            f"{max(max_positions - len(ids), 0)} or shorten the prompt")
    rid = body.get("rid")
    rid = str(rid) if rid is not None else uuid.uuid4().hex
    params = SamplingParams(float(t), float(top_p), top_k, max_new, frozenset(stop), ignore_eos,
                            tuple(stop_str))
    return ids, params, return_logprob, rid
