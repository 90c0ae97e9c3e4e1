"""Admission/staleness rule and the asynchronous executor, with a fake in-process engine."""

import asyncio
import time

import pytest
import torch

from arealite.api.config import InferenceEngineConfig
from arealite.api.workflow import RolloutWorkflow
from arealite.api.engine import InferenceEngine
from arealite.rollout.executor import WorkflowExecutor
from arealite.rollout.staleness import StalenessManager


def test_capacity_formula():
    m = StalenessManager(consumer_batch_size=4, max_concurrent_rollouts=100, max_head_offpolicyness=1)
    assert m.capacity(version=0) == 8  # (η + v + 1)·B
    for _ in range(5):
        m.on_start()
    assert m.capacity(0) == 3
    for _ in range(5):
        m.on_finish(accepted=True)
    assert m.capacity(0) == 3  # accepted is cumulative
    assert m.capacity(1) == 7
    m2 = StalenessManager(4, max_concurrent_rollouts=2, max_head_offpolicyness=0)
    m2.on_start()
    assert m2.capacity(0) == 1  # bounded by concurrency


def test_rejected_episodes_free_capacity():
    m = StalenessManager(2, 10, 0)
    m.on_start()
    m.on_start()
    assert m.capacity(0) == 0
    m.on_finish(accepted=False)
    assert m.capacity(0) == 1 and m.stat.rejected == 1


def test_freshness_rule():
    m = StalenessManager(1, 1, max_head_offpolicyness=2)
    assert m.is_fresh(3, version=5)
    assert not m.is_fresh(2, version=5)
    assert m.is_fresh(-1, version=100)  # no generated tokens


@pytest.mark.parametrize("field,value", [("consumer_batch_size", 0), ("max_head_offpolicyness", -1)])
def test_bad_staleness_config_names_the_field(field, value):
    kwargs = dict(consumer_batch_size=1, max_concurrent_rollouts=1, max_head_offpolicyness=0)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        StalenessManager(**kwargs)


class FakeEngine(InferenceEngine):
    """Stands in for the inference engine: 'generation' takes `gen_time` seconds and every token is
    tagged with the engine's version at the time it finishes (like the server's weight_version)."""

    def __init__(self, gen_time=0.05):
        self.gen_time = gen_time

    async def agenerate(self, req): raise NotImplementedError
    def update_weights(self, meta): ...
    def pause_generation(self): ...
    def continue_generation(self): ...


class FakeWorkflow(RolloutWorkflow):
    def __init__(self, fail_on=()):
        self.fail_on = set(fail_on)
        self.starts = []  # (time, row id)

    async def arun_episode(self, engine, data):
        self.starts.append((time.time(), data["id"]))
        if data["id"] in self.fail_on:
            raise RuntimeError("boom in one episode")
        await asyncio.sleep(engine.gen_time)
        v = engine.get_version()
        return {
            "input_ids": torch.tensor([[1, 2, 3]]),
            "attention_mask": torch.ones(1, 3, dtype=torch.bool),
            "loss_mask": torch.tensor([[0, 1, 1]]),
            "logprobs": torch.zeros(1, 3),
            "versions": torch.tensor([[-1, v, v]]),
            "rewards": torch.tensor([float(data["id"])]),
        }


def make_executor(eta, batch=4, gen_time=0.05):
    engine = FakeEngine(gen_time)
    cfg = InferenceEngineConfig(consumer_batch_size=batch, max_head_offpolicyness=eta, max_concurrent_rollouts=64)
    ex = WorkflowExecutor(cfg, engine)
    ex.initialize()
    return ex


def test_episode_exception_does_not_kill_the_loop():
    ex = make_executor(eta=0)
    wf = FakeWorkflow(fail_on={1})
    try:
        for i in range(4):
            ex.submit({"id": i}, wf)
        out = ex.wait(3, timeout=10)
        assert sorted(out["rewards"].tolist()) == [0.0, 2.0, 3.0]
        assert ex.staleness.stat.failed == 1
        ex.submit({"id": 7}, wf)  # loop still alive
        assert ex.wait(1, timeout=10)["rewards"].tolist() == [7.0]
    finally:
        ex.destroy()


def test_wait_times_out_without_losing_results():
    ex = make_executor(eta=0, gen_time=0.01)
    wf = FakeWorkflow()
    try:
        ex.submit({"id": 1}, wf)
        with pytest.raises(TimeoutError):
            ex.wait(2, timeout=0.5)
        ex.submit({"id": 2}, wf)
        assert sorted(ex.wait(2, timeout=10)["rewards"].tolist()) == [1.0, 2.0]
    finally:
        ex.destroy()


class FixedWorkflow(RolloutWorkflow):
    """Returns the trajectory stored under the row's ``id`` (its versions set by the test)."""

    def __init__(self, trajectories):
        self.trajectories = trajectories

    async def arun_episode(self, engine, data):
        return self.trajectories[data["id"]]


def _rows(n: int, reward: float) -> dict:
    return {"input_ids": torch.full((n, 2), 7), "attention_mask": torch.ones(n, 2, dtype=torch.bool),
            "loss_mask": torch.tensor([[0, 1]] * n), "logprobs": torch.zeros(n, 2),
            "versions": torch.tensor([[-1, 0]] * n), "rewards": torch.full((n,), reward)}


