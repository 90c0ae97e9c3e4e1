"""The asynchronous RL training loop that every RL recipe runs: setup, then a short step loop.

    from arealite.trainer.rl_loop import run_rl
    run_rl(config, build_algorithm, build_workflow)        # = train(setup_rl(...))

A recipe supplies two builders (``recipes/grpo_math.py`` is the model to copy):

* ``build_algorithm(config, actor, ref) -> Algorithm``: :meth:`~arealite.api.algorithm.Algorithm.update`
  turns a batch into updates (GRPO, GSPO, PPO — with its ``critic`` engine —, online DPO, …);
* ``build_workflow(config, tokenizer, dump_dir) -> RolloutWorkflow``: the rollout of one data
  row (single-turn RLVR, multi-turn feedback, tool agent, an OpenAI-style agent, …), with
  ``aevaluate(engine, rows)`` for the held-out evaluation.

:func:`setup_rl` builds a run's parts (:class:`RLRun`: data, the inference engine — the launched
servers' HTTP client unless one is passed in —, the rollout executor, the FSDP2 actor and
reference, the algorithm, logger, evaluator, core sharing); :func:`train` is the step loop, read
top to bottom: (1) wait for a batch of finished rollouts (generated asynchronously, at most
``rollout.max_head_offpolicyness`` versions old) → (2) ``algorithm.update`` → (3) push the new
weights to the inference servers (:func:`arealite.trainer.weight_update.sync_weights`) → (4) log,
evaluate, save. ``recipes/grpo_custom_loop.py`` writes the same loop out in a recipe. Every recipe
gets recover checkpoints (``--recover.freq_steps N``, ``--recover.mode auto``), DAPO dynamic
sampling (``--algo.dynamic_sampling True``), saving (``saver.freq_steps``), evaluation
(``evaluator.*``) and logging (``stats.jsonl``, tensorboard).

Outputs under ``fileroot/experiment_name/trial_name/``: ``config.yaml``, ``stats.jsonl``,
``tensorboard/``, ``rollouts/rollouts.jsonl``, ``logs/`` (server logs), ``final/`` (HF
checkpoint), ``checkpoints/stepK`` and ``recover/stepK``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import yaml

from arealite.algorithms.grpo import DynamicSampling
from arealite.api.algorithm import Algorithm
from arealite.api.cli import check_model_fits, to_dict, validate_config
from arealite.api.config import GenerationConfig, GRPOAlgoConfig
from arealite.api.engine import InferenceEngine
from arealite.api.workflow import RolloutWorkflow
from arealite.dataset.loader import EpochLoader, load_rows, make_dataloader
from arealite.dataset.math_data import load_dataset
from arealite.evaluate import BackgroundEvaluator, aevaluate_samples
from arealite.launcher.local import make_inference_engine, trainer_threads
from arealite.report import write_report
from arealite.rollout.executor import WorkflowExecutor
from arealite.train_engine.fsdp import FSDPEngine, init_distributed
from arealite.train_engine.lora import LoRAReference
from arealite.trainer.cores import CoreSharing, core_sharing_for
from arealite.trainer.entry import load_run_config
from arealite.trainer.weight_update import sync_weights
from arealite.utils import trace
from arealite.utils.hf import load_tokenizer, resolve_model_path
from arealite.utils.recover import list_checkpoints, load_checkpoint, resolve_checkpoint, save_checkpoint, should_save
from arealite.utils.stats_logger import StatsLogger, require_wandb

BuildAlgorithm = Callable[[Any, FSDPEngine, "FSDPEngine | LoRAReference | None"], Algorithm]
BuildWorkflow = Callable[[Any, Any, "str | None"], RolloutWorkflow]


def all_reduce(values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
    """``values`` reduced over the trainer ranks (float64)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist()


