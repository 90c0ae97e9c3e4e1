"""Run by tests/test_user_engine.py (plain python: one trainer rank, no HTTP server).

A user-defined :class:`~arealite.api.engine.InferenceEngine` — in-process sampling with the HF
model, weights taken from the trainer's disk push — trains GRPO through the library loop
(``run_rl(..., inference_engine=...)``) for 3 steps; then ``recipes/grpo_custom_loop.py``'s
written-out loop runs the same config with a fresh engine. argv: model_dir out_dir. Writes
``out_dir/result.json``: the versions each engine loaded, both runs' stats, and the largest
parameter difference between the two ``final/`` checkpoints and between ``final/`` and the
initial model."""

import asyncio
import importlib.util
import json
import os
import sys
import threading

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: reward_fns (the reward worker imports it by name)

from reward_fns import length_parity_reward  # noqa: E402

from arealite.algorithms.grpo import GRPO  # noqa: E402
from arealite.api.config import DatasetConfig, EvalConfig, GenerationConfig, GRPOConfig, InferenceEngineConfig  # noqa: E402
from arealite.api.config import OptimizerConfig, TrainEngineConfig  # noqa: E402
from arealite.api.engine import InferenceEngine  # noqa: E402
from arealite.api.io_struct import ModelRequest, ModelResponse, WeightUpdateMeta  # noqa: E402
from arealite.trainer.rl_loop import run_rl, setup_rl  # noqa: E402
from arealite.workflow.rlvr import RLVRWorkflow  # noqa: E402
from arealite.utils.proc import exit_without_teardown


class HFInferenceEngine(InferenceEngine):
    """In-process generation: token-by-token sampling with the HF model (KV cache), its own
    seeded generator, one request at a time. Implements only the four abstract methods; the
    weight update is the ABC's default disk meta (the trainer saves an HF folder there)."""

    def __init__(self, model_path: str, seed: int = 0):
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.eos = self.model.config.eos_token_id
        self.generator = torch.Generator().manual_seed(seed)
        self.lock = threading.Lock()  # a weight update never lands inside a request
        self.loaded: list[int] = []
        self.paused = 0

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        g = req.gconfig
        out, logps, stop, past = [], [], "length", None
        ids = torch.tensor([req.input_ids])
        with self.lock, torch.no_grad():
            version = self.get_version()
            for _ in range(g.max_new_tokens):
                o = self.model(input_ids=ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
                past, logits = o.past_key_values, o.logits[0, -1].float()
                if g.greedy:
                    logp = torch.log_softmax(logits, -1)
                    tok = int(logp.argmax())
                else:  # the behaviour policy's logprob: log softmax(logits / T), as the trainer computes it
                    logp = torch.log_softmax(logits / g.temperature, -1)
                    tok = int(torch.multinomial(logp.exp(), 1, generator=self.generator))
                out.append(tok)
                logps.append(float(logp[tok]))
                ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
                if tok == self.eos or tok in g.stop_token_ids:
                    stop = "stop"
                    break
        await asyncio.sleep(0)
        return ModelResponse(input_tokens=list(req.input_ids), output_tokens=out, output_logprobs=logps,
                             output_versions=[version] * len(out), stop_reason=stop)

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        assert meta.type == "disk", meta
        with self.lock:
            self.model.load_state_dict(AutoModelForCausalLM.from_pretrained(meta.path).state_dict())
            self.loaded.append(meta.version)

    def pause_generation(self) -> None:
        self.paused += 1

    def continue_generation(self) -> None:
        pass


def make_config(model_dir: str, out_dir: str, trial: str) -> GRPOConfig:
    return GRPOConfig(
        trial_name=trial, fileroot=out_dir, total_train_steps=3, seed=3,
        gconfig=GenerationConfig(n_samples=4, max_new_tokens=6, temperature=1.0),
        rollout=InferenceEngineConfig(consumer_batch_size=2, max_head_offpolicyness=0),
        actor=TrainEngineConfig(path=model_dir, optimizer=OptimizerConfig(lr=1e-3)),  # large steps: a real difference
        train_dataset=DatasetConfig(path="arithmetic", batch_size=2),
        valid_dataset=DatasetConfig(path="arithmetic", size=4),
        evaluator=EvalConfig(at_start=False, at_end=True))


def build_workflow(config, tokenizer, dump_dir):
    return RLVRWorkflow(length_parity_reward, config.gconfig, tokenizer, dump_dir=dump_dir)


def stats_of(config) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(config.output_dir, "stats.jsonl"))]


def weights(folder: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "model.safetensors"))


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def main(model_dir: str, out_dir: str) -> None:
    spec = importlib.util.spec_from_file_location("grpo_custom_loop", os.path.join(
        os.path.dirname(os.path.dirname(HERE)), "recipes", "grpo_custom_loop.py"))
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)

    library_cfg, written_cfg = make_config(model_dir, out_dir, "library"), make_config(model_dir, out_dir, "written")
    library_engine = HFInferenceEngine(model_dir)
    summary = run_rl(library_cfg, GRPO.from_config, build_workflow, inference_engine=library_engine)
    written_engine = HFInferenceEngine(model_dir)
    recipe.train_written_out(setup_rl(written_cfg, GRPO.from_config, build_workflow, inference_engine=written_engine))
    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    lib, wri = weights(os.path.join(library_cfg.output_dir, "final")), weights(os.path.join(written_cfg.output_dir, "final"))
    result = {
        "loaded": [library_engine.loaded, written_engine.loaded], "paused": library_engine.paused,
        "summary": summary, "library_stats": stats_of(library_cfg), "written_stats": stats_of(written_cfg),
        "max_diff_library_vs_written": max_diff(lib, wri),
        "max_diff_final_vs_initial": max_diff(lib, {k: initial[k] for k in lib}),
        "engine_vs_final": max_diff({k: v for k, v in library_engine.model.state_dict().items() if k in lib}, lib),
    }
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_without_teardown()  # results written: skip finalisation (see its docstring)
