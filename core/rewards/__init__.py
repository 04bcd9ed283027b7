"""Reward backends: rule and function rewards, Hugging Face reward models, and their combination.

Modules (imported on demand, so that worker processes and ``import rlcore.rewards`` stay light):

* :mod:`rlcore.rewards.rules` — built-in named rules (exact match, GSM8K, math equivalence, penalties).
* :mod:`rlcore.rewards.functions` — loading user functions, calling them per sample or batched.
* :mod:`rlcore.rewards.pool` — worker processes with a timeout per sample.
* :mod:`rlcore.rewards.reward_model` — a sequence-classification reward model, scored at the last token.
* :mod:`rlcore.rewards.backend` — :func:`build_reward_backend`, the default reward backend.
"""