def rollout_stats(batch: dict, version: int, prev_train_end: float, executor: WorkflowExecutor,
                  stat_keys: tuple[str, ...] = ()) -> dict[str, float]:
    """Batch statistics over all ranks. Staleness = trainer version − oldest version among the
    trained tokens (≤ η by construction; ``staleness_mean`` averages over those tokens);
    overlap = share of rows whose generation began before the previous training step ended
    (0 in synchronous mode); ``rollout/<key>`` = batch mean of each workflow ``stat_keys``
    tensor [B] (e.g. ``turns``)."""
    gen = batch["versions"][batch["loss_mask"].bool()]  # versions of the trained tokens
    reward_sum, n_tokens, no_eos, overlap, n, stale_sum, n_gen, *extra = all_reduce([
        float(batch["rewards"].sum()), float(batch["attention_mask"].sum()),
        float(batch["no_eos"].sum()) if "no_eos" in batch else 0.0,
        float((batch["rollout_start_time"] < prev_train_end).sum()), float(batch["rewards"].numel()),
        float((version - gen).sum()), float(gen.numel()), *(float(batch[k].float().sum()) for k in stat_keys),
    ])
    stale_max, = all_reduce([float(version - gen.min()) if gen.numel() else 0.0], dist.ReduceOp.MAX)
    first_start, = all_reduce([float(batch["rollout_start_time"].min())], dist.ReduceOp.MIN)
    stat = executor.staleness.stat
    stats = {
        "rollout/reward": reward_sum / n, "rollout/staleness_max": stale_max,
        "rollout/staleness_mean": stale_sum / max(n_gen, 1.0), "rollout/no_eos_ratio": no_eos / n,
        "rollout/overlap_frac": overlap / n, "rollout/n_samples": n, "rollout/n_tokens": n_tokens,
        "rollout/dropped_stale": float(stat.dropped_stale), "rollout/failed": float(stat.failed),
        "rollout/rejected": float(stat.rejected),
        "time/batch_rollout_start_min": first_start,
    }
    stats.update({f"rollout/{k}": v / n for k, v in zip(stat_keys, extra)})
    return stats


def reward_stats(workflow: RolloutWorkflow) -> dict[str, float]:
    """The workflow's :meth:`~arealite.api.workflow.RolloutWorkflow.reward_counters` summed over the
    ranks (``reward/calls``, ``reward/timeout``, ``reward/crash``, ...: failures score 0); {} when
    it has none. Collective."""
    counters = workflow.reward_counters()
    names = sorted(counters)
    return dict(zip(names, all_reduce([float(counters[k]) for k in names]))) if names else {}


def workflow_counter_stats(workflow: RolloutWorkflow) -> dict[str, float]:
    """``workflow/<name>``: the workflow's cumulative :meth:`~arealite.api.workflow.RolloutWorkflow.counters`
    summed over the ranks (e.g. ``workflow/timed_out`` of agent sessions); {} when it has none.
    Collective."""
    counters = workflow.counters()
    names = sorted(counters)
    return {f"workflow/{k}": v for k, v in zip(names, all_reduce([float(counters[k]) for k in names]))} if names else {}


