"""Dataclass configs for every component, loadable from YAML and overridable with tyro.

Every field has a one-line comment; units are given in brackets. A recipe's top-level config is a
dataclass composed of these (see :class:`GRPOConfig`), loaded with :func:`load_config`::

    config = load_config(GRPOConfig, sys.argv[1:])
    # python recipes/grpo_math.py --config recipes/configs/grpo_math.yaml --actor.optimizer.lr 1e-5

Precedence: dataclass defaults < YAML file given with ``--config`` < command-line flags.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import yaml


@dataclass
class GenerationConfig:
    """Sampling parameters sent to the inference server (SGLang ``sampling_params`` subset)."""

    n_samples: int = 8  # completions per prompt (GRPO group size)
    max_new_tokens: int = 24  # generated tokens per completion [tokens]
    temperature: float = 0.7  # sampling temperature; the trainer divides logits by the same value
    top_p: float = 1.0  # nucleus sampling threshold
    top_k: int = -1  # top-k sampling (-1 disables)
    greedy: bool = False  # temperature 0 (evaluation)
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop ids besides EOS
    stop: list[str] = field(default_factory=list)  # stop strings (the server needs a tokenizer)

    def sampling_params(self) -> dict[str, Any]:
        """The SGLang-style ``sampling_params`` dict for one request (``n`` is always 1)."""
        return {
            "temperature": 0.0 if self.greedy else self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "stop_token_ids": list(self.stop_token_ids),
            **({"stop": list(self.stop)} if self.stop else {}),
        }


@dataclass
class OptimizerConfig:
    """AdamW with linear warmup then a constant or cosine schedule."""

    lr: float = 1e-5  # peak learning rate
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    gradient_clipping: float = 1.0  # max global grad norm (0 disables)
    warmup_steps: int = 0  # linear warmup [optimizer steps]
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"  # decay after warmup
    min_lr_ratio: float = 0.0  # final LR of the linear/cosine decay, as a fraction of lr
    max_consecutive_skips: int = 5  # stop after this many non-finite steps in a row (0 = never)


@dataclass
class MicroBatchSpec:
    """How a batch is split into micro-batches for gradient accumulation."""

    # token budget per micro-batch [tokens]; activations of a 135M model in float32 take about
    # 2.5 MB per token without gradient checkpointing (8192 tokens OOM-ed a 24 GiB machine)
    max_tokens_per_mb: int = 2048
    packing: bool = True  # run a micro-batch as one packed row (no padding); False = padded rows
    logits_chunk_size: int = 1024  # tokens whose fp32 logits exist at once in the LM head [tokens]


@dataclass
class TrainEngineConfig:
    """The FSDP2 policy (actor) or reference model."""

    path: str = ""  # HF model folder; "" = the embedded SmolLM2-135M-Instruct default
    dtype: Literal["float32", "bfloat16"] = "float32"  # parameter dtype (float32 on CPU)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    gradient_checkpointing: bool = False  # recompute activations in backward
    num_threads: int = 0  # torch intra-op threads per trainer rank (0 = cores left by servers)
    mixed_precision: Literal["none", "bf16"] = "none"  # bf16: bf16 compute, fp32 grad reduce (GPU)
    cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy: sharded params/grads/optimizer on CPU
    attn_implementation: str = "auto"  # HF attention; auto = flash_attention_2 on GPU with bf16 if installed, else sdpa


@dataclass
class InferenceEngineConfig:
    """Rollout side: servers, client and the staleness-aware executor."""

    backend: Literal["local", "sglang", "vllm"] = "local"  # local = our transformers server
    addresses: list[str] = field(default_factory=list)  # "host:port" of running servers; [] = launch
    weight_sync: Literal["disk", "distributed"] = "disk"  # HF folder on disk, or broadcast (gloo/NCCL)
    weight_sync_bucket_mb: float = 256.0  # distributed: parameters per broadcast bucket [MiB]
    weight_sync_timeout: float = 600.0  # distributed: a hung server fails the push after this long, per bucket [s]
    tp_size: int = 1  # sglang/vllm: GPUs (tensor-parallel ranks) per server
    server_args: list[str] = field(default_factory=list)  # sglang/vllm: extra launch flags, e.g. ["--mem-fraction-static", "0.8"]
    n_servers: int = 1  # servers to launch when no addresses are given
    server_threads: int = 1  # torch threads per launched server process
    server_max_batch_size: int = 128  # concurrent sequences decoded together per server
    consumer_batch_size: int = 8  # trajectories (prompts) per training step over all ranks
    max_concurrent_rollouts: int = 0  # episodes in flight over all ranks (0 = consumer_batch_size)
    max_head_offpolicyness: int = 1  # η: a trained sample is at most η versions stale (0 = sync)
    request_timeout: float = 600.0  # one /generate HTTP call [s]
    request_retries: int = 3  # attempts per HTTP call
    setup_timeout: float = 300.0  # waiting for servers to become healthy [s]
    max_server_restarts: int = 3  # launched servers: restarts of one server that exits (0 = none) [restarts]
    queue_size: int = 0  # input/output queue bound (0 = 16 × max_concurrent_rollouts)


@dataclass
class DatasetConfig:
    """A prompt dataset: the embedded arithmetic task or a GSM8K/MATH jsonl file."""

    path: str | None = None  # None/"arithmetic" = embedded task; else a .jsonl path
    size: int | None = None  # rows to use (after a seeded shuffle); None = all/default
    batch_size: int = 8  # prompts per step over all ranks
    shuffle: bool = True


@dataclass
class GRPOAlgoConfig:
    """GRPO / PPO-clip hyper-parameters (see arealite/algorithms/grpo.py)."""

    eps_clip: float = 0.2  # PPO clip range ε (lower)
    eps_clip_high: float | None = None  # upper clip ε_high (DAPO clip-higher); None = eps_clip
    kl_coef: float = 0.0  # β of the k3 KL penalty to the reference model (0 = no reference)
    adv_norm_std: bool = True  # divide group-centred rewards by the group std (False = Dr.GRPO)
    adv_std_floor: float = 1e-4  # groups whose reward std is <= this get 0 advantage (zero-variance)
    n_minibatches: int = 1  # PPO minibatch updates per batch
    use_decoupled_loss: bool = True  # AReaL decoupled PPO: clip around a recomputed π_prox
    behav_imp_weight_cap: float | None = 5.0  # tokens with π_prox/π_behav above this are masked
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm (Dr.GRPO)
    c_clip: float | None = None  # dual-clip bound c > 1 for A < 0 (Ye et al. 2020); None = off
    kl_estimator: str = "k3"  # k1 | k2 | k3 (Schulman 2020) for the kl_coef term
    overlong_penalty: int = 0  # DAPO soft overlong punishment window L_cache [tokens]; 0 = off
    overlong_penalty_factor: float = 1.0  # scale of that penalty (added to the reward)
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, sample until the batch is full


@dataclass
class GSPOAlgoConfig(GRPOAlgoConfig):
    """GSPO (arXiv 2507.18071): sequence-level ratio; the paper's clip range and aggregation."""

    eps_clip: float = 3e-4  # lower clip of the sequence ratio s_i (paper §5.1)
    eps_clip_high: float | None = 4e-4  # upper clip of s_i (paper §5.1)
    loss_agg_mode: str = "seq-mean-token-mean"  # GSPO averages over sequences (paper Eq. 5)


