"""Recover checkpoints: resume a killed run exactly where its last checkpoint left it.

What one checkpoint ``<root>/step{N}/`` holds (``N`` = completed training steps):

* ``*.distcp`` + ``.metadata``: the sharded model parameters and optimizer state (AdamW
  moments and step counts) of each trainable engine (actor, critic), written with
  ``torch.distributed.checkpoint`` (DCP) from ``get_state_dict`` — each rank writes its own
  shards, nothing is gathered. A frozen reference model is not saved (rebuilt from its path);
  nor are a LoRA engine's frozen base weights (only the adapters, their optimizer state and a
  trained value head are).
* ``trainer_state_rank{r}.pt`` (one per rank): per engine its ``extra_state()`` (the LR
  scheduler state and the non-finite-step skip counters of
  :class:`~arealite.api.engine.TrainEngine`); ``N`` (= the weight version: one update per
  step); the RNG states of this rank (python ``random``, numpy, torch CPU and CUDA);
  ``state_dict()`` of every extra per-rank object passed as ``stateful`` — the data position
  (:class:`arealite.dataset.loader.EpochLoader`: epoch + ``StatefulDataLoader`` position) and
  the rollout :class:`~arealite.rollout.executor.WorkflowExecutor` (data rows pulled but not yet
  trained on, the staleness counters ``RolloutStat``).
* ``COMPLETE``: the marker, ``{"step": N, "world_size": W}``, written last.

Atomicity rule: everything is first written into ``<root>/.tmp-step{N}``; after a barrier (all
ranks' files are on disk) rank 0 writes ``COMPLETE``, fsyncs it and renames the folder to
``step{N}``. Only ``step{N}`` folders whose ``COMPLETE`` names ``N`` are ever loaded, so a run
killed at any moment of a save leaves either the previous checkpoint or the new one, never a
half-written one. Then the oldest complete checkpoints beyond ``recover.keep_last`` (and any of
a later step, which belong to an abandoned earlier run) are deleted.

``<root>`` must be visible to all ranks (one machine, or a shared file system). A checkpoint
is loaded by the same number of ranks that wrote it (the per-rank data positions are not
re-shardable); the model and optimizer shards themselves could be resharded by DCP.

Typical use (see :mod:`arealite.trainer.rl_loop` and ``tests/dist/resume_train.py``)::

    path = resolve_checkpoint(config.recover, root)          # cheap; errors before heavy work
    engine.initialize(...)
    start = load_checkpoint(path, {"actor": engine}, {"data": loader}) if path else 0
    for step in range(start, total):
        ...train...
        if should_save(config.recover, step + 1):
            save_checkpoint(root, step + 1, {"actor": engine}, {"data": loader}, config.recover.keep_last)
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from typing import Any, Protocol

import torch
import torch.distributed as dist

from arealite.api.cli import check_section
from arealite.api.config import RecoverConfig
from arealite.api.engine import TrainEngine

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"step(\d+)")


class Stateful(Protocol):
    """Anything saved per rank in a recover checkpoint (a dataloader position, the executor)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# -- RNG ------------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """RNG states of this process: python ``random``, numpy (if installed), torch CPU and CUDA."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- finding checkpoints ----------------------------------------------------------------------------