def test_an_episode_of_part_of_a_group_is_refused():
    """Group baselines normalise over consecutive rows: episodes of 3 and 5 rows in groups of 4
    would put a row of the second prompt in the first prompt's group. Whole groups (4, 8) pass."""
    ex = make_executor(eta=0)
    ex.group_size = 4
    try:
        wf = FixedWorkflow({0: _rows(4, 0.0), 1: _rows(8, 1.0), 2: _rows(3, 2.0)})
        ex.submit({"id": 0}, wf)
        ex.submit({"id": 1}, wf)
        assert ex.wait(2, timeout=10)["rewards"].tolist() == [0.0] * 4 + [1.0] * 8
        ex.submit({"id": 2}, wf)
        with pytest.raises(ValueError, match=r"returned 3 rows, not a whole number of groups of 4 \(gconfig.n_samples\)"):
            ex.wait(1, timeout=10)
    finally:
        ex.destroy()


def test_stale_trajectory_is_dropped_never_returned():
    ex = make_executor(eta=1)
    try:
        old = {"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.ones(1, 2, dtype=torch.bool),
               "loss_mask": torch.tensor([[0, 1]]), "logprobs": torch.zeros(1, 2),
               "versions": torch.tensor([[-1, 0]]), "rewards": torch.tensor([-1.0])}
        fresh = dict(old, versions=torch.tensor([[-1, 2]]), rewards=torch.tensor([5.0]))
        wf = FixedWorkflow({0: old, 1: fresh})
        ex.submit({"id": 0}, wf)
        ex.submit({"id": 1}, wf)
        deadline = time.monotonic() + 10
        while ex.staleness.stat.accepted < 2:  # both finished and queued, the old one first
            assert time.monotonic() < deadline, "the two episodes did not finish"
            time.sleep(0.01)
        ex.engine.set_version(3)  # bound: oldest token version >= 3 - 1 = 2
        out = ex.wait(1, timeout=5)
        assert out["rewards"].tolist() == [5.0]
        assert ex.staleness.stat.dropped_stale == 1
    finally:
        ex.destroy()


def run_training(eta, steps=4, batch=4, train_time=0.3):
    """A fake trainer loop: prepare_batch → 'train' (sleep) → version bump. Returns per-step
    (staleness, number of rows whose generation began before the previous training step ended,
    rows)."""
    ex = make_executor(eta, batch=batch)
    wf = FakeWorkflow()
    data = [[{"id": i * batch + j} for j in range(batch)] for i in range(1000)]
    results = []
    prev_train_end = 0.0
    try:
        for step in range(steps):
            b = ex.prepare_batch(data, wf)
            gen = b["versions"][b["versions"] >= 0]
            staleness = step - int(gen.min())
            started_early = int((b["rollout_start_time"] < prev_train_end).sum())
            time.sleep(train_time)  # training; the rollout thread keeps generating if allowed
            ex.pause()
            ex.engine.set_version(step + 1)
            ex.resume()
            prev_train_end = time.time()
            results.append((staleness, started_early, b["rewards"].numel()))
    finally:
        ex.destroy()
    return results


def test_async_mode_overlaps_and_never_exceeds_the_bound():
    results = run_training(eta=1)
    assert all(s <= 1 for s, _, _ in results), results
    # generation for step k+1 began before training of step k ended (overlap), for every row
    assert all(n == rows for _, n, rows in results[1:]), results


def test_sync_mode_never_generates_during_training():
    results = run_training(eta=0)
    assert all(s == 0 for s, _, _ in results), results
    assert all(n == 0 for _, n, _ in results), results


def test_bound_two_allows_at_most_two_versions_of_staleness():
    results = run_training(eta=2, steps=5, train_time=0.2)
    assert all(s <= 2 for s, _, _ in results), results


def test_concatenated_batches_pad_versions_with_minus_one():
    from arealite.utils.data import concat_padded

    a = {"versions": torch.tensor([[-1, 3, 3]]), "loss_mask": torch.tensor([[0, 1, 1]])}
    b = {"versions": torch.tensor([[-1, 4]]), "loss_mask": torch.tensor([[0, 1]])}
    out = concat_padded([a, b])
    assert out["versions"].tolist() == [[-1, 3, 3], [-1, 4, -1]]  # padding is never "version 0"
    assert out["loss_mask"].tolist() == [[0, 1, 1], [0, 1, 0]]


def test_every_episode_failing_raises_instead_of_hanging():
    ex = make_executor(eta=0, batch=2, gen_time=0.0)
    wf = FakeWorkflow(fail_on=set(range(1000)))
    data = [[{"id": 2 * i}, {"id": 2 * i + 1}] for i in range(500)]
    try:
        with pytest.raises(RuntimeError, match="in a row failed") as info:
            ex.prepare_batch(data, wf)
        assert "boom" in str(info.value)
    finally:
        ex.destroy()


def test_the_loop_closes_each_workflows_event_loop_resources_when_it_ends():
    """A workflow's ``aclose`` (e.g. a reward source's HTTP sessions) runs once, on the executor's
    own event loop, when the loop ends; a duck-typed workflow without one is left alone."""

    class Closing(FakeWorkflow):
        closed_on = []

        async def aclose(self):
            self.closed_on.append(asyncio.get_running_loop())

    class Bare:  # not a RolloutWorkflow: no aclose
        async def arun_episode(self, engine, data):
            return await FakeWorkflow().arun_episode(engine, data)

    ex = make_executor(eta=0, gen_time=0.01)
    wf = Closing()
    loops = []

    class Probe(FakeWorkflow):
        async def arun_episode(self, engine, data):
            loops.append(asyncio.get_running_loop())
            return await super().arun_episode(engine, data)

    for i, w in enumerate((wf, wf, Bare(), Probe())):
        ex.submit({"id": i}, w)
    assert len(ex.wait(4, timeout=10)["rewards"]) == 4
    ex.destroy()
    assert wf.closed_on == [loops[0]]  # once, on the loop that ran its episodes
