"""Training environments: a prompt source plus a reward (built-in tasks and file-backed datasets)."""

from verl.env.arithmetic import ArithmeticEnv, arithmetic_sft_pairs
from verl.env.base import Environment, PromptEnv
from verl.env.calculator import CalculatorEnv
from verl.env.dataset import DatasetEnv
from verl.env.multiturn import Done, MultiTurnEnv, MultiTurnEnvironment, Observation, is_multiturn
from verl.env.registry import EnvBuildContext, available_envs, build_env, register_env
from verl.env.tool_env import ToolEnv
from verl.env.tools import Tool

__all__ = [
    "ArithmeticEnv",
    "CalculatorEnv",
    "DatasetEnv",
    "Done",
    "MultiTurnEnv",
    "MultiTurnEnvironment",
    "Observation",
    "Tool",
    "ToolEnv",
    "is_multiturn",
    "EnvBuildContext",
    "Environment",
    "PromptEnv",
    "arithmetic_sft_pairs",
    "available_envs",
    "build_env",
    "register_env",
]