@dataclass
class ReinforcePPAlgoConfig(GRPOAlgoConfig):
    """REINFORCE++ (arXiv 2501.03262); adv_norm_std is unused (whitening is global)."""

    group_baseline: bool = False  # subtract the group-mean reward first (REINFORCE++-baseline)
    gamma: float = 1.0  # discount of token rewards
    kl_in_reward: bool = True  # kl_coef·KL(π_behav‖π_ref) as a per-token reward penalty (else a loss term)
    kl_estimator: str = "k1"  # estimator of that KL (the paper's reward penalty is k1)


@dataclass
class PPOAlgoConfig(GRPOAlgoConfig):
    """PPO with a critic (see arealite/algorithms/ppo.py); GRPO keys apply to the actor loss."""

    gamma: float = 1.0  # discount γ of GAE
    lam: float = 1.0  # GAE λ (1 = Monte-Carlo return minus the value baseline)
    value_eps_clip: float | None = 0.2  # value clipping range ε_v around V_old (None = no clip)
    adv_whiten: bool = True  # whiten GAE advantages over the global batch
    reward_norm: str = "none"  # none | group (GRPO-style) | batch (whiten sequence rewards)
    kl_in_reward: bool = True  # kl_coef·KL(π_behav‖π_ref) as a per-token reward penalty (else a loss term)
    kl_estimator: str = "k1"  # estimator of that KL (the usual RLHF reward penalty is k1)


