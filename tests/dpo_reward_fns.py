"""A module-level reward for the online DPO recipe test: a tiny random model never solves a
problem, so this reward (1 for an even number of characters) gives mixed groups and pairs.
The torchrun test puts this folder on PYTHONPATH so the spawned reward worker imports it."""


def even_length(completion: str, answer: str) -> float:
    return float(len(completion) % 2 == 0)