@dataclass
class RLRun:
    """The parts of one RL run, built by :func:`setup_rl`, stepped by :func:`train`, ended by
    :func:`finish`. A recipe that writes its own loop (``recipes/grpo_custom_loop.py``) uses them
    directly.

    Attributes:
        config: the run's config (fields of :class:`~arealite.api.config.GRPOConfig`).
        rank, world: this trainer rank and the number of trainer ranks.
        workflow: what the executor runs (DAPO's :class:`~arealite.algorithms.grpo.DynamicSampling`
            around ``base_workflow`` with ``algo.dynamic_sampling``, else ``base_workflow``).
        base_workflow: the recipe's workflow (evaluation, counters, close).
        valid_rows: held-out rows for the evaluations.
        loader: the training data position (saved in recover checkpoints).
        inference: the inference engine (the launched servers' HTTP client by default).
        owns_inference: True when :func:`setup_rl` built ``inference`` (then :func:`finish`
            destroys it; a caller's engine is left to the caller).
        executor: the rollout executor (asyncio thread, staleness rule).
        actor: the trained policy; ref: the frozen reference (``algo.kl_coef > 0``) or None.
        algorithm: the recipe's algorithm (``update(batch) -> stats``; ``critic`` or None).
        logger: ``stats.jsonl`` / tensorboard / wandb.
        cores: core sharing between the trainer and the launched servers, or None.
        evaluator: the in-loop background evaluator (rank 0, ``evaluator.freq_steps``) or None.
        tracer: the timeline recorder (``AREALITE_TRACE``) or None.
        recover_path: the recover checkpoint to resume from, or None.
    """

    config: Any
    rank: int
    world: int
    workflow: RolloutWorkflow
    base_workflow: RolloutWorkflow
    valid_rows: list[dict]
    loader: EpochLoader
    inference: InferenceEngine
    owns_inference: bool
    executor: WorkflowExecutor
    actor: FSDPEngine
    ref: Any
    algorithm: Algorithm
    logger: StatsLogger
    cores: CoreSharing | None = None
    evaluator: BackgroundEvaluator | None = None
    tracer: trace.Tracer | None = None
    recover_path: str | None = None
    trained_samples: int = 0  # over all ranks, since the start of this process
    prev_train_end: float = 0.0  # when the previous update ended (overlap evidence)
    run_start: float = field(default_factory=time.time)

    @property
    def out(self) -> str:
        return self.config.output_dir

    @property
    def weight_dir(self) -> str:  # the disk weight push (overwritten every step)
        return os.path.join(self.out, "weight_update")

    @property
    def trace_path(self) -> str:
        return os.path.join(self.out, "trace.json" if self.rank == 0 else f"trace_rank{self.rank}.json")

    @property
    def engines(self) -> dict[str, Any]:
        """The trained engines a recover checkpoint holds: ``actor`` (+ ``critic``)."""
        return {"actor": self.actor, **({"critic": self.algorithm.critic} if self.algorithm.critic is not None else {})}

    @property
    def stateful(self) -> dict[str, Any]:
        """What else a recover checkpoint holds: the executor's pulled prompts, the data position."""
        return {"rollout": self.executor, "data": self.loader}

    def waiting(self):
        """Context for a wait on the servers: core sharing lends them the trainer's cores."""
        return self.cores.waiting() if self.cores is not None else contextlib.nullcontext()

    def evaluate(self, when: str) -> dict[str, float]:
        """Greedy held-out episodes through the inference engine (rank 0; {} elsewhere):
        ``eval/<key>_<when>`` of the workflow's ``aevaluate``."""
        if self.rank != 0:
            return {}
        with self.waiting():  # only the servers work: they get the trainer's cores too
            res = asyncio.run(self.base_workflow.aevaluate(self.inference, self.valid_rows))
        print(f"held-out greedy evaluation {'before' if when == 'start' else 'after'} training: "
              + ", ".join(f"{k} {v:.3f}" for k, v in res.items()) + f" ({len(self.valid_rows)} problems)", flush=True)
        return {f"eval/{k}_{when}": v for k, v in res.items()}


def run_rl(config, build_algorithm: BuildAlgorithm, build_workflow: BuildWorkflow,
           dataset_loader: Callable = load_dataset, actor_temperature: float | None = None,
           inference_engine: InferenceEngine | None = None) -> dict[str, float]:
    """Train ``config.total_train_steps`` asynchronous RL steps: ``train(setup_rl(...))``.

    Args: those of :func:`setup_rl`.

    Returns:
        The run summary: ``eval/<key>_start`` / ``eval/<key>_end`` (the workflow's
        ``aevaluate`` keys), ``steps``, ``trained_samples``, ``trained_samples_per_s``.

    Raises:
        ValueError (``ConfigError``): see :func:`setup_rl` — before any model is loaded.
    """
    return train(setup_rl(config, build_algorithm, build_workflow, dataset_loader, actor_temperature,
                          inference_engine))


