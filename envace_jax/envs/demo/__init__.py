"""The demo domain: a small executable shop/bank world, its tasks, oracle and demonstrations."""

from envace_jax.envs.demo.env import DemoEnv
from envace_jax.envs.demo.oracle import (
    demonstration_messages,
    demonstrations,
    oracle_messages,
    response_tools,
)
from envace_jax.envs.demo.tasks import (
    FAMILIES,
    FAMILY_TOOLS,
    SPLITS,
    STRATA,
    generate_tasks,
    make_task,
    world_seed,
)
from envace_jax.envs.demo.tools import STATE_CHANGING, TOOL_NAMES, TOOL_SCHEMAS

__all__ = [
    "FAMILIES",
    "FAMILY_TOOLS",
    "SPLITS",
    "STATE_CHANGING",
    "STRATA",
    "TOOL_NAMES",
    "TOOL_SCHEMAS",
    "DemoEnv",
    "demonstration_messages",
    "demonstrations",
    "generate_tasks",
    "make_task",
    "oracle_messages",
    "response_tools",
    "world_seed",
]
