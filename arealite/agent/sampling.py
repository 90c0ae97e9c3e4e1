"""The one rule for sampling fields of a chat-completion call, shared by :class:`ArealOpenAI`
(in process) and the training proxy (HTTP).

RL trains on the logprobs the server recorded for each sampled token, and the trainer recomputes
them under the full-vocabulary distribution at the trainer's temperature
(:func:`arealite.api.cli.check_untruncated_sampling` refuses ``gconfig.top_p < 1`` and
``gconfig.top_k > 0`` for the same reason). A field that would change the distribution the
tokens are drawn from, or the ids that are recorded, is therefore **refused** unless it has its
neutral value (or the session's own ``gconfig`` value); a field that does not change them is
**ignored and reported**. Nothing is silently overridden.

Refused (a 400 ``invalid_request_error`` naming the field, code ``unsupported_value``, from the
proxy; :class:`SamplingError` from ``ArealOpenAI.create``):

============================  ==========================================================
field                         accepted values
============================  ==========================================================
``temperature``               omitted, or ``gconfig.temperature`` (the trainer's)
``top_p``                     omitted, 1, or ``gconfig.top_p``
``top_k``                     omitted, -1, 0, or ``gconfig.top_k``
``min_p``                     omitted or 0
``presence_penalty``          omitted or 0
``frequency_penalty``         omitted or 0
``repetition_penalty``        omitted or 1
``logit_bias``                omitted, ``{}`` or all biases 0
``n``, ``best_of``            omitted or 1 (call once per sample)
``stop``                      omitted or empty (the recorded ids must be exactly the
                              sampled ones; stop in the agent instead)
``response_format``           omitted or ``{"type": "text"}`` (constrained decoding masks
                              the distribution)
============================  ==========================================================

Ignored and reported: ``seed``, ``logprobs``, ``top_logprobs``, ``parallel_tool_calls``,
``user``, ``metadata``, ``store`` and any other field the API has and the proxy does not use
(none of them changes what is sampled). The proxy names them in the reply header
``X-Arealite-Ignored-Params`` (comma-separated, sorted) and counts them in
``TrainingProxy.stats["ignored_params"]``; ``ArealOpenAI`` logs them at debug level.
"""

from __future__ import annotations

from typing import Any

from arealite.api.config import GenerationConfig

IGNORED_HEADER = "X-Arealite-Ignored-Params"


class SamplingError(ValueError):
    """A sampling field the RL record cannot honour; ``param`` names it, the message says why
    and how to fix it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _num(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SamplingError(name, f"'{name}'={v!r}: must be a number")
    return float(v)


def _neutral(name: str, v: Any, g: GenerationConfig) -> bool:
    """Whether value ``v`` of refused field ``name`` leaves sampling and recording unchanged."""
    if name == "temperature":
        return abs(_num(name, v) - g.temperature) <= 1e-9
    if name == "top_p":
        return _num(name, v) == 1.0 or _num(name, v) == g.top_p
    if name == "top_k":
        return _num(name, v) in (-1.0, 0.0, float(g.top_k))
    if name in ("min_p", "presence_penalty", "frequency_penalty"):
        return _num(name, v) == 0.0
    if name == "repetition_penalty":
        return _num(name, v) == 1.0
    if name in ("n", "best_of"):
        return _num(name, v) == 1.0
    if name == "logit_bias":
        if not isinstance(v, dict):
            raise SamplingError(name, f"'logit_bias'={v!r}: must be an object of token id -> bias")
        return all(_num(f"logit_bias[{k}]", b) == 0.0 for k, b in v.items())
    if name == "stop":
        return v == "" or v == []
    if name == "response_format":
        return isinstance(v, dict) and v.get("type") == "text"
    raise AssertionError(name)


_WHY = {
    "temperature": "the trainer divides the logits by gconfig.temperature={t}, so tokens sampled at another "
                   "temperature have logprobs the trainer does not reproduce; omit temperature or send {t} "
                   "(set gconfig.temperature to change it for training)",
    "top_p": "nucleus sampling truncates the distribution but the recorded and recomputed logprobs are "
             "full-vocabulary ones (the RL config refuses gconfig.top_p < 1 too); omit top_p or send 1",
    "top_k": "top-k truncates the distribution but the recorded and recomputed logprobs are full-vocabulary "
             "ones (the RL config refuses gconfig.top_k > 0 too); omit top_k or send -1",
    "min_p": "min-p truncates the distribution the logprobs are recorded under; omit min_p or send 0",
    "presence_penalty": "a penalty changes the sampling distribution, which the trainer does not reproduce; "
                        "omit presence_penalty or send 0",
    "frequency_penalty": "a penalty changes the sampling distribution, which the trainer does not reproduce; "
                         "omit frequency_penalty or send 0",
    "repetition_penalty": "a penalty changes the sampling distribution, which the trainer does not reproduce; "
                          "omit repetition_penalty or send 1",
    "logit_bias": "a logit bias changes the sampling distribution, which the trainer does not reproduce; omit "
                  "logit_bias (or send {{}})",
    "n": "the training proxy returns one choice per call (n=1), each recorded as its own trajectory; call it "
         "n times",
    "best_of": "the training proxy returns one choice per call (best_of=1); call it several times",
    "stop": "stop sequences are not supported by the training proxy (the recorded ids must be exactly the "
            "sampled ones); stop in the agent instead",
    "response_format": "constrained decoding (json_object / json_schema) masks the distribution the logprobs "
                       "are recorded under; omit response_format or send {{\"type\": \"text\"}} and parse "
                       "the reply in the agent",
}
REFUSED = tuple(_WHY)


def check_sampling(params: dict[str, Any], gconfig: GenerationConfig) -> list[str]:
    """Apply the module's rule to the call's extra fields ``params`` (everything but
    ``messages``, ``tools``, ``tool_choice``, ``max_tokens`` / ``max_completion_tokens``, ``model``
    and the stream options).

    Returns: the sorted names of the fields that are ignored (reported, not used); a field whose
    value is None counts as omitted.

    Raises:
        SamplingError: the first refused field with a non-neutral value (or a malformed one).
    """
    ignored = []
    for name, value in params.items():
        if value is None:
            continue
        if name in _WHY:
            if not _neutral(name, value, gconfig):
                why = _WHY[name].format(t=gconfig.temperature)
                raise SamplingError(name, f"'{name}'={value!r} is not supported by RL training: {why}")
        else:
            ignored.append(name)
    return sorted(ignored)