def train(run: RLRun) -> dict[str, float]:
    """The step loop: per step (1) wait for a batch → (2) update → (3) push weights → (4) log,
    evaluate, save; then :func:`finish`. Returns the run summary (see :func:`run_rl`)."""
    config = run.config
    start_step = resume(run)
    summary = run.evaluate("start") if config.evaluator.at_start and not start_step else {}
    run.logger.last_eval = next(((k[:-6], v, 0.0) for k, v in summary.items() if k.endswith("_start")), None)
    for step in range(start_step, config.total_train_steps):
        version = step  # the weights the servers hold = completed updates
        t0, cores_before = time.time(), cores_used(run)
        # 1. Wait for a batch of finished rollouts (asynchronous: generation of the next batches
        #    goes on during training; none older than version − η). The wait lends the cores.
        with run.waiting():
            batch = run.executor.prepare_batch(run.loader, run.workflow)
        t1 = time.time()
        # 2. Update: the algorithm's advantages, proximal logprobs, minibatches, optimizer steps.
        stats = run.algorithm.update(batch)
        t2 = time.time()
        # 3. Push weights: pause → push → servers load → version bump → resume.
        if run.cores is not None:
            run.cores.release()  # generation resumes after the push: the servers get their cores back
        sync_weights(run.actor, run.inference, run.executor, run.weight_dir, version + 1)
        t3 = time.time()
        # 4. Log (reward, staleness, overlap, time split), evaluate in the background, save.
        stats.update(step_stats(run, batch, version, (t0, t1, t2, t3), cores_before))
        end_step(run, step, stats)
    return finish(run, summary)


def resume(run: RLRun) -> int:
    """Load the recover checkpoint, if any: actor (+ critic) weights, optimizer, LR schedule, RNG,
    the data position and the executor's prompts pulled but not trained on (they run again
    first); the servers get the restored weights. Returns the step to start from (0 = fresh)."""
    if not run.recover_path:
        return 0
    step = load_checkpoint(run.recover_path, run.engines, run.stateful)
    sync_weights(run.actor, run.inference, run.executor, run.weight_dir, step)  # the servers started from model_path
    return step


def cores_used(run: RLRun) -> tuple[float, float]:
    """``(shared_s, lent_s)`` of core sharing so far ((0, 0) without it)."""
    return (run.cores.shared_s, run.cores.lent_s) if run.cores is not None else (0.0, 0.0)


def step_stats(run: RLRun, batch: dict, version: int, times: tuple[float, float, float, float],
               cores_before: tuple[float, float]) -> dict[str, float]:
    """One step's logged statistics besides the algorithm's: the batch (:func:`rollout_stats`),
    the reward and workflow counters, the time split [s] between the phase boundaries ``times``
    (wait start, update start, push start, push end) and throughput. Collective."""
    t0, t1, t2, t3 = times
    base = run.base_workflow
    stats = {**rollout_stats(batch, version, run.prev_train_end, run.executor, base.stat_keys),
             **reward_stats(base), **workflow_counter_stats(base)}
    for name, a, b in (("rollout-wait", t0, t1), ("train", t1, t2), ("weight-sync", t2, t3)):
        trace.complete(name, a, b, {"step": version})
    run.trained_samples += int(stats["rollout/n_samples"])
    run.prev_train_end = t2
    shared, lent = cores_used(run)
    stats.update({
        "time/gen_wait_s": t1 - t0, "time/train_s": t2 - t1, "time/weight_sync_s": t3 - t2,
        "time/train_start": t1, "time/train_end": t2,
        **({"cpu/shared_cores_s": shared - cores_before[0], "cpu/lent_cores_s": lent - cores_before[1]}
           if run.cores is not None else {}),
        "perf/trained_tokens_per_s": stats["rollout/n_tokens"] / (t3 - t0),
        "perf/trained_samples_per_s": run.trained_samples / (t3 - run.run_start),
    })
    return stats


