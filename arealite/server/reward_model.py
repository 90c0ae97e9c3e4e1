"""A reward-model server: one ``AutoModelForSequenceClassification`` (``num_labels=1``) folder
behind the two published reward-model protocols, with batching.

Run::

    python -m arealite.server.reward_model --model-path DIR --host 127.0.0.1 --port 30100 \
        --num-threads 1 --max-batch-size 32 --max-batch-tokens 8192 --request-timeout 60

Endpoints (JSON in, JSON out; every error is :func:`~arealite.server.protocol.error_body` with
HTTP 400 naming the field, or 503 when scoring timed out or failed):

- ``POST /classify`` — SGLang's native reward-model endpoint (what verl's discriminative reward
  loop calls): ``{"text": str | [str]}`` or ``{"input_ids": [int] | [[int]]}`` (``"model"`` is
  accepted and ignored) → for one input ``{"index": 0, "embedding": [reward], "meta_info":
  {"prompt_tokens": n}}``, for a list a list of those, in order.
- ``POST /get_reward`` — OpenRLHF's ``serve_rm``: ``{"query": [str], "prompts": [str]?}``
  (``prompts`` accepted, unused: each query already holds prompt + response) →
  ``{"rewards": [float], "scores": [float]}``.
- ``GET /health`` → ``{"status": "ok"}``; ``GET /get_model_info`` → path, ``is_generation:
  false``, counters (requests, sequences, tokens, forwards, batch sizes).

Scoring: a text is tokenized as written (``add_special_tokens=False``: a chat-templated string
already holds its special tokens); the reward is the head at the sequence's last token — what
transformers' ``AutoModelForSequenceClassification`` computes for one unpadded sequence, and what
:class:`arealite.train_engine.fsdp.FSDPRewardEngine` trains. Requests are queued and scored
together: a batcher takes up to ``max_batch_size`` sequences / ``max_batch_tokens`` padded
tokens from the queue, sorted by length, and runs them in one forward (right padding, attention
mask) on one worker thread, so the event loop keeps accepting requests meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import logging
import time

import torch
from aiohttp import web

from arealite.server.protocol import error_body, is_int

logger = logging.getLogger("arealite.reward_server")


class BadRequest(ValueError):
    """A malformed request; HTTP 400 naming ``field``."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field, self.message = field_name, message


@torch.no_grad()
def score_sequences(model, seqs: list[list[int]], pad_id: int) -> list[float]:
    """Rewards of token sequences in one padded forward: ``score(h_last)`` per sequence.

    Args:
        model: an ``AutoModelForSequenceClassification`` (``num_labels=1``; ``base_model`` and
            ``score`` are used, so padding never decides which token is read).
        seqs: non-empty token-id lists. pad_id: the padding id (masked out).
    Returns: one float per sequence (float32 head output), in order.
    """
    device = next(model.parameters()).device
    lengths = torch.tensor([len(s) for s in seqs])
    T = int(lengths.max())
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    hidden = model.base_model(input_ids=ids.to(device), attention_mask=mask.long().to(device),
                              use_cache=False).last_hidden_state  # [B, T, H]
    last = hidden[torch.arange(len(seqs), device=device), (lengths - 1).to(device)]  # [B, H]
    return model.score(last).float()[:, 0].cpu().tolist()