def _read_marker(path: str) -> dict | None:
    try:
        with open(os.path.join(path, MARKER)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Complete checkpoints under ``root`` as ``(step, path)``, oldest first.

    A folder counts only if it is named ``step{N}`` and holds a ``COMPLETE`` marker naming ``N``;
    temporary folders (``.tmp-step{N}``) and marker-less folders are ignored.
    """
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.fullmatch(name)
        path = os.path.join(root, name)
        if m and (marker := _read_marker(path)) is not None and marker.get("step") == int(m.group(1)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def validate_recover_config(config: RecoverConfig) -> None:
    """Raises ``ValueError`` (``ConfigError``) naming the field if ``recover.*`` is out of range
    (the rules of :func:`arealite.api.cli.validate_config`, one copy)."""
    check_section(config, "recover.")


def resolve_checkpoint(config: RecoverConfig, root: str) -> str | None:
    """The checkpoint to resume from according to ``recover.mode``; cheap, call it early.

    ``disabled`` → None (start fresh); ``auto`` → the newest complete checkpoint under ``root``,
    None if there is none; ``resume`` → the newest, which must exist. With an initialised
    process group rank 0 decides and broadcasts (all ranks load the same step).

    Raises:
        ValueError: bad ``recover`` fields, or ``recover.mode=resume`` and no complete checkpoint.
    """
    validate_recover_config(config)
    path = None
    if config.mode != "disabled":
        found = list_checkpoints(root)
        path = found[-1][1] if found else None
    if dist.is_initialized():
        obj = [path]
        dist.broadcast_object_list(obj, src=0)
        path = obj[0]
    if path is None and config.mode == "resume":
        raise ValueError(f"recover.mode=resume: no complete recover checkpoint under {root}; run with "
                         "--recover.mode auto (resume if one exists, else start fresh) or disabled")
    return path


def should_save(config: RecoverConfig, completed_steps: int) -> bool:
    """True every ``recover.freq_steps`` completed steps (never when it is 0)."""
    return config.freq_steps > 0 and completed_steps % config.freq_steps == 0


# -- saving and loading ---------------------------------------------------------------------------
def _fsync_write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _write_marker(tmp: str, step: int, world_size: int) -> None:
    _fsync_write(os.path.join(tmp, MARKER), json.dumps({"step": step, "world_size": world_size}))


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _check_engines(engines: dict[str, TrainEngine]) -> None:
    if not engines:
        raise ValueError("recover checkpoint: no engines given (pass e.g. {'actor': actor})")
    for name, engine in engines.items():
        if engine.optimizer is None:
            raise ValueError(f"recover checkpoint: engine {name!r} is frozen (trainable=False); its weights "
                             "never change, so it is rebuilt from its model path instead of saved")


def _options(engine: TrainEngine):
    """DCP state-dict options: an engine with frozen parameters (LoRA: the base weights, rebuilt
    from the model path) saves and loads only its trainable ones."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in engine.model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _engine_state(engine: TrainEngine) -> dict:
    """``{"model", "optimizer"}`` sharded state dicts of ``engine`` (DCP ``get_state_dict``);
    with frozen parameters only the trainable ones (``ignore_frozen_params`` keeps a tied alias
    such as ``lm_head.weight``, dropped here too)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    options = _options(engine)
    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer, options=options)
    if options.ignore_frozen_params:
        trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
        model_sd = {k: v for k, v in model_sd.items() if k in trainable}
    return {"model": model_sd, "optimizer": optim_sd}


def save_checkpoint(root: str, step: int, engines: dict[str, TrainEngine],
                    stateful: dict[str, Stateful] | None = None, keep_last: int = 1) -> str:
    """Write ``<root>/step{step}`` atomically (see the module docstring). Collective.

    Args:
        root: checkpoint folder shared by all ranks (created).
        step: completed training steps (the loop resumes at this index).
        engines: the trainable engines by name, e.g. ``{"actor": actor, "critic": critic}``
            (:class:`~arealite.api.engine.TrainEngine`: ``model``, ``optimizer``,
            ``extra_state()``). Frozen engines (a reference model) are not saved.
        stateful: per-rank objects with ``state_dict()``, stored under their keys.
        keep_last: complete checkpoints to keep (older ones are deleted after the rename).

    Returns:
        The final folder ``<root>/step{step}``.

    Raises:
        ValueError: no engines, or a frozen one.
        OSError: writing the new checkpoint failed (e.g. the disk is full): names the folder
            and the previous complete checkpoint, which stays loadable; the partial folder is
            removed. (With several ranks, a rank whose write failed raises here while the others
            wait at the next barrier: the launcher's failure handling ends them.)
    """
    import torch.distributed.checkpoint as dcp

    _check_engines(engines)
    rank, world = dist.get_rank(), dist.get_world_size()
    final = os.path.join(root, f"step{step}")
    tmp = os.path.join(root, f".tmp-step{step}")
    if rank == 0:
        if os.path.isdir(root):  # debris of saves killed earlier (never loaded, see list_checkpoints)
            for name in os.listdir(root):
                if name.startswith(".tmp-step"):
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    sharded = {}
    for name, engine in engines.items():
        sharded[name] = _engine_state(engine)
    try:
        dcp.save(sharded, checkpoint_id=tmp)
        trainer_state = {
            "step": step, "engines": {name: e.extra_state() for name, e in engines.items()}, "rng": rng_state(),
            "stateful": {k: v.state_dict() for k, v in (stateful or {}).items()},
        }
        with open(os.path.join(tmp, f"trainer_state_rank{rank}.pt"), "wb") as f:
            torch.save(trainer_state, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:  # disk full, I/O error (DCP wraps them in CheckpointException)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # free what was written; never loaded anyway
        prev = list_checkpoints(root)
        kept = f"the previous checkpoint {prev[-1][1]} is untouched" if prev else "no earlier checkpoint exists"
        raise OSError(f"recover checkpoint step {step}: writing {tmp} failed ({type(e).__name__}: {e}); "
                      f"{kept}; free space under {root} (or set recover.freq_steps 0)") from e
    dist.barrier()  # every rank's files are on disk
    if rank == 0:
        _write_marker(tmp, step, world)
        if os.path.exists(final):  # e.g. the same step saved by an earlier attempt
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        complete = list_checkpoints(root)
        older = [path for s, path in complete if s < step]
        later = [path for s, path in complete if s > step]  # an abandoned earlier run's timeline
        for path in older[: max(0, len(older) - (keep_last - 1))] + later:
            shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path: str, engines: dict[str, TrainEngine], stateful: dict[str, Stateful] | None = None) -> int:
    """Load a checkpoint written by :func:`save_checkpoint` into initialised ``engines`` and the
    ``stateful`` objects (the same names as when saved); restores this rank's RNG states last.
    Collective.

    Returns:
        The step stored in it (completed steps: the loop continues at this index).

    Raises:
        ValueError: the folder has no valid ``COMPLETE`` marker, or was written by another
            number of ranks.
        KeyError: an engine or ``stateful`` name is missing from the checkpoint.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    _check_engines(engines)
    marker = _read_marker(path)
    if marker is None:
        raise ValueError(f"{path}: not a complete recover checkpoint (no {MARKER} marker)")
    world = dist.get_world_size()
    if marker.get("world_size") != world:
        raise ValueError(f"{path} was written by {marker.get('world_size')} ranks; resume with the same number "
                         f"of ranks (now {world}), or start fresh with --recover.mode disabled")
    # Our own file (pickled python objects: RNG tuples, data rows), hence weights_only=False.
    trainer_state = torch.load(os.path.join(path, f"trainer_state_rank{dist.get_rank()}.pt"), weights_only=False)
    for kind, names in (("engine", engines), ("stateful", stateful or {})):
        saved = trainer_state["engines" if kind == "engine" else "stateful"]
        missing = sorted(set(names) - set(saved))
        if missing:
            raise KeyError(f"{path}: no saved state for {kind} {missing} (saved: {sorted(saved)})")
    sharded = {}
    for name, engine in engines.items():
        sharded[name] = _engine_state(engine)
    dcp.load(sharded, checkpoint_id=path)
    for name, engine in engines.items():
        set_state_dict(engine.model, engine.optimizer, model_state_dict=sharded[name]["model"],
                       optim_state_dict=sharded[name]["optimizer"], options=_options(engine))
        engine.load_extra_state(trainer_state["engines"][name])
    for key, obj in (stateful or {}).items():
        obj.load_state_dict(trainer_state["stateful"][key])
    set_rng_state(trainer_state["rng"])
    dist.barrier()
    return int(trainer_state["step"])
