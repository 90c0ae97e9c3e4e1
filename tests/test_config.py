"""Config loading: dataclass defaults < YAML (--config) < command-line flags."""

import os

import pytest

from arealite.api.cli import load_config
from arealite.api.config import GRPOConfig
from conftest import REPO_ROOT


def test_yaml_then_cli_overrides(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("total_train_steps: 7\nactor:\n  optimizer:\n    lr: 3.0e-6\n    gradient_clipping: 0.5\n")
    cfg = load_config(GRPOConfig, ["--config", str(cfg_file), "--actor.optimizer.lr", "1e-5"])
    assert cfg.total_train_steps == 7  # from YAML
    assert cfg.actor.optimizer.lr == 1e-5  # CLI wins over YAML
    assert cfg.actor.optimizer.gradient_clipping == 0.5  # YAML, nested
    assert cfg.gconfig.n_samples == GRPOConfig().gconfig.n_samples  # untouched default


def test_shipped_recipe_config_loads():
    cfg = load_config(GRPOConfig, ["--config", os.path.join(REPO_ROOT, "recipes", "configs", "grpo_math.yaml")])
    assert cfg.rollout.max_head_offpolicyness == 1 and cfg.train_dataset.path is None
    assert cfg.actor.mixed_precision == "auto" and cfg.rollout.dtype == "auto"  # bf16 where fast, fp32 elsewhere


def test_unknown_yaml_key_names_the_path(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("actor:\n  optimiser:\n    lr: 1\n")
    with pytest.raises(ValueError, match="actor.optimiser"):
        load_config(GRPOConfig, ["--config", str(cfg_file)])


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="--config"):
        load_config(GRPOConfig, ["--config", str(tmp_path / "nope.yaml")])


def test_group_baselines_refuse_a_group_of_one_and_the_overlong_window_is_checked_before_launch():
    """Config-only rules run in validate_config: GRPO/GSPO with gconfig.n_samples 1 would train
    nothing (advantage 0 everywhere); PPO (critic baseline) may; the DAPO overlong window must fit
    in max_new_tokens."""
    import pytest

    from arealite.api.cli import ConfigError, validate_config
    from arealite.api.config import GenerationConfig, GRPOConfig, GSPOConfig, PPOConfig

    for cls in (GRPOConfig, GSPOConfig):
        with pytest.raises(ConfigError, match=r"gconfig\.n_samples.*advantage 0.*--gconfig\.n_samples 2"):
            validate_config(cls(gconfig=GenerationConfig(n_samples=1)))
        validate_config(cls(gconfig=GenerationConfig(n_samples=2)))
    validate_config(PPOConfig(gconfig=GenerationConfig(n_samples=1)))
    cfg = GRPOConfig(gconfig=GenerationConfig(max_new_tokens=64))
    cfg.algo.overlong_penalty = 65
    with pytest.raises(ConfigError, match=r"algo\.overlong_penalty.*max_new_tokens=64"):
        validate_config(cfg)
    cfg.algo.overlong_penalty = 64
    validate_config(cfg)


@pytest.mark.parametrize("make,field,reason", [
    (lambda c: setattr(c.algo, "loss_agg_mode", "sum"), "algo.loss_agg_mode", "choose one of"),
    (lambda c: setattr(c.algo, "kl_estimator", "k4"), "algo.kl_estimator", "choose one of"),
    (lambda c: setattr(c.algo, "c_clip", 0.5), "algo.c_clip", "> 1"),
])
def test_algorithm_choices_are_checked_by_validate_config_before_launch(make, field, reason):
    """These were checked only when the algorithm was built (after the servers and the model)."""
    from arealite.api.cli import ConfigError, validate_config

    cfg = GRPOConfig()
    make(cfg)
    with pytest.raises(ConfigError, match=rf"^{field}: .*{reason}"):
        validate_config(cfg)


def test_group_size_rule_covers_every_group_normalised_algorithm():
    """A group of one trains nothing under GRPO-style, PPO reward_norm=group, REINFORCE++ with a
    group baseline and online DPO; PPO, plain REINFORCE++ and offline DPO need no group."""
    from arealite.api.cli import ConfigError, check_algorithm, validate_config
    from arealite.api.config import (DPOConfig, GenerationConfig, PPOAlgoConfig, PPOConfig, ReinforcePPAlgoConfig)

    one = GenerationConfig(n_samples=1)
    for cfg in (PPOConfig(gconfig=one, algo=PPOAlgoConfig(reward_norm="group")),
                GRPOConfig(gconfig=one, algo=ReinforcePPAlgoConfig(group_baseline=True)),
                DPOConfig(gconfig=one, mode="online")):
        with pytest.raises(ConfigError, match=r"^gconfig\.n_samples: 1 .*nothing trains; use --gconfig\.n_samples 2"):
            validate_config(cfg)
    validate_config(GRPOConfig(gconfig=one, algo=ReinforcePPAlgoConfig()))
    validate_config(DPOConfig(gconfig=one, mode="offline"))
    # the algorithm classes built in Python hold the same rule (one copy: cli.check_algorithm)
    from arealite.algorithms.rloo import RLOO

    with pytest.raises(ConfigError, match=r"^gconfig\.n_samples: 1 .*RLOO"):
        RLOO(GRPOConfig().algo, actor=None, group_size=1)
    check_algorithm(GRPOConfig().algo, group_size=2, max_new_tokens=8)


def test_dpo_label_smoothing_with_ipo_is_refused_before_launch():
    from arealite.api.cli import ConfigError, validate_config
    from arealite.api.config import DPOAlgoConfig, DPOConfig

    with pytest.raises(ConfigError, match=r"^algo\.label_smoothing: 0\.1: .*set it to 0 for ipo"):
        validate_config(DPOConfig(algo=DPOAlgoConfig(loss_type="ipo", label_smoothing=0.1)))
    with pytest.raises(ConfigError, match=r"^algo\.reward_norm: unknown 'x'"):
        from arealite.api.config import PPOAlgoConfig, PPOConfig

        validate_config(PPOConfig(algo=PPOAlgoConfig(reward_norm="x")))


def test_user_facing_files_name_no_shared_data_path():
    """A user's clone has no shared data folder beside it: README, docs, shipped configs and
    recipes name hub sets or the user's own files instead (the benchmarks may read it when present)."""
    files = ["README.md"] + [os.path.join(d, f) for d in ("docs", os.path.join("recipes", "configs"), "recipes")
                             for f in sorted(os.listdir(os.path.join(REPO_ROOT, d)))
                             if f.endswith((".md", ".yaml", ".py"))]
    outside = "/".join(("shared", "data"))  # the development machines' data folder, beside the clone
    bad = [f for f in files if outside in open(os.path.join(REPO_ROOT, f)).read()]
    assert bad == []


def test_choice_fields_of_a_config_built_in_python_are_checked():
    """Literal fields (mixed_precision, backend, recover.mode, ...) hold one of their values even
    when the config never went through tyro or the YAML check; the engines use the same rules."""
    from arealite.api.cli import ConfigError, check_section, validate_config
    from arealite.api.config import RecoverConfig, TrainEngineConfig

    cfg = GRPOConfig()
    cfg.actor.mixed_precision = "fp8"
    with pytest.raises(ConfigError, match=r"^actor\.mixed_precision: 'fp8' is not one of \['none', 'bf16', 'auto'\]"):
        validate_config(cfg)
    with pytest.raises(ConfigError, match=r"^recover\.mode: 'sometimes'"):
        check_section(RecoverConfig(mode="sometimes"), "recover.")
    check_section(TrainEngineConfig())


def test_every_top_level_config_is_a_run_config_with_the_recipe_defaults(tmp_path):
    """The run fields are defined once (RunConfig); each recipe keeps its experiment name, SFT its
    evaluation every 10 steps (evaluator.freq_steps, the one name of that idea), and every config
    has the logger section (config.logger.wandb without getattr)."""
    import dataclasses

    import arealite.api.config as C

    tops = {name: cls for name, cls in vars(C).items() if isinstance(cls, type) and dataclasses.is_dataclass(cls)
            and "total_train_steps" in cls.__dataclass_fields__ and cls is not C.RunConfig}
    assert set(tops) == {"GRPOConfig", "GSPOConfig", "PPOConfig", "SFTConfig", "DPOConfig", "MultiTurnGRPOConfig",
                         "ToolAgentGRPOConfig", "ProxyAgentGRPOConfig", "CodeGRPOConfig", "RMConfig", "RLHFConfig",
                         "DistillConfig", "SearchAgentConfig", "ServiceAgentConfig"}
    names = {name: cls().experiment_name for name, cls in tops.items()}
    assert names == {"GRPOConfig": "grpo_math", "GSPOConfig": "gspo_math", "PPOConfig": "ppo_math",
                     "SFTConfig": "sft_math", "DPOConfig": "dpo_math", "MultiTurnGRPOConfig": "multi_turn_math",
                     "ToolAgentGRPOConfig": "tool_agent_math", "ProxyAgentGRPOConfig": "proxy_agent",
                     "CodeGRPOConfig": "code_grpo", "RMConfig": "rm_math", "RLHFConfig": "grpo_rlhf",
                     "DistillConfig": "distill_math", "SearchAgentConfig": "search_agent",
                     "ServiceAgentConfig": "service_agent"}
    for cls in tops.values():
        c = cls()
        assert isinstance(c, C.RunConfig) and c.logger.wandb.project == ""
        assert c.output_dir == os.path.join("outputs", c.experiment_name, "trial0")
    assert C.SFTConfig().evaluator.freq_steps == 10 and C.GRPOConfig().evaluator.freq_steps == 0
    assert "eval_freq_steps" not in C.SFTConfig.__dataclass_fields__
    cfg_file = tmp_path / "sft.yaml"
    cfg_file.write_text("evaluator:\n  freq_steps: 3\nlogger:\n  wandb:\n    project: p\n")
    sft = load_config(C.SFTConfig, ["--config", str(cfg_file), "--logger.wandb.mode", "offline"])
    assert (sft.evaluator.freq_steps, sft.logger.wandb.project, sft.logger.wandb.mode) == (3, "p", "offline")
    dpo = load_config(C.DPOConfig, ["--logger.wandb.project", "q", "--evaluator.at_start", "False"])
    assert (dpo.logger.wandb.project, dpo.evaluator.at_start, dpo.experiment_name) == ("q", False, "dpo_math")