def end_step(run: RLRun, step: int, stats: dict[str, float]) -> None:
    """After step ``step``: save (``saver.freq_steps``), log a finished background evaluation and
    start the next (``evaluator.freq_steps``), commit the stats (the algorithm's keys get the
    ``actor/`` prefix), flush the timeline, write the recover checkpoint (``recover.*``)."""
    config = run.config
    stats = {f"actor/{k}" if "/" not in k else k: v for k, v in stats.items()}
    if config.saver.freq_steps and (step + 1) % config.saver.freq_steps == 0:
        run.actor.save(os.path.join(run.out, "checkpoints", f"step{step + 1}"))
    if run.evaluator is not None:  # a finished evaluation is logged now, with the version it evaluated
        stats.update(run.evaluator.poll())
        if (step + 1) % config.evaluator.freq_steps == 0:
            run.evaluator.start(step + 1)
    run.logger.commit(step, stats)
    if run.tracer is not None:
        run.tracer.maybe_save(run.trace_path)  # periodic flush: a crashed run leaves a readable trace
    if should_save(config.recover, step + 1):  # exact-resume state (a crash before it redoes this step)
        save_checkpoint(os.path.join(run.out, "recover"), step + 1, run.engines, run.stateful, config.recover.keep_last)


def finish(run: RLRun, summary: dict[str, float]) -> dict[str, float]:
    """End the run: cancel the episodes still running (their requests are aborted, so the final
    evaluation has the servers to itself), wait for the last background evaluation, save
    ``final/``, evaluate at the end, write the summary, the timeline and the report, release
    everything this run owns. Returns ``summary`` completed (see :func:`run_rl`)."""
    config, steps = run.config, run.config.total_train_steps
    loop_time = time.time() - run.run_start
    run.executor.destroy()
    if run.evaluator is not None:
        with run.waiting():
            summary.update({f"{k}_inloop_last": v for k, v in run.evaluator.poll(wait=600).items()})
    run.actor.save(os.path.join(run.out, "final"))
    if run.rank == 0:
        shutil.rmtree(run.weight_dir, ignore_errors=True)  # the last weight-push copy (= final/)
    if config.evaluator.at_end:
        summary.update(run.evaluate("end"))
    summary.update(steps=steps, trained_samples=run.trained_samples,
                   trained_samples_per_s=run.trained_samples / max(loop_time, 1e-9))
    run.logger.summary(steps, {k: float(v) for k, v in summary.items()})
    if run.tracer is not None:
        save_traces(run)
    run.logger.close()
    if run.rank == 0:
        try:
            print(f"run report: {write_report(run.out)}", flush=True)
        except Exception as e:  # a report problem never fails a finished run
            print(f"run report failed: {e!r}", flush=True)
    if run.owns_inference:
        run.inference.destroy()
    run.base_workflow.close()
    run.actor.destroy()
    return summary


def save_traces(run: RLRun) -> None:
    """Each rank saves its timeline; rank 0 merges them into ``trace.json``. Collective."""
    run.tracer.save(run.trace_path)
    if run.world > 1:
        dist.barrier()
        if run.rank == 0:
            trace.merge_files([run.trace_path] + [os.path.join(run.out, f"trace_rank{r}.json")
                                                  for r in range(1, run.world)], run.trace_path)
    trace.install(None)


# ----------------------------------------------------------------------------------------- setup