class Batcher:
    """Queues sequences from all requests and scores them in batches on one worker thread.

    Args:
        model, pad_id: see :func:`score_sequences`.
        max_batch_size: most sequences per forward. max_batch_tokens: most padded tokens
            (sequences × longest) per forward (a single longer sequence runs alone).
    """

    def __init__(self, model, pad_id: int, max_batch_size: int = 32, max_batch_tokens: int = 8192):
        if max_batch_size < 1 or max_batch_tokens < 1:
            raise ValueError("--max-batch-size and --max-batch-tokens must be >= 1")
        self.model, self.pad_id = model, pad_id
        self.max_batch_size, self.max_batch_tokens = max_batch_size, max_batch_tokens
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rm-forward")
        self.stats = {"requests": 0, "sequences": 0, "tokens": 0, "forwards": 0, "max_batch": 0,
                      "forward_s": 0.0}

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def score(self, seqs: list[list[int]]) -> list[float]:
        """Rewards of ``seqs`` (queued with every other request's sequences)."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in seqs]
        for s, f in zip(seqs, futures):
            self._queue.put_nowait((s, f))
        self.stats["requests"] += 1
        return list(await asyncio.gather(*futures))

    def _take(self, first) -> list:
        """``first`` plus whatever is queued now, up to the batch limits (by length)."""
        items = [first]
        while not self._queue.empty() and len(items) < self.max_batch_size:
            items.append(self._queue.get_nowait())
        items.sort(key=lambda it: len(it[0]))
        batch, longest = [], 0
        for k, it in enumerate(items):
            longest_next = max(longest, len(it[0]))
            if batch and longest_next * (len(batch) + 1) > self.max_batch_tokens:
                for rest in items[k:]:  # back to the queue: the next forward takes them
                    self._queue.put_nowait(rest)
                break
            batch.append(it)
            longest = longest_next
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self._queue.get()
            await asyncio.sleep(0)  # let requests that arrived together join this batch
            batch = [it for it in self._take(first) if not it[1].done()]
            if not batch:
                continue
            start = time.perf_counter()
            try:
                scores = await loop.run_in_executor(self._pool, score_sequences, self.model,
                                                    [s for s, _ in batch], self.pad_id)
            except Exception as exc:  # noqa: BLE001 - every waiting request gets the error
                for _, f in batch:
                    if not f.done():
                        f.set_exception(exc)
                continue
            st = self.stats
            st["forwards"] += 1
            st["sequences"] += len(batch)
            st["tokens"] += sum(len(s) for s, _ in batch)
            st["max_batch"] = max(st["max_batch"], len(batch))
            st["forward_s"] += time.perf_counter() - start
            for (_, f), v in zip(batch, scores):
                if not f.done():
                    f.set_result(v)


class RewardModelServer:
    """aiohttp handlers of the reward-model server (module doc).

    Args:
        model: ``AutoModelForSequenceClassification`` with one label, in eval mode.
        tokenizer: for text inputs (None: token ids only). model_path: reported by /get_model_info.
        request_timeout: a request not scored within this many seconds gets 503 [s].
    """

    def __init__(self, model, tokenizer, model_path: str, max_batch_size: int = 32,
                 max_batch_tokens: int = 8192, request_timeout: float = 60.0):
        cfg = model.config
        if getattr(cfg, "num_labels", 1) != 1:
            raise ValueError(f"{model_path}: the reward model must have num_labels=1, not {cfg.num_labels}")
        self.model, self.tokenizer, self.model_path = model, tokenizer, model_path
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.vocab_size = text_cfg.vocab_size
        self.max_positions = getattr(text_cfg, "max_position_embeddings", None)
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else (
            tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0)
        self.batcher = Batcher(model, int(pad), max_batch_size, max_batch_tokens)
        self.request_timeout = request_timeout

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/classify", self.classify)
        app.router.add_post("/get_reward", self.get_reward)
        app.router.add_get("/health", self.health)
        app.router.add_get("/get_model_info", self.get_model_info)
        app.on_startup.append(lambda _: self.batcher.start())
        app.on_cleanup.append(lambda _: self.batcher.stop())
        return app

    # -- parsing --------------------------------------------------------------------------------
    def _check_ids(self, ids, where: str) -> list[int]:
        if not isinstance(ids, list) or not ids or not all(is_int(t) for t in ids):
            raise BadRequest(where, f"{where} must be a non-empty list of integer token ids")
        if not all(0 <= t < self.vocab_size for t in ids):
            raise BadRequest(where, f"{where}: token ids must be in [0, {self.vocab_size}) for this model")
        if self.max_positions is not None and len(ids) > self.max_positions:
            raise BadRequest(where, f"{where} has {len(ids)} tokens, more than the model's "
                                    f"max_position_embeddings ({self.max_positions}); shorten it")
        return list(ids)

    def _encode(self, text, where: str) -> list[int]:
        if not isinstance(text, str) or not text:
            raise BadRequest(where, f"{where} must be a non-empty string")
        if self.tokenizer is None:
            raise BadRequest(where, "this server's model folder has no tokenizer: send input_ids")
        return self._check_ids(list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), where)

    def parse_classify(self, body) -> tuple[list[list[int]], bool]:
        """``(sequences, was a list)`` of a ``/classify`` body. Raises :class:`BadRequest`."""
        if not isinstance(body, dict):
            raise BadRequest("body", "request body must be a JSON object with 'text' or 'input_ids'")
        if ("text" in body) == ("input_ids" in body):
            raise BadRequest("text", "send exactly one of 'text' (str or list of str) and 'input_ids' "
                                     "(list of ints, or a list of such lists)")
        if "text" in body:
            text = body["text"]
            if isinstance(text, list):
                if not text:
                    raise BadRequest("text", "text must not be an empty list")
                return [self._encode(t, f"text[{i}]") for i, t in enumerate(text)], True
            return [self._encode(text, "text")], False
        ids = body["input_ids"]
        if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
            return [self._check_ids(x, f"input_ids[{i}]") for i, x in enumerate(ids)], True
        return [self._check_ids(ids, "input_ids")], False

    def parse_get_reward(self, body) -> list[list[int]]:
        """Sequences of a ``/get_reward`` body. Raises :class:`BadRequest`."""
        if not isinstance(body, dict) or "query" not in body:
            raise BadRequest("query", "request body must be a JSON object with 'query': [str, ...]")
        q = body["query"]
        if isinstance(q, str):
            q = [q]
        if not isinstance(q, list) or not q:
            raise BadRequest("query", "query must be a non-empty list of strings (prompt + response each)")
        return [self._encode(t, f"query[{i}]") for i, t in enumerate(q)]

    # -- handlers -------------------------------------------------------------------------------
    async def _scored(self, request: web.Request, parse):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None, web.json_response(error_body("request body must be valid JSON", "body"), status=400)
        try:
            parsed = parse(body)
        except BadRequest as e:
            return None, web.json_response(error_body(e.message, e.field), status=400)
        seqs = parsed[0] if isinstance(parsed, tuple) else parsed
        try:
            scores = await asyncio.wait_for(self.batcher.score(seqs), self.request_timeout)
        except asyncio.TimeoutError:
            return None, web.json_response(error_body(
                f"scoring took longer than --request-timeout {self.request_timeout} s"), status=503)
        except Exception as exc:  # noqa: BLE001
            logger.exception("scoring failed")
            return None, web.json_response(error_body(f"scoring failed: {exc}"), status=503)
        return (parsed, seqs, scores), None

    async def classify(self, request: web.Request) -> web.Response:
        """``POST /classify`` (SGLang's reward endpoint); see the module doc."""
        out, err = await self._scored(request, self.parse_classify)
        if err is not None:
            return err
        (_, as_list), seqs, scores = out
        items = [{"index": i, "embedding": [v], "meta_info": {"prompt_tokens": len(s)}}
                 for i, (s, v) in enumerate(zip(seqs, scores))]
        return web.json_response(items if as_list else items[0])

    async def get_reward(self, request: web.Request) -> web.Response:
        """``POST /get_reward`` (OpenRLHF's ``serve_rm``); see the module doc."""
        out, err = await self._scored(request, self.parse_get_reward)
        if err is not None:
            return err
        scores = out[2]
        return web.json_response({"rewards": scores, "scores": scores})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def get_model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "is_generation": False,
                                  "vocab_size": self.vocab_size, **self.batcher.stats})


