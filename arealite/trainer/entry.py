"""The one door through which every recipe gets its config: :func:`load_run_config`.

    from arealite.trainer.entry import load_run_config
    config = load_run_config(GRPOConfig, argv)                        # an RL recipe (servers)
    config = load_run_config(SFTConfig, argv, uses_servers=False)     # an offline recipe
    config = load_run_config(DPOConfig, argv, uses_servers=lambda c: c.mode == "online")

It is :func:`arealite.api.cli.load_config` (``--config FILE.yaml`` and ``--a.b VALUE`` flags,
every field checked) plus the cluster launchers' config read: ``python -m
arealite.launcher.ray|slurm RECIPE …`` runs the recipe once with ``$AREALITE_CONFIG_DUMP`` set
(:func:`arealite.launcher.cluster.read_recipe_config`). Then this function does not return: it
validates the config for ``launcher.trainer_ranks`` ranks, checks the model (its path, tokenizer
and, with a ``gconfig``, the chat template and context length), writes the config there as YAML
and ends the process with ``SystemExit(0)`` — nothing is trained, loaded or written under
``fileroot``. A recipe that gets its config here therefore works unchanged under torchrun, Ray
and Slurm. :func:`arealite.trainer.rl_loop.main` is
``run_rl(load_run_config(config_cls, argv), build_algorithm, build_workflow)``; the offline
recipes (SFT, DPO) call it with ``uses_servers`` and then the offline loop
(:mod:`arealite.trainer.offline_loop`).
"""

from __future__ import annotations

import os
from typing import Any, Callable, TypeVar

import yaml

from arealite.api.cli import ConfigError, check_model_fits, load_config, to_dict, validate_config
from arealite.api.config import GenerationConfig, InferenceEngineConfig, LauncherConfig
from arealite.launcher.cluster import CONFIG_DUMP_ENV

T = TypeVar("T")


def load_run_config(config_cls: type[T], argv: list[str] | None = None, *,
                    uses_servers: bool | Callable[[T], bool] = True) -> T:
    """The recipe's config from ``argv`` (``--config FILE.yaml``, ``--a.b VALUE``; None =
    ``sys.argv[1:]``), checked by :func:`~arealite.api.cli.load_config`.

    With ``$AREALITE_CONFIG_DUMP`` set (a cluster launcher reading the config), it never returns:
    :func:`dump_run_config` writes the validated config to that path and the process ends with
    ``SystemExit(0)`` (exit status 0, nothing trained). Every recipe calls this, and only this,
    to get its config (``rl_loop.main`` included).

    Args:
        config_cls: the recipe's top-level config dataclass (it needs a ``launcher:
            LauncherConfig`` field and ``actor.path``; RL recipes a ``rollout`` section).
        argv: the command-line flags.
        uses_servers: whether the run uses inference servers (RL: True; SFT, offline DPO: False),
            or ``fn(config) -> bool``. The launchers start ``rollout.n_servers`` servers only when
            it is true.

    Returns:
        The config (only when ``$AREALITE_CONFIG_DUMP`` is unset or empty).

    Raises:
        ConfigError (ValueError): a bad field (see ``load_config``); in dump mode also a batch
            size not divisible by ``launcher.trainer_ranks``, a model that does not fit, or a
            config class without ``launcher`` (or without ``rollout`` while ``uses_servers``).
        FileNotFoundError: ``--config`` names a missing file.
        SystemExit: code 0 after the dump; tyro's code 2 for an unknown flag.
    """
    config = load_config(config_cls, argv)
    path = os.environ.get(CONFIG_DUMP_ENV)
    if path:
        dump_run_config(config, path, uses_servers(config) if callable(uses_servers) else bool(uses_servers))
        raise SystemExit(0)
    return config


def dump_run_config(config: Any, path: str, uses_servers: bool = True) -> dict:
    """Validate ``config`` for ``launcher.trainer_ranks`` ranks, check its model and write it to
    ``path`` as YAML: every field (:func:`~arealite.api.cli.to_dict`) plus ``output_dir`` and
    ``model_path`` (absolute; ``actor.path`` resolved, the embedded model converted once here)
    and ``uses_servers``. Returns the written dict.

    Raises:
        ConfigError: the config class has no ``launcher`` section (or no ``rollout`` section
            while ``uses_servers``), a field fails :func:`~arealite.api.cli.validate_config` for
            ``launcher.trainer_ranks`` ranks, or the model fails
            :func:`~arealite.api.cli.check_model_fits` (needs ``gconfig``; skipped without one).
        OSError: ``path`` cannot be written.
    """
    from arealite.utils.hf import load_tokenizer, resolve_model_path  # transformers: only when dumping

    name = type(config).__name__
    launcher = getattr(config, "launcher", None)
    if not isinstance(launcher, LauncherConfig):
        raise ConfigError("launcher", f"{name} has no launcher section, so the cluster launchers cannot place "
                          "it; add `launcher: LauncherConfig = field(default_factory=LauncherConfig)` to it")
    if uses_servers and not isinstance(getattr(config, "rollout", None), InferenceEngineConfig):
        raise ConfigError("rollout", f"{name} has no rollout section but the recipe says it uses inference "
                          "servers; add `rollout: InferenceEngineConfig` or pass uses_servers=False")
    validate_config(config, world_size=launcher.trainer_ranks)
    model_path = resolve_model_path(config.actor.path)
    tokenizer = load_tokenizer(model_path)
    gconfig = getattr(config, "gconfig", None)
    if isinstance(gconfig, GenerationConfig):
        check_model_fits(model_path, gconfig, tokenizer)
    data = {**to_dict(config), "output_dir": os.path.abspath(config.output_dir),
            "model_path": os.path.abspath(model_path), "uses_servers": bool(uses_servers)}
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    return data
