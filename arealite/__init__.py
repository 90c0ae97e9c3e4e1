"""arealite: lightweight, algorithm-first, fully asynchronous RL for large language models.

Layers (imports only point downward): ``api`` (contracts) → ``rollout`` (asynchronous executor)
→ ``engine`` (FSDP2 trainer, HTTP client, generation server) → ``algorithms`` / ``workflow`` /
``reward`` / ``dataset`` → ``recipes/`` (explicit training loops).
"""

__version__ = "0.1.0"
