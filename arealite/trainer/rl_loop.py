"""The asynchronous RL training loop that every RL recipe runs, written out top to bottom.

    from arealite.trainer.rl_loop import run_rl
    run_rl(config, build_algorithm, build_workflow)

A recipe supplies two builders (``recipes/grpo_math.py`` is the model to copy):

* ``build_algorithm(config, actor, ref) -> algorithm``: an object with ``update(batch) ->
  dict[str, float]`` (GRPO, GSPO, PPO — with its ``critic`` engine —, online DPO, …);
* ``build_workflow(config, tokenizer, dump_dir) -> RolloutWorkflow``: the rollout of one data
  row (single-turn RLVR, multi-turn feedback, tool agent, an OpenAI-style agent, …), with
  ``aevaluate(engine, rows) -> dict[str, float]`` for the held-out evaluation.

Per step: take a batch of finished rollouts (generated asynchronously, at most
``rollout.max_head_offpolicyness`` versions old) → ``algorithm.update`` → push the new weights
to the inference servers (:func:`arealite.trainer.weight_update.sync_weights`) → log. The same
loop gives every recipe recover checkpoints (``--recover.freq_steps N``, ``--recover.mode
auto``), DAPO dynamic sampling (``--algo.dynamic_sampling True``), saving (``saver.freq_steps``),
evaluation at the start and end (``evaluator.*``) and logging (``stats.jsonl``, tensorboard).

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
from typing import Any, Callable

import torch
import torch.distributed as dist
import yaml

from arealite.algorithms.grpo import DynamicSampling
from arealite.api.cli import check_model_fits, load_config, to_dict, validate_config
from arealite.api.config import GenerationConfig
from arealite.api.workflow import RolloutWorkflow
from arealite.dataset.loader import EpochLoader, load_rows, make_dataloader
from arealite.dataset.math_data import load_dataset
from arealite.train_engine.fsdp import FSDPEngine, init_distributed
from arealite.train_engine.lora import LoRAReference
from arealite.evaluate import BackgroundEvaluator, aevaluate_samples
from arealite.report import write_report
from arealite.trainer.cores import core_sharing_for
from arealite.launcher.local import make_inference_engine, trainer_threads
from arealite.trainer.weight_update import sync_weights
from arealite.rollout.executor import WorkflowExecutor
from arealite.utils.hf import load_tokenizer, resolve_model_path
from arealite.utils.recover import list_checkpoints, load_checkpoint, resolve_checkpoint, save_checkpoint, should_save
from arealite.utils import trace
from arealite.utils.stats_logger import StatsLogger, require_wandb

BuildAlgorithm = Callable[[Any, FSDPEngine, "FSDPEngine | None"], Any]
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


def reward_stats(workflow) -> dict[str, float]:
    """The reward worker's counters summed over the ranks (``reward/calls``, ``reward/timeout``,
    ``reward/crash``, ``reward/memory``, ``reward/non_finite``, ...: failures score 0); {} when
    the workflow has no :class:`~arealite.reward.worker.RewardWorker`. Collective."""
    worker = getattr(workflow, "reward_worker", None)
    snapshot = worker.stats_snapshot() if worker is not None else {}
    names = sorted(snapshot)
    return dict(zip(names, all_reduce([float(snapshot[k]) for k in names]))) if names else {}


def workflow_counter_stats(workflow) -> dict[str, float]:
    """``workflow/<name>``: the workflow's cumulative :meth:`~arealite.api.workflow.RolloutWorkflow.counters`
    summed over the ranks (e.g. ``workflow/timed_out`` of agent sessions); {} when it has none.
    Collective."""
    counters = workflow.counters() if hasattr(workflow, "counters") else {}
    names = sorted(counters)
    return {f"workflow/{k}": v for k, v in zip(names, all_reduce([float(counters[k]) for k in names]))} if names else {}


def run_rl(config, build_algorithm: BuildAlgorithm, build_workflow: BuildWorkflow,
           dataset_loader: Callable = load_dataset, actor_temperature: float | None = None) -> dict[str, float]:
    """Train ``config.total_train_steps`` asynchronous RL steps; see the module docstring.

    Args:
        config: a config with the fields of :class:`~arealite.api.config.GRPOConfig` (``algo``
            may be any algorithm's config; ``algo.kl_coef > 0`` builds a frozen reference,
            passed to ``build_algorithm``, else None).
        dataset_loader: ``fn(path, split, size, seed) -> rows`` (default: math jsonl or the
            embedded arithmetic task).
        actor_temperature: the temperature of the actor's logprobs; None = the sampling
            temperature ``gconfig.temperature`` (policy-gradient methods: the behaviour policy's
            logprobs are tempered the same way). Online DPO passes 1 (the model's own likelihood).

    Returns:
        The run summary: ``eval/<key>_start`` / ``eval/<key>_end`` (the workflow's
        ``aevaluate`` keys), ``steps``, ``trained_samples``, ``trained_samples_per_s``.

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
    if getattr(getattr(config, "logger", None), "wandb", None) is not None and config.logger.wandb.project:
        require_wandb()  # a clear ImportError before anything is loaded

    # Data, model path, tokenizer, the workflow's own checks (cheap, before anything expensive or written).
    train_rows = load_rows("train_dataset", config.train_dataset, "train", config.seed, dataset_loader)
    valid_rows = load_rows("valid_dataset", config.valid_dataset, "test", config.seed, dataset_loader)
    model_path = resolve_model_path(config.actor.path)
    out = config.output_dir
    recover_dir = os.path.join(out, "recover")
    recover_path = resolve_checkpoint(config.recover, recover_dir)  # recover.mode; None = start fresh
    tokenizer = load_tokenizer(model_path)
    check_model_fits(model_path, config.gconfig, tokenizer)  # chat template, max_new_tokens vs context
    base_workflow = build_workflow(config, tokenizer, os.path.join(out, "rollouts") if rank == 0 else None)
    if getattr(base_workflow, "reward_worker", None) is not None and hasattr(base_workflow, "reward_fn"):
        base_workflow.reward_worker.prewarm(base_workflow.reward_fn)  # its start-up overlaps model loading
    # DAPO dynamic sampling: groups with all-equal rewards are dropped and replaced by new ones
    # (the run stops with an error after 8 batches' worth of such groups in a row).
    dynamic = getattr(config.algo, "dynamic_sampling", False)
    workflow = DynamicSampling(base_workflow, 8 * config.rollout.consumer_batch_size) if dynamic else base_workflow
    if rank == 0:
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
    loader = EpochLoader(make_dataloader(train_rows, config.train_dataset.batch_size, rank, world,
                                         config.train_dataset.shuffle, config.seed))

    # Engines: inference servers (launched unless addresses are given) + the rollout executor,
    # FSDP2 actor, optional frozen reference, the algorithm.
    torch.set_num_threads(config.actor.num_threads or trainer_threads(config.rollout, world))
    rollout = make_inference_engine(config.rollout, model_path, os.path.join(out, "logs"), config.seed)
    executor = WorkflowExecutor(config.rollout, rollout, world)
    executor.initialize()
    temperature = config.gconfig.temperature if actor_temperature is None else actor_temperature
    actor = FSDPEngine(config.actor, temperature=temperature)
    actor.initialize(model_path, config.total_train_steps)
    ref = None
    if getattr(config.algo, "kl_coef", 0.0) > 0 and actor.peft is not None:
        ref = LoRAReference(actor)  # the base weights = the actor with its adapters disabled
    elif getattr(config.algo, "kl_coef", 0.0) > 0:
        ref = FSDPEngine(config.actor, temperature=temperature, trainable=False)
        ref.initialize(model_path)
    algo = build_algorithm(config, actor, ref)
    # Core sharing: a CPU trainer also takes the launched servers' cores while no request runs.
    cores = core_sharing_for(config.rollout, config.actor.num_threads, rollout, world, actor.device)
    if cores is not None:
        for engine in {id(e): e for e in (actor, ref, getattr(algo, "critic", None)) if hasattr(e, "model")}.values():
            cores.install(engine.model)
        print(f"core sharing: the trainer uses {cores.base} thread(s) while generation runs and "
              f"{cores.base + cores.extra} while the servers are idle"
              + (", and lends its cores to the servers while it waits for them" if cores.lend else "")
              + " (--rollout.share_idle_cores false: static split)", flush=True)
    waiting = cores.waiting if cores is not None else contextlib.nullcontext
    stats_logger = StatsLogger(out, rank, config.total_train_steps, getattr(getattr(config, "logger", None), "wandb", None),
                               to_dict(config))
    # Timeline (trace.json, arealite/utils/trace.py): this rank's spans, its servers' requests, the gate.
    tracer = trace.install(trace.Tracer("trainer", f"rank {rank}") if trace.enabled_by_env() else None)
    executor.staleness.trace_process = f"rollout rank {rank}"
    trace_path = os.path.join(out, "trace.json" if rank == 0 else f"trace_rank{rank}.json")
    # In-loop evaluation every evaluator.freq_steps steps: rank 0, a background thread, never waited for.
    # Greedy (the workflow's aevaluate) or, with evaluator.n_samples > 1, pass@1 / pass@n / maj@n.
    ev = config.evaluator
    bg_eval = None
    if rank == 0 and ev.freq_steps:
        sampled = GenerationConfig(max_new_tokens=config.gconfig.max_new_tokens, temperature=ev.temperature)
        bg_eval = BackgroundEvaluator(
            (lambda: aevaluate_samples(rollout, tokenizer, valid_rows, ev.n_samples, sampled)) if ev.n_samples > 1
            else (lambda: base_workflow.aevaluate(rollout, valid_rows)))
    weight_dir = os.path.join(out, "weight_update")

    def evaluate(when: str) -> dict[str, float]:  # greedy held-out episodes through the servers (rank 0)
        if rank != 0:
            return {}
        with waiting():  # only the servers work: they get the trainer's cores too
            res = asyncio.run(base_workflow.aevaluate(rollout, valid_rows))
        print(f"held-out greedy evaluation {'before' if when == 'start' else 'after'} training: "
              + ", ".join(f"{k} {v:.3f}" for k, v in res.items()) + f" ({len(valid_rows)} problems)", flush=True)
        return {f"eval/{k}_{when}": v for k, v in res.items()}

    # Resume: actor (+ critic) weights, optimizer, LR schedule, RNG, the data position, and the
    # executor's prompts pulled but not trained on (they run again first).
    engines = {"actor": actor}
    if getattr(algo, "critic", None) is not None:
        engines["critic"] = algo.critic
    stateful = {"rollout": executor, "data": loader}
    start_step = 0
    if recover_path:
        start_step = load_checkpoint(recover_path, engines, stateful)
        sync_weights(actor, rollout, executor, weight_dir, start_step)  # the servers started from model_path

    summary = evaluate("start") if config.evaluator.at_start and not start_step else {}
    stats_logger.last_eval = next(((k[:-6], v, 0.0) for k, v in summary.items() if k.endswith("_start")), None)
    prev_train_end = 0.0
    trained_samples, run_start = 0, time.time()
    for step in range(start_step, config.total_train_steps):
        version = step  # weights the servers hold = completed updates
        # 1. Rollouts: asynchronous; generation of the next batches continues during training.
        t0 = time.time()
        shared_before, lent_before = (cores.shared_s, cores.lent_s) if cores is not None else (0.0, 0.0)
        with waiting():  # a wait for generation lends the trainer's cores to the servers
            batch = executor.prepare_batch(loader, workflow)
        t1 = time.time()
        # 2. The algorithm's update (advantages, proximal logprobs, minibatches, …).
        stats = algo.update(batch)
        t2 = time.time()
        # 3. Weight sync: pause → push → servers load → version bump → resume.
        if cores is not None:
            cores.release()  # generation resumes after the sync: the servers get their cores back
        sync_weights(actor, rollout, executor, weight_dir, version + 1)
        t3 = time.time()
        for name, a, b in (("rollout-wait", t0, t1), ("train", t1, t2), ("weight-sync", t2, t3)):
            trace.complete(name, a, b, {"step": step})

        # 4. Logging: reward, staleness, overlap evidence, time split.
        stats.update(rollout_stats(batch, version, prev_train_end, executor, base_workflow.stat_keys))
        stats.update(reward_stats(base_workflow))
        stats.update(workflow_counter_stats(base_workflow))
        trained_samples += int(stats["rollout/n_samples"])
        stats.update({
            "time/gen_wait_s": t1 - t0, "time/train_s": t2 - t1, "time/weight_sync_s": t3 - t2,
            "time/train_start": t1, "time/train_end": t2,
            **({"cpu/shared_cores_s": cores.shared_s - shared_before,
                "cpu/lent_cores_s": cores.lent_s - lent_before} if cores is not None else {}),
            "perf/trained_tokens_per_s": stats["rollout/n_tokens"] / (t3 - t0),
            "perf/trained_samples_per_s": trained_samples / (t3 - run_start),
        })
        stats = {f"actor/{k}" if "/" not in k else k: v for k, v in stats.items()}
        prev_train_end = t2
        if config.saver.freq_steps and (step + 1) % config.saver.freq_steps == 0:
            actor.save(os.path.join(out, "checkpoints", f"step{step + 1}"))
        if bg_eval is not None:  # a finished evaluation is logged now, with the version it evaluated
            stats.update(bg_eval.poll())
            if (step + 1) % config.evaluator.freq_steps == 0:
                bg_eval.start(version + 1)
        stats_logger.commit(step, stats)
        if tracer is not None:
            tracer.maybe_save(trace_path)  # periodic flush: a crashed run leaves a readable trace
        if should_save(config.recover, step + 1):  # exact-resume state (a crash before it redoes this step)
            save_checkpoint(recover_dir, step + 1, engines, stateful, config.recover.keep_last)

    loop_time = time.time() - run_start
    # Episodes still running are for a step that will not come: cancel them (their requests are
    # aborted on the servers), so the final evaluation has the servers to itself.
    executor.destroy()
    if bg_eval is not None:  # the last in-loop evaluation, if one is still running
        with waiting():
            summary.update({f"{k}_inloop_last": v for k, v in bg_eval.poll(wait=600).items()})
    actor.save(os.path.join(out, "final"))
    if rank == 0:
        shutil.rmtree(weight_dir, ignore_errors=True)  # the last weight-sync copy (= final/)
    if config.evaluator.at_end:
        summary.update(evaluate("end"))
    summary.update(steps=config.total_train_steps, trained_samples=trained_samples,
                   trained_samples_per_s=trained_samples / max(loop_time, 1e-9))
    stats_logger.summary(config.total_train_steps, {k: float(v) for k, v in summary.items()})
    if tracer is not None:  # each rank's file; rank 0 merges them into trace.json
        tracer.save(trace_path)
        if world > 1:
            dist.barrier()
            if rank == 0:
                trace.merge_files([trace_path] + [os.path.join(out, f"trace_rank{r}.json") for r in range(1, world)],
                                  trace_path)
        trace.install(None)
    stats_logger.close()
    if rank == 0:
        try:
            print(f"run report: {write_report(out)}", flush=True)
        except Exception as e:  # a report problem never fails a finished run
            print(f"run report failed: {e!r}", flush=True)
    rollout.destroy()
    if getattr(base_workflow, "reward_worker", None) is not None:
        base_workflow.reward_worker.close()
    actor.destroy()
    return summary


def main(config_cls: type, build_algorithm: BuildAlgorithm, build_workflow: BuildWorkflow,
         argv: list[str] | None = None) -> dict[str, float]:
    """``run_rl(load_config(config_cls, argv), build_algorithm, build_workflow)``: a recipe's
    ``main`` (YAML via ``--config`` and command-line overrides).

    With ``$AREALITE_CONFIG_DUMP`` set (a cluster launcher reading the recipe's config,
    :func:`arealite.launcher.cluster.read_recipe_config`), the config is validated for
    ``launcher.trainer_ranks`` ranks and written there as YAML instead of training."""
    config = load_config(config_cls, argv)
    dump = os.environ.get("AREALITE_CONFIG_DUMP")
    if dump:
        validate_config(config, world_size=config.launcher.trainer_ranks)
        model_path = resolve_model_path(config.actor.path)
        check_model_fits(model_path, config.gconfig, load_tokenizer(model_path))
        with open(dump, "w") as f:
            yaml.safe_dump({**to_dict(config), "output_dir": os.path.abspath(config.output_dir),
                            "model_path": os.path.abspath(model_path)}, f)
        return {}
    return run_rl(config, build_algorithm, build_workflow)
