"""Core sharing (arealite/trainer/cores.py): the trainer's thread count follows the servers' idleness."""

import os

import pytest
import torch

from arealite.api.config import InferenceEngineConfig
from arealite.trainer.cores import CoreSharing, core_sharing_for


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture(autouse=True)
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_threads_follow_busy_with_the_idle_delay_and_count_shared_time():
    clock, state = Clock(), {"busy": True}
    cs = CoreSharing(1, 1, lambda: state["busy"], idle_s=0.5, clock=clock)
    assert cs.adjust() == 1 and torch.get_num_threads() == 1
    state["busy"] = False
    assert cs.adjust() == 1  # idle for 0 s: not yet
    clock.t += 0.4
    assert cs.adjust() == 1  # 0.4 s < idle_s
    clock.t += 0.1
    assert cs.adjust() == 2 and torch.get_num_threads() == 2  # idle for 0.5 s: the server's core too
    clock.t += 3.0
    state["busy"] = True
    assert cs.adjust() == 1 and torch.get_num_threads() == 1  # a request started: back at once
    assert cs.shared_s == pytest.approx(3.0)
    state["busy"] = False
    clock.t += 0.2
    assert cs.adjust() == 1  # the idle clock restarted at the last busy check
    clock.t += 0.5
    assert cs.adjust() == 2
    clock.t += 1.5
    cs.release()  # before a weight sync: the servers get their cores back
    assert cs.threads == 1 and torch.get_num_threads() == 1
    assert cs.shared_s == pytest.approx(4.5) and cs.switches == 4


def test_hooks_check_before_every_block_forward_and_backward(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    n_layers = len(model.model.layers)
    calls, seen = [], []
    state = {"busy": False}

    def busy():
        calls.append(torch.is_grad_enabled())
        seen.append(torch.get_num_threads())
        return state["busy"]

    cs = CoreSharing(1, 1, busy, idle_s=0.0)
    assert cs.install(model) == 1 + n_layers
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
    assert len(calls) == 1 + n_layers  # the model + each block, before its forward
    assert torch.get_num_threads() == 2  # idle: the second core from the first check on
    state["busy"] = True
    loss.backward()
    assert len(calls) == 1 + 2 * n_layers  # + each block's backward (a gradient hook on its output)
    assert torch.get_num_threads() == 1  # a request started during the backward: back to 1 thread
    cs.remove()
    model(input_ids=ids)
    assert len(calls) == 1 + 2 * n_layers  # hooks gone


def test_gradients_equal_without_core_sharing(tiny_model_dir):
    """Switching threads mid-step changes no result beyond float reassociation."""
    from transformers import AutoModelForCausalLM

    def grads(share: bool):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        flip = iter([False, True] * 100)
        if share:
            CoreSharing(1, 1, lambda: next(flip), idle_s=0.0).install(model)
        ids = torch.randint(0, model.config.vocab_size, (2, 8))
        model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    for a, b in zip(grads(False), grads(True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_when_sharing_applies(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)

    from arealite.inference.remote import RemoteInferenceEngine

    class Engine(RemoteInferenceEngine):  # the servers' HTTP client, without servers
        n = 0

        def __init__(self):
            pass

        def requests_in_flight(self):
            return self.n

    class LocalEngine(Engine):
        def __init__(self):
            self.sent = []

        def set_server_threads(self, n):
            self.sent.append(n)

    cpu, e = torch.device("cpu"), Engine()
    cfg = InferenceEngineConfig(n_servers=1, server_threads=2)
    cs = core_sharing_for(cfg, 0, e, 1, cpu)
    assert (cs.base, cs.extra) == (2, 2)  # static split 2 + 2; idle servers give their 2
    assert cs.busy() is False
    e.n = 3
    assert cs.busy() is True
    local = LocalEngine()
    cs = core_sharing_for(cfg, 0, local, 1, cpu)
    cs.lend(True), cs.lend(False)
    assert local.sent == [4, 2]  # a waiting trainer lends its 2 threads; then the server's own 2
    assert core_sharing_for(InferenceEngineConfig(backend="vllm", server_threads=2), 0, local, 1, cpu).lend is None
    assert core_sharing_for(InferenceEngineConfig(n_servers=3, server_threads=1), 0, local, 1, cpu).lend is None  # 1 // 3
    assert core_sharing_for(InferenceEngineConfig(share_idle_cores=False), 0, e, 1, cpu) is None
    assert core_sharing_for(InferenceEngineConfig(addresses=["h:1"]), 0, e, 1, cpu) is None  # remote servers
    assert core_sharing_for(cfg, 3, e, 1, cpu) is None  # actor.num_threads given: kept
    assert core_sharing_for(cfg, 0, e, 2, cpu) is None  # several ranks
    assert core_sharing_for(cfg, 0, e, 1, torch.device("meta")) is None  # not a CPU trainer
    assert core_sharing_for(cfg, 0, object(), 1, cpu) is None  # not the servers' client: no in-flight count
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    cs = core_sharing_for(InferenceEngineConfig(n_servers=1, server_threads=1), 0, e, 1, cpu)
    assert (cs.base, cs.extra) == (1, 1)


def test_waiting_lends_the_trainer_cores_after_the_idle_delay():
    import time

    sent = []
    cs = CoreSharing(1, 1, lambda: False, idle_s=0.05, lend=sent.append)
    assert cs.adjust() == 1 and cs.adjust() == 1
    cs.idle_s = 0.0
    assert cs.adjust() == 2  # idle servers: the trainer holds both cores
    cs.idle_s = 0.05
    with cs.waiting():
        assert cs.threads == 1 and torch.get_num_threads() == 1  # a waiting trainer gives its extra back
    assert sent == []  # a wait shorter than idle_s sends nothing
    with cs.waiting():
        time.sleep(0.3)
        assert sent == [True]  # lent after idle_s, while still waiting
    assert sent == [True, False]  # taken back on leaving, before the caller computes
    assert 0.2 < cs.lent_s < 1.0

    def broken(on):
        raise OSError("server gone")

    cs = CoreSharing(1, 1, lambda: False, idle_s=0.0, lend=broken)
    with cs.waiting():  # logged, not raised: a thread count never fails the run
        time.sleep(0.05)
    assert cs.lent_s > 0
    with CoreSharing(1, 1, lambda: False).waiting():  # lend=None: a plain wait
        pass