def load_reward_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """``(model, tokenizer or None)`` of a reward-model folder, in eval mode.

    Raises:
        ValueError: the folder is not a 1-label sequence-classification model (e.g. a plain
            causal LM: train one with ``recipes/rm_math.py`` first).
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    cfg = AutoConfig.from_pretrained(path)
    if not any(a.endswith("ForSequenceClassification") for a in (cfg.architectures or [])) or cfg.num_labels != 1:
        raise ValueError(f"{path} is not a reward model (architectures {cfg.architectures}, num_labels "
                         f"{getattr(cfg, 'num_labels', None)}); train one with recipes/rm_math.py")
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).to(device).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception:  # noqa: BLE001 - token ids only
        tokenizer = None
    return model, tokenizer


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m arealite.server.reward_model",
                                description="Serve a reward model over /classify (SGLang, verl) and "
                                            "/get_reward (OpenRLHF).")
    p.add_argument("--model-path", required=True, help="HF AutoModelForSequenceClassification folder (num_labels=1)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30100)
    p.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--max-batch-size", type=int, default=32, help="most sequences per forward")
    p.add_argument("--max-batch-tokens", type=int, default=8192, help="most padded tokens per forward")
    p.add_argument("--request-timeout", type=float, default=60.0, help="503 after this long [s]")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone; 0 = never")
    return p.parse_args(argv)


def main(argv=None):
    """Load the reward model and serve until interrupted."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    torch.set_num_threads(args.num_threads)
    if args.parent_pid:
        from arealite.utils.proc import exit_when_parent_dies

        exit_when_parent_dies(args.parent_pid)
    model, tokenizer = load_reward_model(args.model_path, getattr(torch, args.dtype), args.device)
    server = RewardModelServer(model, tokenizer, args.model_path, args.max_batch_size,
                               args.max_batch_tokens, args.request_timeout)
    logger.info("serving reward model %s on %s:%d", args.model_path, args.host, args.port)
    web.run_app(server.app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
