"""A small transformers-based generation server speaking a subset of SGLang's HTTP protocol.

It lets arealite's rollout side run without SGLang (CPU-only machines, tests, tiny models)
while talking to it with the same client code.  The server works on token ids only, like
SGLang launched with ``--skip-tokenizer-init``; the model folder needs no tokenizer.

Run::

    python -m arealite.server --model-path DIR --host 127.0.0.1 --port 30000 \
        --num-threads 1 --max-batch-size 64 --dtype float32 --seed 1 [--weight-version 0]

Implemented subset of SGLang's protocol (JSON in, JSON out):

- ``POST /generate`` -- one sequence per request (``n`` must be 1), ``input_ids`` only
  (no text), ``sampling_params`` with ``temperature``, ``top_p``, ``top_k``,
  ``max_new_tokens``, ``stop_token_ids``, ``stop`` (strings; needs a tokenizer in the model
  folder) and ``ignore_eos``; ``return_logprob`` adds ``meta_info.output_token_logprobs`` as
  ``[[logprob, token_id, null], ...]``; ``logprob_start_len: k`` adds the prompt's
  ``meta_info.input_token_logprobs`` from position k (a teacher scoring a student's tokens).
- ``GET /health``, ``GET /get_model_info``, ``GET /get_server_info`` (scheduler counters).
- ``POST /pause_generation`` / ``POST /continue_generation`` (abort-on-pause semantics).
- ``POST /set_num_threads`` (ours, not SGLang's): the model's torch intra-op threads from the
  next scheduler iteration on; core sharing lends the trainer's cores this way.
- ``POST /update_weights_from_disk`` (safetensors, applied between decode steps).
- ``POST /init_weights_update_group``, ``POST /update_weights_from_distributed``,
  ``POST /destroy_weights_update_group``: weights broadcast by the trainer (gloo on CPU, NCCL on
  GPU), see :mod:`arealite.weights.sync`; request bodies in :mod:`arealite.api.weight_update`.

Not implemented: text prompts, streaming, ``n > 1``, penalties, min_p, LoRA,
tensor parallelism, sliding-window attention (refused at start-up), sharing KV blocks in
place between rows (prefixes are copied; SGLang's radix cache and vLLM's paged blocks share).

Design: the model lives in ONE scheduler thread.  HTTP handlers (aiohttp, event-loop thread)
put typed messages on a thread-safe queue and await an asyncio future that the scheduler
resolves with ``loop.call_soon_threadsafe``.  The scheduler does continuous batching: between
decode steps it drains its queue and admits waiting requests; finished requests leave.
The KV cache is one preallocated row per running request with its tokens left-aligned,
written in place by an attention function registered in transformers' ``AttentionInterface``,
so the HF model code runs unchanged while the server owns the cache: prefill is packed without
padding, decode attends over each row's own length, nothing is concatenated per step, and
requests with the same prompt (the samples of a GRPO group) share one prefill.  Finished
requests leave their KV in a prefix store (LRU, ``--prefix-cache-tokens``), so the next turn of
a multi-turn episode prefills only its new tokens.  Position ids are each row's own token
positions, so a row computes what it would compute alone (up to float rounding).

Modules, one concern each:

- :mod:`~arealite.server.protocol`: ``/generate`` parsing (``SamplingParams``,
  ``RequestError``), abort reasons, the one error-reply body;
- :mod:`~arealite.server.sampling`: next-token sampling (temperature, top-k, top-p);
- :mod:`~arealite.server.weights`: loads from disk and from received buckets, the
  weight-update groups;
- :mod:`~arealite.server.kv_cache`: ``SlotKVCache``, ``PrefixStore``, ``slot_attention``;
- :mod:`~arealite.server.messages`: the typed messages HTTP thread -> scheduler thread;
- :mod:`~arealite.server.scheduler`: ``Scheduler`` (continuous batching);
- :mod:`~arealite.server.http`: the aiohttp app and handlers;
- ``__main__``: command-line arguments and ``main``.
"""
