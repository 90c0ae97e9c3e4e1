"""vLLM weight updates without vLLM: our worker extension bound to fake workers behind a fake
``/collective_rpc`` server that mimics vLLM's route (``vllm/entrypoints/serve/dev/rpc/
api_router.py``: ``{"method", "args", "kwargs"}`` -> ``{"results": [one per worker]}``, run on
every worker at once, 500 when a worker raises, 404 when ``VLLM_SERVER_DEV_MODE`` is off).

Each fake worker wraps a real tiny HF Llama (tied embeddings) whose ``load_weights(weights)``
copies ``(HF name, tensor)`` pairs by name, like vLLM's loader for an unquantized model. Two
workers = one server with tensor parallelism 2 (ranks ``rank_offset + tp_rank``). The workers
start on model A (seed 0), the trainer holds model B (seed 1); after a push every worker
tensor must equal B's bit for bit. NOT a test of a real vLLM.
"""

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from arealite.inference.remote import post_control, post_json
from arealite.inference.adapters import ServerError, VLLMAdapter
from arealite.server.vllm_ext import WeightUpdateExtension
from arealite.api.weight_update import dtype_name
from arealite.weights.sync import broadcast_tensor, broadcast_weights, iter_buckets, new_weight_update_group
from arealite.utils.proc import free_port

from conftest import save_tiny_model


