"""Sampling the step's sequences: prompts, asynchronous rollout ranks, multi-turn and agent episodes."""
