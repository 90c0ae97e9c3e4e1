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