class FakeVLLMModel(torch.nn.Module):
    """``load_weights(weights)`` as vLLM's models have it: an iterable of ``(HF name, tensor)``;
    copies into the parameter of that name (casting dtype), KeyError on an unknown name,
    returns the loaded names. An ``nn.Module`` holding the HF model (the extension walks its
    modules for tied parameters)."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def load_weights(self, weights):
        params = dict(self.hf.named_parameters())
        loaded = set()
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded


class FakeWorker(WeightUpdateExtension):
    """What vLLM builds with ``--worker-extension-cls``: its worker with the extension as a base.
    ``reload_weights`` stands for vLLM's in-place reload (one call = one complete update) and
    records the names of each call."""

    def __init__(self, rank: int, hf):
        self.rank = rank
        self.model_runner = SimpleNamespace(model=FakeVLLMModel(hf) if hf is not None else None,
                                            device=torch.device("cpu"))
        self.reloads: list[list[str]] = []

    def reload_weights(self, weights_iterator=None, is_checkpoint_format=True):
        weights = list(weights_iterator)
        self.reloads.append([n for n, _ in weights])
        self.model_runner.model.load_weights(weights)


@contextmanager
def fake_vllm_server(workers, dev_mode: bool = True, lora_loads: list | None = None):
    """``127.0.0.1:port`` of an HTTP server with vLLM's ``POST /collective_rpc`` over ``workers``
    and, with ``lora_loads``, ``POST /v1/load_lora_adapter`` (each body appended to it; vLLM's
    plain-text reply)."""
    pool = ThreadPoolExecutor(len(workers))

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, status, obj=None):
            body = b"" if obj is None else json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._send(200 if self.path == "/health" else 404, {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            if self.path == "/v1/load_lora_adapter" and lora_loads is not None:
                lora_loads.append(body)
                text = f"Success: LoRA adapter '{body['lora_name']}' added successfully.".encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                return self.wfile.write(text)
            if self.path != "/collective_rpc" or not dev_mode:
                return self._send(404, {"detail": "Not Found"})
            if body.get("method") is None:
                return self._send(400, {"detail": "Missing 'method' in request body"})
            futures = [pool.submit(getattr(w, body["method"]), *body.get("args", []), **body.get("kwargs", {}))
                       for w in workers]  # all TP workers at once, as vLLM's executor does
            try:
                results = [f.result() for f in futures]
            except Exception as e:  # noqa: BLE001
                return self._send(500, {"detail": repr(e)})
            self._send(200, {"results": [r if r is None or isinstance(r, (dict, list)) else str(r) for r in results]})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        pool.shutdown()


@pytest.fixture(scope="module")
def model_b(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("vllm_ext") / "b"), seed=1)


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _assert_same_weights(worker_hf, sender_hf):
    got, want = worker_hf.state_dict(), sender_hf.state_dict()
    assert set(got) == set(want) and "lm_head.weight" in got
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    # tied embeddings stay tied: the output layer is the received embedding table
    assert worker_hf.lm_head.weight.data_ptr() == worker_hf.model.embed_tokens.weight.data_ptr()


def _push(addr, group, sender_hf, group_name, version, bucket_bytes, stop_after=None):
    """The trainer side of one update, bucket by bucket (what weight_sync.broadcast_weights does:
    only the last bucket carries ``weight_version``). ``stop_after``: send only that many buckets
    (a trainer that dies half-way)."""
    buckets = list(iter_buckets(((n, p.detach()) for n, p in sender_hf.named_parameters()), bucket_bytes))
    n_buckets = 0
    with ThreadPoolExecutor(1) as pool:
        for i, bucket in enumerate(buckets[:stop_after]):
            payload = {"names": [n for n, _ in bucket], "dtypes": [dtype_name(t.dtype) for _, t in bucket],
                       "shapes": [list(t.shape) for _, t in bucket], "group_name": group_name,
                       "flush_cache": True, "weight_version": version if i == len(buckets) - 1 else None}
            reply = pool.submit(post_control, VLLMAdapter, addr, VLLMAdapter.update_distributed_request(payload), 60)
            for _, t in bucket:
                broadcast_tensor(group, t.contiguous())
            assert reply.result()["success"]
            n_buckets += 1
    return n_buckets


def _join(addr, group_name, world=3):
    port = free_port("")  # a process-group master
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(post_control, VLLMAdapter, addr,
                            VLLMAdapter.init_group_request("127.0.0.1", port, 1, world, group_name, "gloo"), 60)
        group = new_weight_update_group("127.0.0.1", port, 0, world, group_name, "gloo", timeout_s=60)
        return group, reply.result()


def test_distributed_update_tp2_leaves_workers_bit_identical(tiny_model_dir, model_b):
    sender = _load(model_b)
    workers = [FakeWorker(r, _load(tiny_model_dir)) for r in (0, 1)]
    emb = "model.embed_tokens.weight"
    assert not torch.equal(workers[0].model_runner.model.hf.state_dict()[emb], sender.state_dict()[emb])
    with fake_vllm_server(workers) as addr:
        version = VLLMAdapter.parse_weight_version(post_json(addr, "/collective_rpc",
                                                             VLLMAdapter.weight_version_request[2]))
        assert version is None  # before the first update
        group, reply = _join(addr, "g")
        assert reply["message"] == "rank 0: joined 'g' as rank 1/3 (gloo); rank 1: joined 'g' as rank 2/3 (gloo)"
        n_buckets = _push(addr, group, sender, "g", version=7, bucket_bytes=64 * 1024)
        assert n_buckets > 2  # several buckets, embedding (49152×64×4 B = 12 MiB) alone in its own
        # one in-place reload per worker with every tensor, at the last bucket
        assert [len(r) for r in workers[0].reloads] == [len(list(sender.named_parameters()))]
        method, endpoint, body = VLLMAdapter.weight_version_request
        assert VLLMAdapter.parse_weight_version(post_json(addr, endpoint, body, method=method)) == 7
        # destroy: the group is gone afterwards
        assert post_control(VLLMAdapter, addr, VLLMAdapter.destroy_group_request("g"), 10)["success"]
        with pytest.raises(ServerError, match="no weight-update group 'g'"):
            post_control(VLLMAdapter, addr, VLLMAdapter.destroy_group_request("g"), 10)
    for w in workers:
        _assert_same_weights(w.model_runner.model.hf, sender)


def test_disk_reload_leaves_workers_bit_identical(tiny_model_dir, model_b):
    sender = _load(model_b)
    workers = [FakeWorker(r, _load(tiny_model_dir)) for r in (0, 1)]
    with fake_vllm_server(workers) as addr:
        reply = post_control(VLLMAdapter, addr, VLLMAdapter.disk_update(model_b, 3), 60)
        assert reply["success"] and reply["weight_version"] == 3
        assert re.fullmatch(rf"rank 0: loaded {re.escape(repr(model_b))} in [0-9.]+ s; "
                            rf"rank 1: loaded {re.escape(repr(model_b))} in [0-9.]+ s", reply["message"])
        with pytest.raises(ServerError, match="rank 0: model_path '/nonexistent' is not a folder on this server"):
            post_control(VLLMAdapter, addr, VLLMAdapter.disk_update("/nonexistent", 4), 10)
    for w in workers:
        _assert_same_weights(w.model_runner.model.hf, sender)
        assert w.arealite_weight_version()["weight_version"] == 3  # the failed load kept version 3


def test_update_errors_are_reported_per_worker(tiny_model_dir, model_b):
    sender = _load(model_b)
    workers = [FakeWorker(r, _load(tiny_model_dir)) for r in (0, 1)]
    before = {k: v.clone() for k, v in workers[0].model_runner.model.hf.state_dict().items()}
    payload = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "h",
               "weight_version": 1}
    with fake_vllm_server(workers) as addr:
        # before joining a group: refused at once, nothing received (the trainer would stop at once)
        with pytest.raises(ServerError, match="rank 0: no weight-update group 'h'; call arealite_init_group"):
            post_control(VLLMAdapter, addr, VLLMAdapter.update_distributed_request(payload), 10)
        group, _ = _join(addr, "h")
        # an unknown name: both workers receive the tensor (collectives stay aligned), then fail to load
        bad = dict(payload, names=["model.nope.weight"])
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(post_control, VLLMAdapter, addr, VLLMAdapter.update_distributed_request(bad), 30)
            broadcast_tensor(group, torch.ones(64))
            with pytest.raises(ServerError, match="loading 1 tensors failed .*partly updated"):
                fut.result()
        # the group still works afterwards
        assert _push(addr, group, sender, "h", version=2, bucket_bytes=1 << 30) == 1
        assert workers[1].arealite_weight_version()["weight_version"] == 2
    assert not torch.equal(before["model.embed_tokens.weight"], sender.model.embed_tokens.weight)
    _assert_same_weights(workers[1].model_runner.model.hf, sender)


def test_push_cut_half_way_changes_nothing_and_is_dropped(tiny_model_dir, model_b):
    """A sender that stops after the first of several buckets (it died): the staged tensors are
    never applied, the workers keep their weights and version; a new group drops them and the
    next complete push is applied in one reload."""
    sender = _load(model_b)
    workers = [FakeWorker(r, _load(tiny_model_dir)) for r in (0, 1)]
    before = {k: v.clone() for k, v in workers[0].model_runner.model.hf.state_dict().items()}
    with fake_vllm_server(workers) as addr:
        group, _ = _join(addr, "c")
        assert _push(addr, group, sender, "c", version=1, bucket_bytes=1, stop_after=3) == 3
        assert workers[0].reloads == [] and workers[0].arealite_weight_version()["weight_version"] is None
        for name, t in workers[0].model_runner.model.hf.state_dict().items():
            assert torch.equal(t, before[name]), name
        group, _ = _join(addr, "c")  # the trainer's retry: a fresh group
        n = _push(addr, group, sender, "c", version=2, bucket_bytes=1)
        assert n == len(list(sender.named_parameters()))  # one tensor per bucket
        assert [len(r) for r in workers[1].reloads] == [n]  # the 3 stale tensors were dropped
    for w in workers:
        _assert_same_weights(w.model_runner.model.hf, sender)
        assert w.arealite_weight_version()["weight_version"] == 2


def test_rank_outside_the_group_is_refused():
    reply = FakeWorker(1, None).arealite_init_group("127.0.0.1", 1, rank_offset=2, world_size=3, group_name="x",
                                                   backend="gloo")
    assert reply == {"success": False, "rank": 1, "weight_version": None,
                     "message": "rank_offset 2 + worker rank 1 = 3 is outside [1, world_size=3) (rank 0 is the trainer)"}


def test_server_without_dev_mode_or_extension_is_a_clear_error():
    with fake_vllm_server([FakeWorker(0, None)], dev_mode=False) as addr:
        with pytest.raises(ServerError, match="answered 404.*VLLM_SERVER_DEV_MODE"):
            post_control(VLLMAdapter, addr, VLLMAdapter.disk_update("/w", 1), 10)
    with pytest.raises(ServerError, match="--worker-extension-cls arealite.server.vllm_ext.WeightUpdateExtension"):
        VLLMAdapter.control_reply({"results": ["None"]})  # a method that is not ours answered
    with pytest.raises(ServerError, match=r"different weight versions \['3', '4'\]"):
        VLLMAdapter.parse_weight_version({"results": [{"success": True, "weight_version": 3},
                                                      {"success": True, "weight_version": 4}]})


def test_extension_methods_are_prefixed():
    """vLLM refuses an extension attribute that its worker already has: ours are all prefixed."""
    names = [n for n in vars(WeightUpdateExtension) if not n.startswith("__")]
    assert names and all(n.startswith(("arealite_", "_arealite_")) for n in names)


def test_broadcast_weights_through_the_vllm_adapter(tiny_model_dir, model_b):
    sender = _load(model_b)
    workers = [FakeWorker(r, _load(tiny_model_dir)) for r in (0, 1)]
    with fake_vllm_server(workers) as addr:
        stats = broadcast_weights(sender, [addr], version=5, bucket_bytes=64 * 1024, backend="gloo", tp_size=2,
                                  group_name="bw", timeout_s=60, adapter=VLLMAdapter)
        assert stats["n_tensors"] == len(list(sender.named_parameters()))
    for w in workers:
        _assert_same_weights(w.model_runner.model.hf, sender)
        assert w.arealite_weight_version()["weight_version"] == 5


def test_engine_disk_update_and_version_check_with_vllm(tiny_model_dir, model_b):
    from arealite.api.config import InferenceEngineConfig
    from arealite.api.io_struct import WeightUpdateMeta
    from arealite.inference.remote import RemoteInferenceEngine

    sender = _load(model_b)
    workers = [FakeWorker(r, _load(tiny_model_dir)) for r in (0, 1)]
    with fake_vllm_server(workers) as addr:
        engine = RemoteInferenceEngine(InferenceEngineConfig(backend="vllm", request_retries=1), [addr])
        engine.update_weights(WeightUpdateMeta(type="disk", path=model_b, version=4))
        engine.update_weights(WeightUpdateMeta(type="distributed", path="", version=4))  # version check passes
        with pytest.raises(ServerError, match="reports weight_version 4 after a distributed update to version 5"):
            engine.update_weights(WeightUpdateMeta(type="distributed", path="", version=5))
        with pytest.raises(ServerError, match="failed"):
            engine.update_weights(WeightUpdateMeta(type="disk", path="/nonexistent", version=6))
    for w in workers:
        _assert_same_weights(w.model_runner.model.hf, sender)


def test_a_lora_push_becomes_a_peft_folder_that_vllm_loads_by_name(tiny_model_dir, tmp_path):
    """A LoRA actor's distributed push to vLLM (TP 2): only A and s·B travel; the workers reload
    nothing, worker 0 writes a PEFT folder, and the engine has the server load it in place under
    ``VLLMAdapter.lora_name``. That folder, loaded by PEFT on the base model, computes what the
    trainer's adapter computes (the scale folded into B, lora_alpha = r); a disk push loads the
    trainer's own folder. Requests then name the adapter."""
    from peft import PeftModel

    from arealite.api.config import InferenceEngineConfig, LoRAConfig
    from arealite.api.io_struct import WeightUpdateMeta
    from arealite.inference.remote import RemoteInferenceEngine
    from arealite.train_engine import lora

    torch.manual_seed(0)
    peft_model, hf = lora.wrap_model(_load(tiny_model_dir), LoRAConfig(rank=4, alpha=16, target_modules=["all-linear"]))
    for n, p in hf.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    workers = [FakeWorker(r, _load(tiny_model_dir)) for r in (0, 1)]
    loads = []
    with fake_vllm_server(workers, lora_loads=loads) as addr:
        cfg = InferenceEngineConfig(backend="vllm", request_retries=1)
        engine = RemoteInferenceEngine(cfg, [addr], lora_rank=4)
        assert engine.serves_lora and not RemoteInferenceEngine(cfg, [addr]).serves_lora
        with pytest.raises(ValueError, match="without lora_rank"):
            RemoteInferenceEngine(cfg, [addr]).update_weights(WeightUpdateMeta("disk", "/x", 1, backend="vllm", lora=True))
        source = (lora.sync_specs(hf, merged=False), lora.sync_tensors(hf, merged=False))
        stats = broadcast_weights(hf, [addr], version=3, bucket_bytes=4096, backend="gloo", tp_size=2,
                                  group_name="lora", timeout_s=60, adapter=VLLMAdapter, source=source)
        assert stats["n_tensors"] == 2 * len(lora.lora_layers(hf))
        assert all(w.reloads == [] for w in workers)  # the base weights are untouched
        engine.update_weights(WeightUpdateMeta("distributed", "", 3, [addr], backend="vllm", lora=True))
        with pytest.raises(ServerError, match="weight_version 3 .* version 4"):
            engine.update_weights(WeightUpdateMeta("distributed", "", 4, [addr], backend="vllm", lora=True))
        engine.update_weights(WeightUpdateMeta("disk", str(tmp_path / "trainer_adapter"), 5, [addr], backend="vllm",
                                               lora=True))
    folder = workers[0].arealite_lora_path()["lora_path"]
    assert workers[1].arealite_lora_path()["lora_path"] is None  # only worker 0 writes
    assert loads == [{"lora_name": "arealite-lora", "lora_path": folder, "load_inplace": True},
                     {"lora_name": "arealite-lora", "lora_path": str(tmp_path / "trainer_adapter"), "load_inplace": True}]
    ids = torch.tensor([[1, 5, 9, 200, 17, 3, 88, 41]])
    served = PeftModel.from_pretrained(_load(tiny_model_dir), folder).eval()
    with torch.no_grad():
        want, got, base = peft_model.eval()(ids).logits, served(ids).logits, _load(tiny_model_dir)(ids).logits
    assert (want - base).abs().max() > 0.1  # the adapter matters
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # requests name the adapter
    sent = {}

    async def fake_segment(rid, payload):
        sent.update(payload)
        return {"choices": [{"logprobs": {"tokens": ["token_id:7"], "token_logprobs": [-0.5]}, "finish_reason": "length"}]}

    import asyncio

    from arealite.api.config import GenerationConfig
    from arealite.api.io_struct import ModelRequest

    engine._generate_segment = fake_segment
    asyncio.run(engine.agenerate(ModelRequest(rid="r", input_ids=[1, 2], gconfig=GenerationConfig(max_new_tokens=1))))
    assert sent["model"] == "arealite-lora" and sent["prompt"] == [1, 2]