def setup_rl(config, build_algorithm: BuildAlgorithm, build_workflow: BuildWorkflow,
             dataset_loader: Callable = load_dataset, actor_temperature: float | None = None,
             inference_engine: InferenceEngine | None = None) -> RLRun:
    """Build the parts of an RL run: cheap checks first (config, data, model path, tokenizer,
    the workflow), then the inference engine, executor, actor, reference, algorithm, logger.

    Args:
        config: a config with the fields of :class:`~arealite.api.config.GRPOConfig` (``algo``
            may be any algorithm's config; ``algo.kl_coef > 0`` builds a frozen reference,
            passed to ``build_algorithm``, else None).
        dataset_loader: ``fn(path, split, size, seed) -> rows`` (default: math rows or the
            embedded arithmetic task).
        actor_temperature: the temperature of the actor's logprobs; None = the sampling
            temperature ``gconfig.temperature`` (policy-gradient methods: the behaviour policy's
            logprobs are tempered the same way). Online DPO passes 1 (the model's own likelihood).
        inference_engine: any :class:`~arealite.api.engine.InferenceEngine` (e.g. an in-process
            one); None = the HTTP client of the servers at ``rollout.addresses``, or of servers
            launched here when that is empty. A given engine is initialised here and left to the
            caller at the end.

    Raises:
        ValueError (``ConfigError``): a bad config field (ranges, paths, batch sizes not
            divisible by the ranks, truncated sampling for RL, ``max_new_tokens`` beyond the
            model's context, no chat template), a bad dataset or recover field — before any
            model is loaded or file written.
    """
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    random.seed(config.seed + rank)
    torch.manual_seed(config.seed)
    validate_config(config, world_size=world)  # also for configs built in Python (no load_config)
    wandb = _wandb_config(config)
    if wandb is not None and wandb.project:
        require_wandb()  # a clear ImportError before anything is loaded
    # Data, model path, tokenizer, the workflow's own checks (cheap, before anything expensive or written).
    train_rows = load_rows("train_dataset", config.train_dataset, "train", config.seed, dataset_loader)
    valid_rows = load_rows("valid_dataset", config.valid_dataset, "test", config.seed, dataset_loader)
    model_path = resolve_model_path(config.actor.path)
    recover_path = resolve_checkpoint(config.recover, os.path.join(config.output_dir, "recover"))
    tokenizer = load_tokenizer(model_path)
    check_model_fits(model_path, config.gconfig, tokenizer)  # chat template, max_new_tokens vs context
    workflow = build_workflow(config, tokenizer, os.path.join(config.output_dir, "rollouts") if rank == 0 else None)
    workflow.start()  # e.g. a reward process whose start-up overlaps model loading
    if rank == 0:
        _prepare_output_dir(config, recover_path)
    loader = EpochLoader(make_dataloader(train_rows, config.train_dataset.batch_size, rank, world,
                                         config.train_dataset.shuffle, config.seed))

    # Engines: the inference engine + the rollout executor, the FSDP2 actor, the reference, the algorithm.
    torch.set_num_threads(config.actor.num_threads or trainer_threads(config.rollout, world))
    owns_inference = inference_engine is None
    if owns_inference:
        inference_engine = make_inference_engine(config.rollout, model_path, os.path.join(config.output_dir, "logs"),
                                                  config.seed)
    else:
        inference_engine.initialize()
    executor = WorkflowExecutor(config.rollout, inference_engine, world)
    executor.initialize()
    temperature = config.gconfig.temperature if actor_temperature is None else actor_temperature
    actor = FSDPEngine(config.actor, temperature=temperature)
    actor.initialize(model_path, config.total_train_steps)
    ref = _build_reference(config, actor, model_path, temperature)
    algorithm = build_algorithm(config, actor, ref)
    run = RLRun(config, rank, world, _dynamic_sampling(config, workflow), workflow, valid_rows, loader,
                inference_engine, owns_inference, executor, actor, ref, algorithm,
                StatsLogger(config.output_dir, rank, config.total_train_steps, wandb, to_dict(config)),
                recover_path=recover_path)
    run.cores = _core_sharing(run)
    run.evaluator = _background_evaluator(run, tokenizer)
    # Timeline (trace.json, arealite/utils/trace.py): this rank's spans, its servers' requests, the gate.
    run.tracer = trace.install(trace.Tracer("trainer", f"rank {rank}") if trace.enabled_by_env() else None)
    executor.staleness.trace_process = f"rollout rank {rank}"
    return run


def _wandb_config(config):
    """``config.logger.wandb`` (None for configs without a ``logger`` section, e.g. DPO's)."""
    logger_config = getattr(config, "logger", None)
    return logger_config.wandb if logger_config is not None else None


