"""Configs from YAML files and the command line, validated before anything runs.

* :func:`load_config`: ``[--config FILE.yaml] [--a.b.c VALUE ...]`` → a config dataclass of
  :mod:`arealite.api.config` (YAML replaces the defaults, tyro applies the flags), then
  :func:`validate_config`.
* :func:`validate_config`: every field's type and range, paths, addresses and the rules between
  fields; :func:`check_model_fits`: the model-dependent checks (chat template, context length).
* Every error is a :class:`ConfigError` (a ``ValueError``) whose message starts with the dotted
  field (``gconfig.n_samples: ...``) and says what is accepted; on the command line it prints that
  one line and exits 2 (:mod:`arealite.api.usage`).
* :func:`check_algorithm` / :func:`check_multi_turn`: the same rules for an ``algo`` / ``agent``
  section alone, which the algorithm and workflow constructors call (one copy of each rule).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import os
import sys
import typing
from typing import Any, Literal, TypeVar

import yaml

from arealite.api.config import (CORRECTIONS, DPO_LOSS_TYPES, KL_ESTIMATORS, SURROGATES, LOSS_AGG_MODES, REWARD_NORMS, DatasetConfig, DPOAlgoConfig,
                                 EvalConfig, GenerationConfig, GRPOAlgoConfig, InferenceEngineConfig, LoRAConfig,
                                 CodeTaskConfig, MicroBatchSpec, MultiTurnConfig, OptimizerConfig, PPOAlgoConfig, RecoverConfig,
                                 ReinforcePPAlgoConfig, SandboxConfig, SaverConfig, SFTDatasetConfig, TrainEngineConfig)
from arealite.api.config import LauncherConfig, RunConfig
from arealite.api.from_yaml import from_dict
from arealite.api.usage import ConfigError, install_exit_hook  # noqa: F401 (imported from here)


# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------

T = TypeVar("T")


def load_config(cls: type[T], argv: list[str] | None = None) -> T:
    """Parse ``[--config FILE.yaml] [--a.b.c VALUE ...]`` into dataclass ``cls``.

    The YAML file (optional) replaces the dataclass defaults; tyro then applies the remaining
    command-line flags on top (``--actor.optimizer.lr 1e-5``). ``--help`` lists every field.

    Raises:
        FileNotFoundError: ``--config`` names a missing file.
        ConfigError (a ValueError): the YAML has an unknown key or a wrongly typed value, or
            :func:`validate_config` rejects a value (each names the dotted field and the fix).
        SystemExit: tyro rejects a flag (it prints the valid ones).

    It also installs :func:`arealite.api.usage.install_exit_hook`: a ``ConfigError`` (or the
    missing ``--config`` file) that nobody catches prints ``PROG: error: FIELD: ...`` on one
    line and exits with status 2, like an unknown flag.
    """
    import tyro

    install_exit_hook()  # uncaught, these errors print one line and exit 2 (arealite/api/usage.py)
    argv = list(sys.argv[1:] if argv is None else argv)
    default = cls()
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise ConfigError("--config", "missing value; pass a YAML file path")
        path = argv[i + 1]
        del argv[i : i + 2]
        if not os.path.exists(path):
            err = FileNotFoundError(f"--config: file not found: {path}")
            err.usage_error = True  # type: ignore[attr-defined]
            raise err
        with open(path) as f:
            default = from_dict(cls, yaml.safe_load(f) or {})
    description = f"{(cls.__doc__ or '').strip()}\n\nLoad defaults from YAML with --config FILE.yaml; flags override it."
    config = tyro.cli(cls, default=default, args=argv, description=description, config=(tyro.conf.FlagConversionOff,))
    validate_config(config)
    return config


def to_dict(config: Any) -> dict[str, Any]:
    """The config as a plain nested dict (for logging and ``config.yaml`` next to outputs)."""
    return dataclasses.asdict(config)


# ------------------------------------------------------------------------------------------------
# Validation (bad input → one clear error naming the dotted field and the fix, before any model
# is loaded or file written)
# ------------------------------------------------------------------------------------------------


def _number(obj: Any, prefix: str, name: str, *, integer: bool = False, gt: float | None = None,
            ge: float | None = None, lt: float | None = None, le: float | None = None,
            optional: bool = False, fix: str = "") -> None:
    """Check the numeric field ``obj.name`` (path ``prefix + name``) against the bounds."""
    value, path = getattr(obj, name), prefix + name
    if value is None and optional:
        return
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or (not integer and not math.isfinite(value)):
        raise ConfigError(path, f"expected {'an integer' if integer else 'a finite number'}"
                                f"{' or None' if optional else ''}, got {value!r}{'; ' + fix if fix else ''}")
    bounds = [(gt, lambda v, b: v > b, ">"), (ge, lambda v, b: v >= b, ">="),
              (lt, lambda v, b: v < b, "<"), (le, lambda v, b: v <= b, "<=")]
    for bound, test, sign in bounds:
        if bound is not None and not test(value, bound):
            rule = " and ".join(f"{s} {b}" for b, _, s in bounds if b is not None)
            raise ConfigError(path, f"must be {rule}, got {value!r}{'; ' + fix if fix else ''}")


def _check_generation(g: "GenerationConfig", p: str) -> None:
    _number(g, p, "n_samples", integer=True, ge=1, fix="completions per prompt (the GRPO group size)")
    _number(g, p, "max_new_tokens", integer=True, ge=1, fix="generated tokens per completion")
    if g.greedy:
        _number(g, p, "temperature", ge=0)
    else:
        _number(g, p, "temperature", gt=0, fix="use greedy: true for temperature 0")
    _number(g, p, "top_p", gt=0, le=1, fix="1.0 disables nucleus sampling")
    _number(g, p, "top_k", integer=True, ge=-1, fix="-1 disables top-k")
    for i, t in enumerate(g.stop_token_ids):
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ConfigError(f"{p}stop_token_ids[{i}]", f"token ids are integers >= 0, got {t!r}")


def check_untruncated_sampling(g: "GenerationConfig", prefix: str = "gconfig.") -> None:
    """Refuse truncated sampling (``top_p < 1`` or ``top_k > 0``) for RL training.

    The servers report each token's logprob under the full-vocabulary (temperature-scaled)
    distribution, and the trainer recomputes the same full distribution; the token was drawn
    from the truncated one, so the decoupled-PPO behaviour weights π_prox/π_behav and the
    policy gradient would be off by the renormalisation of the kept mass. Evaluation (greedy,
    or any sampling whose logprobs are not trained on) may still truncate.

    Raises: :class:`ConfigError` naming ``gconfig.top_p`` / ``gconfig.top_k``."""
    if g.top_p < 1.0:
        raise ConfigError(prefix + "top_p", f"top_p={g.top_p} < 1 truncates sampling, but the behaviour "
                          "logprobs (and the trainer's) are full-vocabulary ones, so the PPO importance "
                          "weights would be wrong; set top_p 1.0 for RL training (evaluation may truncate)")
    if g.top_k > 0:
        raise ConfigError(prefix + "top_k", f"top_k={g.top_k} truncates sampling, but the behaviour "
                          "logprobs (and the trainer's) are full-vocabulary ones, so the PPO importance "
                          "weights would be wrong; set top_k -1 for RL training (evaluation may truncate)")


def _check_optimizer(o: "OptimizerConfig", p: str) -> None:
    _number(o, p, "lr", gt=0, fix="e.g. 1e-5")
    _number(o, p, "weight_decay", ge=0)
    _number(o, p, "beta1", ge=0, lt=1)
    _number(o, p, "beta2", ge=0, lt=1)
    _number(o, p, "eps", gt=0)
    _number(o, p, "gradient_clipping", ge=0, fix="0 disables clipping")
    _number(o, p, "warmup_steps", integer=True, ge=0)
    _number(o, p, "min_lr_ratio", ge=0, le=1)
    _number(o, p, "max_consecutive_skips", integer=True, ge=0, fix="0 = never stop")


def _check_mb_spec(m: "MicroBatchSpec", p: str) -> None:
    _number(m, p, "max_tokens_per_mb", integer=True, ge=1)
    _number(m, p, "logits_chunk_size", integer=True, ge=1)


def _check_train_engine(t: "TrainEngineConfig", p: str) -> None:
    _number(t, p, "num_threads", integer=True, ge=0, fix="0 = the cores the servers leave")
    if t.path and not os.path.isfile(os.path.join(t.path, "config.json")):
        what = "does not exist" if not os.path.exists(t.path) else "has no config.json"
        raise ConfigError(p + "path", f"{t.path!r} {what}: pass an HF model folder (config.json, weights, "
                                      "tokenizer) or \"\" for the embedded default model")


LORA_INITS = ("true", "false", "gaussian")  # PEFT init_lora_weights values that keep the base weights W0


def _check_lora(c: "LoRAConfig", p: str) -> None:
    """``actor.lora`` / ``critic.lora``: rank ≥ 0, alpha > 0, dropout in [0, 1), target module
    names (identifier suffixes such as ``q_proj`` or ``self_attn.q_proj``, or ``all-linear``);
    whether they exist in the model is checked from its config.json before the weights load
    (:func:`arealite.train_engine.lora.check_target_modules`)."""
    _number(c, p, "rank", integer=True, ge=0, fix="0 = no LoRA (full fine-tuning), e.g. 16")
    if not c.rank:
        return
    _number(c, p, "alpha", gt=0, fix="e.g. 2 x rank")
    _number(c, p, "dropout", ge=0, lt=1)
    t = c.target_modules
    if not isinstance(t, list) or not t or not all(isinstance(m, str) for m in t):
        raise ConfigError(p + "target_modules", f"{t!r}: a non-empty list of module names, e.g. [q_proj, v_proj], "
                                                "or [all-linear]")
    for i, m in enumerate(t):
        if m == "all-linear":
            if len(t) > 1:
                raise ConfigError(p + "target_modules", "all-linear already covers every linear layer; pass it alone")
        elif not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", m):
            raise ConfigError(f"{p}target_modules[{i}]", f"{m!r} is not a module name (e.g. q_proj, mlp.down_proj)")
    if str(c.init_lora_weights).lower() not in LORA_INITS:
        raise ConfigError(p + "init_lora_weights", f"{c.init_lora_weights!r}: use one of {list(LORA_INITS)} "
                          "(inits that rewrite the base weights, e.g. pissa, are not supported: the reference "
                          "model and the servers' merge use the unchanged base weights)")


def _check_inference(r: "InferenceEngineConfig", p: str) -> None:
    for i, addr in enumerate(r.addresses):
        host, sep, port = addr.rpartition(":") if isinstance(addr, str) else ("", "", "")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ConfigError(f"{p}addresses[{i}]", f"{addr!r} is not host:port (e.g. 127.0.0.1:30000)")
    for i, arg in enumerate(r.server_args):
        if not isinstance(arg, str) or arg.lstrip().startswith("["):
            raise ConfigError(f"{p}server_args[{i}]", f"{arg!r} is not one launch flag: give the flags as separate "
                              "items (YAML [\"--dtype\", \"auto\"]; CLI --rollout.server_args=--dtype auto)")
    _number(r, p, "weight_sync_bucket_mb", gt=0)
    _number(r, p, "weight_sync_timeout", gt=0)
    _number(r, p, "tp_size", integer=True, ge=1)
    _number(r, p, "n_servers", integer=True, ge=1, fix="servers to launch when no addresses are given")
    _number(r, p, "server_threads", integer=True, ge=1)
    _number(r, p, "server_max_batch_size", integer=True, ge=1)
    _number(r, p, "consumer_batch_size", integer=True, ge=1, fix="trajectories per training step")
    _number(r, p, "max_concurrent_rollouts", integer=True, ge=0, fix="0 = consumer_batch_size")
    _number(r, p, "max_head_offpolicyness", integer=True, ge=0,
            fix="η is how many versions a trained sample may lag (0 = synchronous)")
    _number(r, p, "request_timeout", gt=0)
    _number(r, p, "request_retries", integer=True, ge=1)
    _number(r, p, "setup_timeout", gt=0)
    _number(r, p, "queue_size", integer=True, ge=0, fix="0 = 16 × max_concurrent_rollouts")


def _check_dataset(d: "DatasetConfig", p: str) -> None:
    _number(d, p, "size", integer=True, ge=1, optional=True, fix="None = all rows")
    _number(d, p, "batch_size", integer=True, ge=1)
    # generated or packaged tasks: dataset/math_data, multiplication, code_data (code, humaneval)
    if d.path not in (None, "arithmetic", "multiplication", "code", "humaneval", "search", "retail"):
        try:
            dataset_source(d.path)
        except ValueError as e:
            raise ConfigError(p + "path", f"{e}; or null/'arithmetic' for the embedded task "
                              "('multiplication' in recipes/agents/multiply_tool.py, 'code'/'humaneval' in "
                              "recipes/code_grpo.py, 'search' in recipes/search_agent.py, 'retail' in "
                              "recipes/service_agent.py)") from None
    if d.instruction is not None and (isinstance(d, SFTDatasetConfig) or not isinstance(d.instruction, str)):
        raise ConfigError(p + "instruction", f"{d.instruction!r}: pass a string appended to each math prompt "
                          "('' = the bare question), or null for the format's default; SFT/preference data take none")
    if isinstance(d, SFTDatasetConfig):
        _number(d, p, "max_length", integer=True, ge=2, fix="prompt + response tokens kept per row")


DATASET_SOURCES = ("a .jsonl file, a folder written by datasets' save_to_disk, or a Hugging Face hub name "
                   "such as openai/gsm8k or HuggingFaceH4/MATH-500 (a config after ':', e.g. openai/gsm8k:main)")
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?")


def dataset_source(path: Any) -> str:
    """What a dataset ``path`` names, without reading it: ``"jsonl"`` (an existing ``.jsonl``
    file), ``"disk"`` (an existing folder written by ``datasets``' ``save_to_disk``: it holds
    ``dataset_info.json`` or ``dataset_dict.json``) or ``"hub"`` (``owner/name[:config]`` that is
    no local path; loaded by ``datasets.load_dataset`` when the data is read).

    Raises: ValueError: none of these (the message says what is accepted)."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"{path!r}: pass {DATASET_SOURCES}")
    if path.endswith(".jsonl"):
        if not os.path.isfile(path):
            raise ValueError(f"dataset file {path!r} does not exist")
        return "jsonl"
    if os.path.isdir(path):
        if not any(os.path.isfile(os.path.join(path, f)) for f in ("dataset_info.json", "dataset_dict.json")):
            raise ValueError(f"{path!r} is a folder without dataset_info.json or dataset_dict.json (not written by "
                             f"datasets' save_to_disk); pass {DATASET_SOURCES}")
        return "disk"
    if _HUB_NAME.fullmatch(path) and not os.path.exists(path):
        return "hub"
    raise ValueError(f"{path!r} does not exist and is not a hub name; pass {DATASET_SOURCES}")


