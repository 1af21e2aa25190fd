"""Text layer: tokenizers, chat rendering with tools, role-switch pieces, tool-call parsing.

Imports nothing from the model, sampling or training layers.
"""

from envace_jax.text.chat import (
    ChatLayout,
    ConversationParseError,
    ParsedConversation,
    TemplateLayoutError,
    chat_layout,
    decode,
    encode,
    messages_from_text,
    parse_conversation,
    render,
    render_text,
)
from envace_jax.text.codes import Role, Status
from envace_jax.text.role_pieces import (
    RolePieces,
    prompt_ids,
    role_pieces,
    tool_responses_ids,
    tool_responses_text,
)
from envace_jax.text.tokenizer import DEMO, SpecialIds, load_tokenizer, special_ids
from envace_jax.text.tool_calls import (
    ErrorCode,
    ParsedAction,
    ToolCall,
    ToolCallError,
    format_action,
    format_tool_calls,
    parse_tool_calls,
    parse_tool_responses,
    sanitize_json,
    sanitize_text,
    validate_schema,
)
from envace_jax.text.trajectory import EncodedConversation, encode_conversation

__all__ = [
    "DEMO",
    "ChatLayout",
    "ConversationParseError",
    "EncodedConversation",
    "ErrorCode",
    "ParsedAction",
    "ParsedConversation",
    "Role",
    "RolePieces",
    "SpecialIds",
    "Status",
    "TemplateLayoutError",
    "ToolCall",
    "ToolCallError",
    "chat_layout",
    "decode",
    "encode",
    "encode_conversation",
    "format_action",
    "format_tool_calls",
    "load_tokenizer",
    "messages_from_text",
    "parse_conversation",
    "parse_tool_calls",
    "parse_tool_responses",
    "prompt_ids",
    "render",
    "render_text",
    "role_pieces",
    "sanitize_json",
    "sanitize_text",
    "special_ids",
    "tool_responses_ids",
    "tool_responses_text",
    "validate_schema",
]