def _prepare_output_dir(config, recover_path: str | None) -> None:
    """Rank 0: say what happens to an existing run's files and write ``config.yaml``."""
    out = config.output_dir
    recover_dir = os.path.join(out, "recover")
    if recover_path:
        print(f"resuming from {recover_path}; logs and rollouts are appended to", flush=True)
    elif list_checkpoints(recover_dir):
        print(f"WARNING: starting fresh; the recover checkpoints in {recover_dir} will be replaced "
              "(pass --recover.mode auto to resume from them instead)", flush=True)
    if os.path.exists(os.path.join(out, "stats.jsonl")) and not recover_path:
        print(f"WARNING: {out} already holds a run; its logs and rollouts will be appended to. "
              "Pass --trial_name NAME for a separate run.", flush=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.yaml"), "w") as f:
        yaml.safe_dump(to_dict(config), f)


def _dynamic_sampling(config, workflow: RolloutWorkflow) -> RolloutWorkflow:
    """DAPO dynamic sampling (``algo.dynamic_sampling``): groups with all-equal rewards are
    dropped and replaced by new ones (the run stops with an error after 8 batches' worth of such
    groups in a row). Other algorithms' configs have no such field: the workflow as it is."""
    if isinstance(config.algo, GRPOAlgoConfig) and config.algo.dynamic_sampling:
        return DynamicSampling(workflow, 8 * config.rollout.consumer_batch_size)
    return workflow


def _build_reference(config, actor: FSDPEngine, model_path: str, temperature: float):
    """The frozen reference for ``algo.kl_coef > 0`` (GRPO-family configs), else None: a LoRA
    actor's base weights (its adapters disabled), or a second frozen FSDP2 model."""
    if not (isinstance(config.algo, GRPOAlgoConfig) and config.algo.kl_coef > 0):
        return None
    if actor.peft is not None:
        return LoRAReference(actor)
    ref = FSDPEngine(config.actor, temperature=temperature, trainable=False)
    ref.initialize(model_path)
    return ref


def _core_sharing(run: RLRun) -> CoreSharing | None:
    """A CPU trainer also takes the launched servers' cores while no request runs
    (:func:`~arealite.trainer.cores.core_sharing_for`); installed on every trained model."""
    cores = core_sharing_for(run.config.rollout, run.config.actor.num_threads, run.inference, run.world,
                             run.actor.device)
    if cores is None:
        return None
    models = [run.actor.model] + [e.model for e in (run.ref, run.algorithm.critic) if isinstance(e, FSDPEngine)]
    for model in {id(m): m for m in models}.values():
        cores.install(model)
    print(f"core sharing: the trainer uses {cores.base} thread(s) while generation runs and "
          f"{cores.base + cores.extra} while the servers are idle"
          + (", and lends its cores to the servers while it waits for them" if cores.lend else "")
          + " (--rollout.share_idle_cores false: static split)", flush=True)
    return cores


def _background_evaluator(run: RLRun, tokenizer) -> BackgroundEvaluator | None:
    """In-loop evaluation every ``evaluator.freq_steps`` steps (rank 0, a background thread, never
    waited for): greedy (the workflow's ``aevaluate``) or, with ``evaluator.n_samples > 1``,
    pass@1 / pass@n / maj@n."""
    ev, engine, rows = run.config.evaluator, run.inference, run.valid_rows
    if run.rank != 0 or not ev.freq_steps:
        return None
    if ev.n_samples > 1:
        sampled = GenerationConfig(max_new_tokens=run.config.gconfig.max_new_tokens, temperature=ev.temperature)
        return BackgroundEvaluator(lambda: aevaluate_samples(engine, tokenizer, rows, ev.n_samples, sampled))
    return BackgroundEvaluator(lambda: run.base_workflow.aevaluate(engine, rows))


def main(config_cls: type, build_algorithm: BuildAlgorithm, build_workflow: BuildWorkflow,
         argv: list[str] | None = None) -> dict[str, float]:
    """A recipe's ``main``: ``run_rl(load_run_config(config_cls, argv), build_algorithm,
    build_workflow)`` (YAML via ``--config`` and command-line overrides; under a cluster
    launcher's config read, :func:`~arealite.trainer.entry.load_run_config` writes the config and
    ends the process instead)."""
    return run_rl(load_run_config(config_cls, argv), build_algorithm, build_workflow)