def test_a_restarted_vllm_server_gets_the_lora_adapter_even_at_version_0(tiny_model_dir, tmp_path):
    """Requests name the adapter, which a restarted vLLM holds only after a load: rank 0 loads it
    (disk) or waits for the next push (distributed) even at version 0, and the other ranks do not
    readmit a server that reports no version yet."""
    from arealite.api.config import InferenceEngineConfig
    from arealite.api.io_struct import WeightUpdateMeta
    from arealite.inference.remote import RemoteInferenceEngine
    from arealite.launcher.local import ServerFollower, catch_up

    workers = [FakeWorker(0, _load(tiny_model_dir))]
    loads = []
    with fake_vllm_server(workers, lora_loads=loads) as addr:
        cfg = InferenceEngineConfig(backend="vllm", request_retries=1)
        engine = RemoteInferenceEngine(cfg, [addr], lora_rank=4)
        follower = ServerFollower(engine, cfg)
        assert follower._server_version(addr) == -1  # no adapter loaded yet: not current, even at version 0
        assert catch_up(engine, addr, cfg) is False and loads == []  # before any push: waits for it
        engine.update_weights(WeightUpdateMeta("disk", str(tmp_path / "adapter"), 0, [addr], backend="vllm", lora=True))
        assert workers[0].arealite_weight_version()["weight_version"] == 0  # set after vLLM's own load
        assert follower._server_version(addr) == 0
        workers[0]._arealite_version = None  # the server restarts: no adapter, no version
        engine.restarting.add(addr)
        assert catch_up(engine, addr, cfg) is True and addr not in engine.restarting
        assert [b["lora_path"] for b in loads] == [str(tmp_path / "adapter")] * 2
        assert workers[0].arealite_weight_version()["weight_version"] == 0
        plain = RemoteInferenceEngine(cfg, [addr])  # full fine-tuning: version 0 is the start-up weights
        workers[0]._arealite_version = None
        assert ServerFollower(plain, cfg)._server_version(addr) == 0