def _check_grpo_algo(a: "GRPOAlgoConfig", p: str) -> None:
    _number(a, p, "eps_clip", gt=0)
    _number(a, p, "eps_clip_high", gt=0, optional=True)
    _number(a, p, "kl_coef", ge=0, fix="0 = no reference model")
    _number(a, p, "adv_std_floor", ge=0)
    _number(a, p, "n_minibatches", integer=True, ge=1)
    _number(a, p, "behav_imp_weight_cap", gt=1, optional=True, fix="None = no cap")
    _number(a, p, "c_clip", gt=1, optional=True, fix="None = no dual clip")
    _number(a, p, "overlong_penalty", integer=True, ge=0, fix="0 = off")
    _choice(a, p, "loss_agg_mode", LOSS_AGG_MODES)
    _choice(a, p, "kl_estimator", KL_ESTIMATORS)
    _check_off_policy(a, p)
    if isinstance(a, (PPOAlgoConfig, ReinforcePPAlgoConfig)):
        _number(a, p, "gamma", ge=0, le=1)
    if isinstance(a, PPOAlgoConfig):
        _number(a, p, "lam", ge=0, le=1)
        _number(a, p, "value_eps_clip", gt=0, optional=True, fix="None = no value clipping")
        _choice(a, p, "reward_norm", REWARD_NORMS)


