"""The data position of a run: dataset rows → per-rank batches, epoch after epoch, resumable.

One owner of "where in the data are we": :class:`EpochLoader`. Every loop (the RL loop of
:mod:`arealite.trainer.rl_loop` through the rollout executor, and the supervised loop of
:mod:`arealite.trainer.offline_loop`) reads its batches from one, and a recover checkpoint
stores its ``state_dict()`` under the key ``"data"``.

* :func:`load_rows`: a dataset loader whose errors name the config field to fix.
* :func:`make_dataloader`: rows → a ``StatefulDataLoader`` of this rank's share of each global
  batch (``DistributedSampler``: rank ``r`` of ``W`` reads rows ``r::W`` of each shuffle order).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable

import torch
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader


def load_rows(field: str, cfg, split: str, seed: int, loader: Callable) -> list[dict]:
    """``loader(cfg.path, split, cfg.size, seed)`` whose ``FileNotFoundError`` / ``ValueError``
    name the config field, e.g. ``train_dataset.path='x.jsonl': file not found``. A set
    ``cfg.instruction`` is passed as ``instruction=`` (the math loaders' prompt instruction).

    Args:
        field: the config section, e.g. ``"train_dataset"``.
        cfg: a :class:`~arealite.api.config.DatasetConfig` (``path``, ``size``, ``instruction``).
        loader: e.g. :func:`arealite.dataset.math_data.load_dataset`.

    Raises:
        ValueError: ``cfg.instruction`` is set but ``loader`` takes no ``instruction``.
    """
    kwargs = {}
    if getattr(cfg, "instruction", None) is not None:
        if "instruction" not in inspect.signature(loader).parameters:
            raise ValueError(f"{field}.instruction is set but this recipe's dataset loader "
                             f"{getattr(loader, '__name__', loader)!r} takes no instruction; drop the flag")
        kwargs["instruction"] = cfg.instruction
    try:
        return loader(cfg.path, split, cfg.size, seed, **kwargs)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"{field}.path={cfg.path!r}: {e}") from None


def make_dataloader(rows: list, global_batch_size: int, rank: int, world: int, shuffle: bool, seed: int,
                    collate: Callable | None = None, drop_last: bool = False) -> StatefulDataLoader:
    """This rank's loader over ``rows``: batches of ``global_batch_size / world`` rows.

    Args:
        collate: batch builder; None = the list of rows itself (RL: the executor takes rows).
        drop_last: drop the last incomplete batch (and rows beyond a multiple of ``world``).

    Raises:
        ValueError: ``global_batch_size`` is not a positive multiple of ``world``.
    """
    if global_batch_size <= 0 or global_batch_size % world:
        raise ValueError(f"train_dataset.batch_size={global_batch_size}: must be a positive multiple of the "
                         f"{world} trainer ranks")
    sampler = DistributedSampler(rows, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
    return StatefulDataLoader(rows, batch_size=global_batch_size // world, sampler=sampler,
                              collate_fn=collate or _rows, drop_last=drop_last)


def _rows(rows: list) -> list:
    return rows


class EpochLoader:
    """Batches of a dataloader, epoch after epoch, with a resumable position.

    Before each pass it calls ``dataloader.sampler.set_epoch(epoch)`` (a new shuffle order per
    epoch, e.g. ``DistributedSampler(shuffle=True, seed=...)``); the global torch RNG is left
    untouched by it. ``state_dict()`` is
    ``{"epoch": e, "dataloader": <StatefulDataLoader state> | None}``; after
    ``load_state_dict`` the next batch is the one that followed the saved position — also
    right at an epoch boundary (all batches of epoch ``e`` taken: the next is the first of
    ``e + 1``).

    Args:
        dataloader: any iterable of batches; saving/loading its position needs
            ``state_dict``/``load_state_dict`` (torchdata ``StatefulDataLoader``).
    """

    def __init__(self, dataloader: Iterable):
        self.dataloader = dataloader
        self.epoch = 0  # the epoch being read (or the next one when between passes)
        self._iter = None
        self._restored: dict | None = None  # a loaded position not read from yet (next iter() resumes it)

    def next(self) -> Any:
        """The next batch. Raises ``ValueError`` if a whole pass yields nothing (empty dataset)."""
        fresh = False
        while True:
            if self._iter is None:
                sampler = getattr(self.dataloader, "sampler", None)
                if hasattr(sampler, "set_epoch"):
                    sampler.set_epoch(self.epoch)
                # Creating a DataLoader iterator draws a seed from the global torch RNG; a resume
                # creates one more than the uninterrupted run (the restored one), so draw it from
                # a forked RNG: the training's random numbers must not depend on it.
                with torch.random.fork_rng(devices=[]):
                    self._iter = iter(self.dataloader)
                fresh, self._restored = self._restored is None, None
            try:
                return next(self._iter)
            except StopIteration:
                self._iter = None
                self.epoch += 1
                if fresh:
                    raise ValueError("the dataloader yields no batches (empty dataset?)") from None

    def state_dict(self) -> dict[str, Any]:
        if not hasattr(self.dataloader, "state_dict"):
            raise TypeError(f"{type(self.dataloader).__name__} has no state_dict(); use a torchdata "
                            "StatefulDataLoader to save the data position in recover checkpoints")
        position = self.dataloader.state_dict() if self._iter is not None else self._restored
        return {"epoch": self.epoch, "dataloader": position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self._iter = int(state["epoch"]), None
        self._restored = state["dataloader"]  # inside epoch ``e`` (possibly at its very end) or None
        if self._restored is not None:
            self.dataloader.load_state_dict(self._restored)  # applied by the next iter()