def test_tied_modules_are_post_processed_again():
    """The tied LM head gets no checkpoint tensor in a reload, so its post-processing (on vLLM-CPU
    a packed GEMM handle of the embedding) is re-run; modules with their own weights are not."""
    from arealite.server.vllm_ext import reprocess_shared_modules

    class Method:
        def __init__(self):
            self.seen = []

        def process_weights_after_loading(self, layer):
            self.seen.append(layer.weight.detach().clone())

    model = torch.nn.Module()
    model.embed, model.head, model.other = torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False), torch.nn.Linear(3, 3)
    model.head.weight = model.embed.weight  # tied
    for m in (model.embed, model.head, model.other):
        m.quant_method = Method()
    with torch.no_grad():
        model.embed.weight.fill_(2.0)
    assert reprocess_shared_modules(model) == ["embed", "head"]
    assert len(model.head.quant_method.seen) == 1 and torch.equal(model.head.quant_method.seen[0], torch.full((5, 3), 2.0))
    assert model.other.quant_method.seen == []


def test_a_given_engine_without_lora_rank_is_refused_for_a_lora_actor_on_vllm():
    from arealite.api.config import GRPOConfig
    from arealite.inference.remote import RemoteInferenceEngine
    from arealite.trainer.rl_loop import _check_given_engine

    cfg = GRPOConfig()
    cfg.actor.lora.rank, cfg.rollout.backend = 8, "vllm"
    with pytest.raises(ValueError, match="lora_rank=config.actor.lora.rank"):
        _check_given_engine(cfg, RemoteInferenceEngine(cfg.rollout, ["127.0.0.1:1"]))
    _check_given_engine(cfg, RemoteInferenceEngine(cfg.rollout, ["127.0.0.1:1"], lora_rank=8))
    cfg.actor.lora.rank = 0  # full fine-tuning: nothing to name
    _check_given_engine(cfg, RemoteInferenceEngine(cfg.rollout, ["127.0.0.1:1"]))