@dataclass
class SaverConfig:
    """HF checkpoints of the policy under ``output_dir/checkpoints/stepN`` (plus ``final/``)."""

    freq_steps: int = 0  # save an HF checkpoint every N steps (0 = only at the end)


@dataclass
class RecoverConfig:
    """Recover checkpoints under ``output_dir/recover/stepN`` for exact resume after a crash
    (model + optimizer shards, LR schedule, data position, RNG, version, staleness counters;
    see arealite/utils/recover.py). Written every ``freq_steps`` whatever the mode."""

    mode: Literal["disabled", "auto", "resume"] = "disabled"  # disabled: fresh | auto: newest complete one, if any | resume: must exist
    freq_steps: int = 0  # write a recover checkpoint every N steps (0 = never) [steps]
    keep_last: int = 1  # complete recover checkpoints kept on disk (older ones deleted)


@dataclass
class EvalConfig:
    """Greedy held-out accuracy on ``valid_dataset`` through the inference servers."""

    at_start: bool = True  # evaluate the initial weights before training
    at_end: bool = True  # evaluate the final weights after training


@dataclass
class GRPOConfig:
    """Top-level config of the GRPO math recipe."""

    experiment_name: str = "grpo_math"
    trial_name: str = "trial0"
    fileroot: str = "outputs"  # logs, rollouts, checkpoints go to fileroot/experiment/trial
    seed: int = 1
    total_train_steps: int = 20  # optimizer updates of the policy [steps]
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    rollout: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
    actor: TrainEngineConfig = field(default_factory=TrainEngineConfig)
    algo: GRPOAlgoConfig = field(default_factory=GRPOAlgoConfig)
    train_dataset: DatasetConfig = field(default_factory=DatasetConfig)
    valid_dataset: DatasetConfig = field(default_factory=lambda: DatasetConfig(size=64))
    saver: SaverConfig = field(default_factory=SaverConfig)
    evaluator: EvalConfig = field(default_factory=EvalConfig)
    recover: RecoverConfig = field(default_factory=RecoverConfig)

    @property
    def output_dir(self) -> str:
        return os.path.join(self.fileroot, self.experiment_name, self.trial_name)


@dataclass
class GSPOConfig(GRPOConfig):
    """Top-level config of the GSPO math recipe (GRPO's loop, GSPO's sequence-level ratio)."""

    experiment_name: str = "gspo_math"
    algo: GSPOAlgoConfig = field(default_factory=GSPOAlgoConfig)


@dataclass
class PPOConfig(GRPOConfig):
    """Top-level config of the PPO math recipe: GRPO's loop plus a critic engine."""

    experiment_name: str = "ppo_math"
    algo: PPOAlgoConfig = field(default_factory=PPOAlgoConfig)
    # the critic: the actor's backbone with a value head; its own optimizer
    critic: TrainEngineConfig = field(default_factory=lambda: TrainEngineConfig(
        optimizer=OptimizerConfig(lr=2e-5)))


@dataclass
class SFTDatasetConfig(DatasetConfig):
    """A tokenized text dataset: SFT rows (``messages`` or ``question``/``answer``) or preference
    pairs (``prompt`` or ``messages``, ``chosen``, ``rejected``); None = the embedded arithmetic task."""

    max_length: int = 256  # prompt + response tokens kept per row; longer rows lose their tail [tokens]


