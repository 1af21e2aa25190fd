"""Environments: the Environment protocol and executable tool-use domains."""

from envace_jax.envs.base import (
    BAD_ARGS,
    BAD_CALL,
    BAD_OBSERVATION,
    CALL_ERROR_CODES,
    UNKNOWN_TOOL,
    Environment,
    ToolResult,
    error_code,
    is_call_error,
    observed_values,
    parse_result_text,
    result_text,
    tool_error,
)

__all__ = [
    "BAD_ARGS",
    "BAD_CALL",
    "BAD_OBSERVATION",
    "CALL_ERROR_CODES",
    "UNKNOWN_TOOL",
    "Environment",
    "ToolResult",
    "error_code",
    "is_call_error",
    "observed_values",
    "parse_result_text",
    "result_text",
    "tool_error",
]