def _check_off_policy(a: "GRPOAlgoConfig", p: str) -> None:
    """The behaviour correction and the surrogate (docs/algorithms.md, "Off-policy corrections"):
    choices, bounds, and the pairs that would apply a correction twice or not at all."""
    _choice(a, p, "correction", CORRECTIONS)
    _choice(a, p, "loss", SURROGATES)
    _number(a, p, "correction_lower", ge=0, optional=True, fix="None = the preset's bound")
    _number(a, p, "correction_upper", gt=0, optional=True, fix="None = the preset's bound")
    _number(a, p, "sapo_tau_pos", gt=0)
    _number(a, p, "sapo_tau_neg", gt=0)
    _number(a, p, "dppo_delta", gt=0, optional=True, fix="None = 0.2 (dppo_tv) / 0.05 (dppo_kl)")
    _number(a, p, "dppo_ratio_cap", gt=0)
    if a.correction_lower is not None and a.correction_upper is not None and a.correction_lower > a.correction_upper:
        raise ConfigError(p + "correction_lower", f"{a.correction_lower} exceeds {p}correction_upper="
                          f"{a.correction_upper}; the band is [lower, upper]")
    if a.correction == "cap" and a.correction_upper is not None:
        raise ConfigError(p + "correction_upper", f"{a.correction_upper}: the cap preset's bound is "
                          f"{p}behav_imp_weight_cap; set that instead (or pick another {p}correction)")
    if not a.use_decoupled_loss and a.correction not in ("cap", "none"):
        raise ConfigError(p + "correction", f"{a.correction!r} with {p}use_decoupled_loss false: bypass mode takes "
                          f"the ratio against the behaviour policy itself (π_prox = μ, ρ = 1), so a correction of ρ "
                          f"would do nothing; set {p}use_decoupled_loss true or {p}correction none")
    if a.loss == "gmpo" and a.loss_agg_mode != "seq-mean-token-mean":
        raise ConfigError(p + "loss_agg_mode", f"{a.loss_agg_mode!r} with {p}loss gmpo: GMPO's loss is per sequence "
                          f"(arXiv 2507.20673); set {p}loss_agg_mode seq-mean-token-mean")