@dataclass
class SFTConfig:
    """Top-level config of the SFT recipe (recipes/sft_math.py)."""

    experiment_name: str = "sft_math"
    trial_name: str = "trial0"
    fileroot: str = "outputs"  # logs and checkpoints go to fileroot/experiment/trial
    seed: int = 1
    total_train_steps: int = 20  # optimizer updates [steps]
    eval_freq_steps: int = 10  # held-out loss every N steps (0 = only at start and end)
    actor: TrainEngineConfig = field(default_factory=TrainEngineConfig)
    train_dataset: SFTDatasetConfig = field(default_factory=SFTDatasetConfig)
    valid_dataset: SFTDatasetConfig = field(default_factory=lambda: SFTDatasetConfig(size=64, batch_size=16))
    saver: SaverConfig = field(default_factory=SaverConfig)
    recover: RecoverConfig = field(default_factory=RecoverConfig)

    @property
    def output_dir(self) -> str:
        return os.path.join(self.fileroot, self.experiment_name, self.trial_name)


@dataclass
class DPOAlgoConfig:
    """DPO / conservative DPO / IPO hyper-parameters (see arealite/algorithms/dpo.py)."""

    beta: float = 0.1  # β: scale of the implicit reward β·log(π/π_ref) (inverse KL strength)
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"  # sigmoid = DPO (Rafailov 2023); ipo = Azar 2023 Eq. 17
    label_smoothing: float = 0.0  # ε of conservative DPO: assumed label-flip rate in [0, 0.5) (sigmoid only)


@dataclass
class DPOConfig:
    """Top-level config of the DPO recipe (recipes/dpo_math.py), offline or online."""

    experiment_name: str = "dpo_math"
    trial_name: str = "trial0"
    fileroot: str = "outputs"  # logs, rollouts, checkpoints go to fileroot/experiment/trial
    seed: int = 1
    total_train_steps: int = 20  # optimizer updates of the policy [steps]
    # offline: pairs from train_dataset (a preference jsonl; None = embedded arithmetic pairs);
    # online: the rollout pipeline samples gconfig.n_samples answers per prompt, the math reward
    # picks a correct/incorrect pair (consumer_batch_size pairs per step, staleness-bounded)
    mode: Literal["offline", "online"] = "online"
    reward_fn: str = "arealite.reward.math:math_reward"  # online: "module:function" (completion, answer) -> float
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)  # online sampling + evaluation
    rollout: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)  # online only
    actor: TrainEngineConfig = field(default_factory=TrainEngineConfig)  # the reference model is a frozen copy
    algo: DPOAlgoConfig = field(default_factory=DPOAlgoConfig)
    train_dataset: SFTDatasetConfig = field(default_factory=SFTDatasetConfig)  # pairs (offline) or prompts (online)
    valid_dataset: DatasetConfig = field(default_factory=lambda: DatasetConfig(size=64))  # greedy accuracy
    saver: SaverConfig = field(default_factory=SaverConfig)
    evaluator: EvalConfig = field(default_factory=EvalConfig)
    recover: RecoverConfig = field(default_factory=RecoverConfig)

    @property
    def output_dir(self) -> str:
        return os.path.join(self.fileroot, self.experiment_name, self.trial_name)


@dataclass
class SandboxConfig:
    """Limits of one sandboxed Python run (arealite/sandbox.py explains the isolation modes)."""

    timeout: float = 5.0  # wall-clock limit of one call [s]
    cpu_time: int = 5  # RLIMIT_CPU of the process [CPU s]
    memory_mb: int = 512  # RLIMIT_AS (address space) per process [MiB]
    max_processes: int = 16  # RLIMIT_NPROC: processes/threads of the sandbox uid
    max_file_mb: int = 16  # RLIMIT_FSIZE: largest file the code may write [MiB]
    max_output_bytes: int = 4096  # stdout+stderr returned to the model; more kills the program [bytes]
    mode: Literal["auto", "namespace", "rlimit"] = "auto"  # auto = namespace when root + unshare work
    uid_base: int = 200000  # namespace mode: calls run as uid_base + (pid·64 + call) mod 50000

    def validate(self) -> None:
        """Raises ValueError naming the bad ``sandbox.*`` field (before any process is started)."""
        for name in ("timeout", "cpu_time", "memory_mb", "max_processes", "max_file_mb", "max_output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox.{name} must be > 0, got {getattr(self, name)!r}")
        if self.memory_mb < 64:
            raise ValueError(f"sandbox.memory_mb={self.memory_mb}: Python needs at least 64 MiB of address space")
        if self.mode not in ("auto", "namespace", "rlimit"):
            raise ValueError(f"sandbox.mode must be auto|namespace|rlimit, got {self.mode!r}")


@dataclass
class MultiTurnConfig:
    """Episode shape of the multi-turn workflows (arealite/workflow/multi_turn.py)."""

    max_turns: int = 2  # model turns per episode (answers, or code runs plus the answer)
    turn_discount: float = 0.9  # reward × turn_discount^(turns − 1): each extra turn costs this factor
    max_context_tokens: int = 1024  # stop before a turn whose prompt + max_new_tokens exceeds this [tokens]


@dataclass
class MultiTurnGRPOConfig(GRPOConfig):
    """Top-level config of recipes/multi_turn_math.py: GRPO over multi-turn feedback episodes."""

    experiment_name: str = "multi_turn_math"
    agent: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class ToolAgentGRPOConfig(GRPOConfig):
    """Top-level config of recipes/tool_agent_math.py: GRPO over episodes with a Python tool."""

    experiment_name: str = "tool_agent_math"
    agent: MultiTurnConfig = field(default_factory=lambda: MultiTurnConfig(max_turns=3, turn_discount=1.0))
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    tool_role: str = "user"  # chat role of tool output ("tool" for templates that have one)


# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------

T = TypeVar("T")


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass ``cls`` from a nested dict (e.g. parsed YAML), recursing into fields.

    Raises:
        ConfigError (a ValueError): an unknown key (names the dotted path and lists the valid
            keys), a value of the wrong type (names the path, the expected type and the value),
            or a section that is not a mapping.
    """
    if not isinstance(data, dict):
        raise ConfigError(where or "config", f"expected a mapping of keys (a YAML section), got "
                          f"{type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            raise ConfigError(path, f"unknown config key; valid keys here: {sorted(names)}")
        sub = _dataclass_of(hints[key])
        if sub is not None and value is not None:
            kwargs[key] = from_dict(sub, value, path)
        else:
            kwargs[key] = check_type(path, hints[key], value)
    return cls(**kwargs)


def _dataclass_of(tp: Any) -> type | None:
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if dataclasses.is_dataclass(arg):
                return arg
    return None


def load_config(cls: type[T], argv: list[str] | None = None) -> T:
    """Parse ``[--config FILE.yaml] [--a.b.c VALUE ...]`` into dataclass ``cls``.

    The YAML file (optional) replaces the dataclass defaults; tyro then applies the remaining
    command-line flags on top (``--actor.optimizer.lr 1e-5``). ``--help`` lists every field.

    Raises:
        FileNotFoundError: ``--config`` names a missing file.
        ConfigError (a ValueError): the YAML has an unknown key or a wrongly typed value, or
            :func:`validate_config` rejects a value (each names the dotted field and the fix).
        SystemExit: tyro rejects a flag (it prints the valid ones).
    """
    import tyro

    argv = list(sys.argv[1:] if argv is None else argv)
    default = cls()
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise ValueError("--config: missing value; pass a YAML file path")
        path = argv[i + 1]
        del argv[i : i + 2]
        if not os.path.exists(path):
            raise FileNotFoundError(f"--config: file not found: {path}")
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


class ConfigError(ValueError):
    """A bad config value. ``field`` is its dotted path (``gconfig.n_samples``); the message
    starts with it and says what is accepted."""

    def __init__(self, field_path: str, message: str):
        self.field = field_path
        super().__init__(f"{field_path}: {message}")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def check_type(path: str, tp: Any, value: Any) -> Any:
    """``value`` checked against the annotation ``tp`` of field ``path`` (YAML values): bool,
    int (not bool), float (an int is widened; a numeric string such as YAML's ``1e-5`` is
    converted), str, ``Literal[...]``, ``list[X]`` and ``X | None``. Other annotations pass.

    Returns: the value (converted for float fields). Raises: :class:`ConfigError`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return check_type(path, arg, value)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(path, f"expected {' or '.join(_type_name(a) for a in args)}, got "
                                f"{type(value).__name__} {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(path, f"{value!r} is not one of {list(args)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(path, f"expected a list, got {type(value).__name__} {value!r} (YAML: [a, b])")
        return [check_type(f"{path}[{i}]", args[0], v) for i, v in enumerate(value)] if args else value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(path, f"expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads 1e-5 (no dot) as a string
            except ValueError:
                pass
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(path, f"expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {type(value).__name__} {value!r} (quote it in YAML)")
        return value
    return value


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


def _check_inference(r: "InferenceEngineConfig", p: str) -> None:
    for i, addr in enumerate(r.addresses):
        host, sep, port = addr.rpartition(":") if isinstance(addr, str) else ("", "", "")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ConfigError(f"{p}addresses[{i}]", f"{addr!r} is not host:port (e.g. 127.0.0.1:30000)")
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
    if d.path not in (None, "arithmetic"):
        if not isinstance(d.path, str) or not d.path.endswith(".jsonl"):
            raise ConfigError(p + "path", f"{d.path!r}: pass a .jsonl file, or null/'arithmetic' for the embedded task")
        if not os.path.isfile(d.path):
            raise ConfigError(p + "path", f"dataset file {d.path!r} does not exist")
    if isinstance(d, SFTDatasetConfig):
        _number(d, p, "max_length", integer=True, ge=2, fix="prompt + response tokens kept per row")


def _check_grpo_algo(a: "GRPOAlgoConfig", p: str) -> None:
    _number(a, p, "eps_clip", gt=0)
    _number(a, p, "eps_clip_high", gt=0, optional=True)
    _number(a, p, "kl_coef", ge=0, fix="0 = no reference model")
    _number(a, p, "adv_std_floor", ge=0)
    _number(a, p, "n_minibatches", integer=True, ge=1)
    _number(a, p, "behav_imp_weight_cap", gt=1, optional=True, fix="None = no cap")
    _number(a, p, "c_clip", gt=1, optional=True, fix="None = no dual clip")
    _number(a, p, "overlong_penalty", integer=True, ge=0, fix="0 = off")
    if isinstance(a, (PPOAlgoConfig, ReinforcePPAlgoConfig)):
        _number(a, p, "gamma", ge=0, le=1)
    if isinstance(a, PPOAlgoConfig):
        _number(a, p, "lam", ge=0, le=1)
        _number(a, p, "value_eps_clip", gt=0, optional=True)


def _check_dpo_algo(a: "DPOAlgoConfig", p: str) -> None:
    _number(a, p, "beta", gt=0)
    _number(a, p, "label_smoothing", ge=0, lt=0.5)


def _check_saver(s: "SaverConfig", p: str) -> None:
    _number(s, p, "freq_steps", integer=True, ge=0, fix="0 = only at the end")


def _check_recover(r: "RecoverConfig", p: str) -> None:
    _number(r, p, "freq_steps", integer=True, ge=0, fix="0 = never")
    _number(r, p, "keep_last", integer=True, ge=1)


def _check_multi_turn(m: "MultiTurnConfig", p: str) -> None:
    _number(m, p, "max_turns", integer=True, ge=1)
    _number(m, p, "turn_discount", gt=0, le=1)
    _number(m, p, "max_context_tokens", integer=True, ge=2)


def _check_sandbox(s: "SandboxConfig", p: str) -> None:
    try:
        s.validate()
    except ValueError as e:  # its messages say "sandbox.<field>"
        msg = str(e)
        name = msg.split(" ", 1)[0].split("=", 1)[0].removeprefix("sandbox.") if msg.startswith("sandbox.") else ""
        raise ConfigError(p + name if name else p.rstrip("."), msg) from None


_CHECKS: list[tuple[type, Any]] = []  # (class, fn(obj, "prefix.")); filled below


def _check_top_level(c: Any, world_size: int | None) -> None:
    _number(c, "", "seed", integer=True)
    _number(c, "", "total_train_steps", integer=True, ge=1)
    for name in ("experiment_name", "trial_name"):
        v = getattr(c, name, None)
        if v is not None and (not isinstance(v, str) or not v or "/" in v or v in (".", "..")):
            raise ConfigError(name, f"{v!r}: use a non-empty name without '/' (it is a folder name)")
    if isinstance(getattr(c, "eval_freq_steps", None), int):
        _number(c, "", "eval_freq_steps", integer=True, ge=0)
    gconfig, algo, rollout = getattr(c, "gconfig", None), getattr(c, "algo", None), getattr(c, "rollout", None)
    if isinstance(gconfig, GenerationConfig) and isinstance(algo, GRPOAlgoConfig):
        check_untruncated_sampling(gconfig)  # importance weights need the sampled distribution
    agent = getattr(c, "agent", None)
    if isinstance(agent, MultiTurnConfig) and isinstance(gconfig, GenerationConfig):
        if agent.max_context_tokens <= gconfig.max_new_tokens:
            raise ConfigError("agent.max_context_tokens", f"{agent.max_context_tokens} must exceed "
                              f"gconfig.max_new_tokens={gconfig.max_new_tokens} (room for a prompt)")
    if world_size is not None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        checks = [("train_dataset.batch_size", getattr(getattr(c, "train_dataset", None), "batch_size", None))]
        if isinstance(rollout, InferenceEngineConfig):
            checks.append(("rollout.consumer_batch_size", rollout.consumer_batch_size))
        for path, value in checks:
            if isinstance(value, int) and value % world_size:
                raise ConfigError(path, f"{value} is not divisible by the {world_size} trainer ranks; use a "
                                        f"multiple of {world_size} or launch {value} or a divisor of it ranks")


def validate_config(config: Any, world_size: int | None = None) -> None:
    """Check every field of ``config`` (any dataclass of this module, usually a recipe's
    top-level config) and the rules between them; :func:`load_config` calls it, and so should
    any code that builds a config in Python before running it.

    Per field: integer/number types, ranges (sizes >= 1, timeouts > 0, η >= 0, probabilities in
    range, ...), ``actor.path`` / dataset paths that exist, ``host:port`` addresses. Across
    fields: RL algorithms refuse truncated sampling (:func:`check_untruncated_sampling`), a
    multi-turn context that cannot hold one turn, and — with ``world_size`` — batch sizes not
    divisible by the trainer ranks. Cheap: no model, no network, no writes.

    Raises:
        ConfigError (a ValueError): the first bad value, naming its dotted field and the fix.
    """
    if not dataclasses.is_dataclass(config):
        raise TypeError(f"validate_config expects a config dataclass, got {type(config).__name__}")

    def walk(obj: Any, prefix: str) -> None:
        for cls, fn in _CHECKS:
            if isinstance(obj, cls):
                fn(obj, prefix)
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v) and not isinstance(v, type):
                walk(v, f"{prefix}{f.name}.")

    walk(config, "")
    if hasattr(config, "total_train_steps"):
        _check_top_level(config, world_size)


def check_model_fits(model_path: str, gconfig: "GenerationConfig", tokenizer: Any = None,
                     prompt_tokens: int = 0, need_chat_template: bool = True,
                     path_field: str = "actor.path") -> None:
    """Model-dependent checks, cheap (config.json and the tokenizer only, no weights):

    * ``tokenizer`` (if given) has a chat template when ``need_chat_template`` (the math and
      agent workflows format prompts with it);
    * ``prompt_tokens + gconfig.max_new_tokens`` fits the model's ``max_position_embeddings``.

    Raises:
        ConfigError: naming ``actor.path`` (no chat template) or ``gconfig.max_new_tokens``.
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


_CHECKS += [
    (GenerationConfig, _check_generation), (OptimizerConfig, _check_optimizer), (MicroBatchSpec, _check_mb_spec),
    (TrainEngineConfig, _check_train_engine), (InferenceEngineConfig, _check_inference),
    (DatasetConfig, _check_dataset), (GRPOAlgoConfig, _check_grpo_algo), (DPOAlgoConfig, _check_dpo_algo),
    (SaverConfig, _check_saver), (RecoverConfig, _check_recover), (MultiTurnConfig, _check_multi_turn),
    (SandboxConfig, _check_sandbox),
]