def _choice(obj: Any, prefix: str, name: str, accepted: tuple[str, ...]) -> None:
    if getattr(obj, name) not in accepted:
        raise ConfigError(prefix + name, f"unknown {getattr(obj, name)!r}; choose one of {list(accepted)}")


def _check_dpo_algo(a: "DPOAlgoConfig", p: str) -> None:
    _choice(a, p, "loss_type", DPO_LOSS_TYPES)
    _number(a, p, "beta", gt=0)
    _number(a, p, "label_smoothing", ge=0, lt=0.5)
    if a.label_smoothing > 0 and a.loss_type == "ipo":
        raise ConfigError(p + "label_smoothing", f"{a.label_smoothing}: label smoothing (conservative DPO) applies "
                          "to loss_type sigmoid only; set it to 0 for ipo")


def _group_rule(algo: Any) -> str | None:
    """Why ``algo`` needs >= 2 samples per prompt, or None when a group of one still trains."""
    if isinstance(algo, PPOAlgoConfig):  # a critic baseline, unless the rewards are group-normalised
        return "normalises rewards within each prompt's group (reward_norm group)" if algo.reward_norm == "group" else None
    if isinstance(algo, ReinforcePPAlgoConfig):  # a batch baseline, unless the group mean is subtracted first
        return "subtracts each prompt's group-mean reward (group_baseline)" if algo.group_baseline else None
    if isinstance(algo, GRPOAlgoConfig):  # GRPO, Dr.GRPO, GSPO, RLOO: group-relative advantages
        return "normalises rewards within each prompt's group (GRPO, Dr.GRPO, GSPO, RLOO)"
    if isinstance(algo, DPOAlgoConfig):  # online DPO: a pair from one prompt's samples
        return "forms each preference pair from one prompt's samples"
    return None


def _check_algo_vs_generation(algo: Any, group_size: int | None, max_new_tokens: int | None) -> None:
    """The rules between ``algo`` and ``gconfig``: the group size the algorithm needs (a group of
    one gives every response advantage 0, so nothing trains) and the L_max the DAPO overlong
    window and the Dr.GRPO aggregation need."""
    why = _group_rule(algo)
    if why and group_size is not None and group_size < 2:
        raise ConfigError("gconfig.n_samples", f"{group_size} sample per prompt (group_size={group_size}): "
                          f"{type(algo).__name__} {why}, so a group of 1 has advantage 0 everywhere and "
                          "nothing trains; use --gconfig.n_samples 2 or more (e.g. 8)")
    if not isinstance(algo, GRPOAlgoConfig):
        return
    if max_new_tokens is None:
        if algo.overlong_penalty > 0 or algo.loss_agg_mode == "seq-mean-token-sum-norm":
            raise ValueError("algo.loss_agg_mode=seq-mean-token-sum-norm and algo.overlong_penalty need L_max: "
                             "pass max_new_tokens=config.gconfig.max_new_tokens to the algorithm")
    elif algo.overlong_penalty > max_new_tokens:
        raise ConfigError("algo.overlong_penalty", f"window L_cache={algo.overlong_penalty} must be in "
                          f"(0, gconfig.max_new_tokens={max_new_tokens}]; lower it or raise max_new_tokens")


def check_algorithm(algo: Any, group_size: int | None = None, max_new_tokens: int | None = None) -> None:
    """The ``algo`` section on its own (every field, as :func:`validate_config` checks it) and
    against the generation settings: ``group_size`` (``gconfig.n_samples``; group-normalised
    algorithms — GRPO, Dr.GRPO, GSPO, RLOO, PPO with ``reward_norm group``, REINFORCE++ with
    ``group_baseline``, online DPO — need >= 2) and ``max_new_tokens`` (L_max: the overlong
    window must fit in it; ``seq-mean-token-sum-norm`` and ``overlong_penalty`` need it).
    :func:`validate_config` runs the same rules; the algorithm constructors call this one so
    that an algorithm built in Python is held to them too. ``None`` skips a rule.

    Raises:
        ConfigError: the first bad field (``algo.*`` or ``gconfig.n_samples``), with the fix.
        ValueError: ``max_new_tokens`` is None where the algorithm needs L_max.
    """
    _walk(algo, "algo.")
    _check_algo_vs_generation(algo, group_size, max_new_tokens)


def check_multi_turn(m: "MultiTurnConfig", max_new_tokens: int | None = None) -> None:
    """The ``agent`` section of the multi-turn workflows: ``max_turns`` >= 1, ``turn_discount``
    in (0, 1], ``max_context_tokens`` >= 2 and (with ``max_new_tokens``) above
    ``gconfig.max_new_tokens``. :func:`validate_config` runs the same rules.

    Raises: :class:`ConfigError` naming the ``agent.*`` field."""
    _walk(m, "agent.")
    _check_context(m, max_new_tokens)


def _check_context(m: "MultiTurnConfig", max_new_tokens: int | None) -> None:
    if max_new_tokens is not None and m.max_context_tokens <= max_new_tokens:
        raise ConfigError("agent.max_context_tokens", f"{m.max_context_tokens} must exceed "
                          f"gconfig.max_new_tokens={max_new_tokens} (room for a prompt)")


def _check_saver(s: "SaverConfig", p: str) -> None:
    _number(s, p, "freq_steps", integer=True, ge=0, fix="0 = only at the end")


def _check_eval(e: "EvalConfig", p: str) -> None:
    _number(e, p, "freq_steps", integer=True, ge=0, fix="0 = never")
    _number(e, p, "n_samples", integer=True, ge=1, fix="1 = greedy")
    _number(e, p, "temperature", gt=0, fix="use n_samples 1 for greedy")


def _check_recover(r: "RecoverConfig", p: str) -> None:
    _number(r, p, "freq_steps", integer=True, ge=0, fix="0 = never")
    _number(r, p, "keep_last", integer=True, ge=1)


def _check_multi_turn(m: "MultiTurnConfig", p: str) -> None:
    _number(m, p, "max_turns", integer=True, ge=1)
    _number(m, p, "turn_discount", gt=0, le=1)
    _number(m, p, "max_context_tokens", integer=True, ge=2)
    _number(m, p, "tool_timeout", gt=0, fix="seconds one tool call may run")
    _number(m, p, "max_episode_seconds", gt=0, optional=True, fix="wall-time seconds of one episode, or null")


def _check_sandbox(s: "SandboxConfig", p: str) -> None:
    _number(s, p, "timeout", gt=0, fix="wall-clock seconds per call")
    for name in ("cpu_time", "memory_mb", "max_processes", "max_file_mb", "max_output_bytes"):
        _number(s, p, name, integer=True, gt=0)
    if s.memory_mb < 64:
        raise ConfigError(p + "memory_mb", f"{s.memory_mb}: Python needs at least 64 MiB of address space")


def _check_code_task(c: "CodeTaskConfig", p: str) -> None:
    _number(c, p, "visible_tests", integer=True, ge=1, fix="tests shown to the model after a failed turn")
    _number(c, p, "max_parallel", integer=True, ge=1, fix="programs scored at once")


def _check_launcher(c: "LauncherConfig", p: str) -> None:
    for name, fix in (("n_nodes", "nodes of the job"), ("trainer_nodes", "nodes that run trainer ranks"),
                      ("trainer_ranks", "the trainer's world size"), ("trainer_cpus", "CPUs per trainer rank")):
        _number(c, p, name, integer=True, ge=1, fix=fix)
    for name in ("trainer_gpus", "server_gpus", "max_restarts"):
        _number(c, p, name, integer=True, ge=0)
    _number(c, p, "placement_timeout", gt=0)
    if c.trainer_nodes > c.n_nodes:
        raise ConfigError(p + "trainer_nodes", f"{c.trainer_nodes} > {p}n_nodes={c.n_nodes}: the trainer "
                          "ranks cannot use more nodes than the job has")
    if c.trainer_ranks % c.trainer_nodes:
        raise ConfigError(p + "trainer_ranks", f"{c.trainer_ranks} ranks do not split evenly over "
                          f"{p}trainer_nodes={c.trainer_nodes} nodes; use a multiple of {c.trainer_nodes}")
    for i, arg in enumerate(c.slurm_args):
        if not isinstance(arg, str) or not arg.startswith("-") or "\n" in arg:
            raise ConfigError(f"{p}slurm_args[{i}]", f"{arg!r} is not an sbatch option (e.g. --account=rl)")


_CHECKS: list[tuple[type, Any]] = []  # (class, fn(obj, "prefix.")); filled below


def _check_top_level(c: "RunConfig", world_size: int | None) -> None:
    _number(c, "", "seed", integer=True)
    _number(c, "", "total_train_steps", integer=True, ge=1)
    for name in ("experiment_name", "trial_name"):
        v = getattr(c, name)
        if not isinstance(v, str) or not v or "/" in v or v in (".", ".."):
            raise ConfigError(name, f"{v!r}: use a non-empty name without '/' (it is a folder name)")
    gconfig, algo, rollout = getattr(c, "gconfig", None), getattr(c, "algo", None), getattr(c, "rollout", None)
    if isinstance(gconfig, GenerationConfig) and isinstance(algo, GRPOAlgoConfig):
        check_untruncated_sampling(gconfig)  # importance weights need the sampled distribution
    if isinstance(gconfig, GenerationConfig) and algo is not None:  # offline DPO samples nothing
        online = getattr(c, "mode", "online") == "online"
        _check_algo_vs_generation(algo, gconfig.n_samples if online else None, gconfig.max_new_tokens)
    agent = getattr(c, "agent", None)
    if isinstance(agent, MultiTurnConfig) and isinstance(gconfig, GenerationConfig):
        _check_context(agent, gconfig.max_new_tokens)
    launcher, recover = c.launcher, c.recover
    if launcher.max_restarts:
        if recover.mode != "auto" or not recover.freq_steps:
            raise ConfigError("launcher.max_restarts", f"{launcher.max_restarts} restarts need --recover.mode auto "
                              f"and --recover.freq_steps N > 0 (got mode {recover.mode!r}, freq_steps "
                              f"{recover.freq_steps}): a restarted job resumes from the newest recover checkpoint")
    if world_size is not None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        check_divisible("train_dataset.batch_size", getattr(getattr(c, "train_dataset", None), "batch_size", None),
                        world_size)
        if isinstance(rollout, InferenceEngineConfig):
            check_divisible("rollout.consumer_batch_size", rollout.consumer_batch_size, world_size)


def check_divisible(path: str, value: Any, world_size: int) -> None:
    """A batch size over all ranks (field ``path``) must split evenly over ``world_size`` ranks.

    Raises: :class:`ConfigError` naming ``path`` and the sizes that work."""
    if isinstance(value, int) and value % world_size:
        raise ConfigError(path, f"{value} is not divisible by the {world_size} trainer ranks; use a "
                                f"multiple of {world_size} or launch {value} or a divisor of it ranks")


def validate_config(config: Any, world_size: int | None = None) -> None:
    """Check every field of ``config`` (any dataclass of this module, usually a recipe's
    top-level config) and the rules between them; :func:`load_config` calls it, and so should
    any code that builds a config in Python before running it.

    Per field: integer/number types, ranges (sizes >= 1, timeouts > 0, η >= 0, probabilities in
    range, ...), string choices (``algo.loss_agg_mode``, ...), ``actor.path`` / dataset paths
    that exist, ``host:port`` addresses. Across fields: RL algorithms refuse truncated sampling
    (:func:`check_untruncated_sampling`), a group size with which a group-normalised algorithm
    trains nothing and an overlong window beyond ``gconfig.max_new_tokens``
    (:func:`check_algorithm`), a multi-turn context that cannot hold one turn
    (:func:`check_multi_turn`), restarts without recover checkpoints, and — with
    ``world_size`` — batch sizes not divisible by the trainer ranks. Every rule that needs only
    the config is here (the launchers, algorithms and workflows hold no copy of one), so a bad
    value stops a run before any server is launched or model loaded. Cheap: no model, no
    network, no writes.

    Raises:
        ConfigError (a ValueError): the first bad value, naming its dotted field and the fix.
    """
    if not dataclasses.is_dataclass(config):
        raise TypeError(f"validate_config expects a config dataclass, got {type(config).__name__}")

    _walk(config, "")
    if isinstance(config, RunConfig):
        _check_top_level(config, world_size)


def check_section(obj: Any, prefix: str = "") -> None:
    """Every per-field rule of :func:`validate_config` for one config section ``obj`` (and the
    sections nested in it), fields named ``prefix + name``: what an engine or helper built from
    that section alone checks (one copy of each rule).

    Raises: :class:`ConfigError` naming the first bad field."""
    _walk(obj, prefix)


def _walk(obj: Any, prefix: str) -> None:
    """The per-section checks of ``obj`` and of every dataclass nested in it; ``Literal`` fields
    hold one of their values (a config built in Python has not been through tyro or the YAML check)."""
    for cls, fn in _CHECKS:
        if isinstance(obj, cls):
            fn(obj, prefix)
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        choices = typing.get_args(hints.get(f.name)) if typing.get_origin(hints.get(f.name)) is Literal else ()
        if choices and v not in choices:
            raise ConfigError(prefix + f.name, f"{v!r} is not one of {list(choices)}")
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            _walk(v, f"{prefix}{f.name}.")


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_model_fits(model_path: str, gconfig: "GenerationConfig", tokenizer: Any = None,
                     prompt_tokens: int = 0, need_chat_template: bool = True,
                     path_field: str = "actor.path", agent: Any = None) -> None:
    """Model-dependent checks, cheap (config.json and the tokenizer only, no weights):

    * ``tokenizer`` (if given) has a chat template when ``need_chat_template`` (the math and
      agent workflows format prompts with it);
    * ``prompt_tokens + gconfig.max_new_tokens`` fits the model's ``max_position_embeddings``;
    * so does a multi-turn episode: ``agent.max_context_tokens`` (``agent`` a MultiTurnConfig, if given).

    Raises:
        ConfigError: naming ``actor.path`` (no chat template), ``gconfig.max_new_tokens`` or
            ``agent.max_context_tokens``.
    """
    if tokenizer is not None and need_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(path_field, f"the tokenizer of {model_path!r} has no chat template; use an "
                                      "instruct/chat model, or add a chat_template to its tokenizer_config.json")
    cfg_file = os.path.join(model_path, "config.json")
    try:
        import json

        with open(cfg_file) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(path_field, f"cannot read {cfg_file}: {e}") from None
    cfg = cfg.get("text_config", cfg)
    limit = cfg.get("max_position_embeddings")
    if isinstance(limit, int) and prompt_tokens + gconfig.max_new_tokens > limit:
        raise ConfigError("gconfig.max_new_tokens", f"{gconfig.max_new_tokens} (+ {prompt_tokens} prompt tokens) "
                          f"exceeds the model's max_position_embeddings={limit}; use at most "
                          f"{max(limit - prompt_tokens, 0)}")
    context = getattr(agent, "max_context_tokens", None)
    if isinstance(limit, int) and isinstance(context, int) and context > limit:
        raise ConfigError("agent.max_context_tokens", f"{context} exceeds the model's max_position_embeddings={limit}: "
                          f"an episode that grew that long would be refused by the server; use at most {limit}")


_CHECKS += [
    (GenerationConfig, _check_generation), (OptimizerConfig, _check_optimizer), (MicroBatchSpec, _check_mb_spec),
    (TrainEngineConfig, _check_train_engine), (InferenceEngineConfig, _check_inference),
    (DatasetConfig, _check_dataset), (GRPOAlgoConfig, _check_grpo_algo), (DPOAlgoConfig, _check_dpo_algo),
    (SaverConfig, _check_saver), (EvalConfig, _check_eval), (RecoverConfig, _check_recover), (MultiTurnConfig, _check_multi_turn),
    (SandboxConfig, _check_sandbox), (LoRAConfig, _check_lora), (LauncherConfig, _check_launcher),
    (CodeTaskConfig, _check_code_task),
]
