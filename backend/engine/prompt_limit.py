"""How many bytes of prompt text are worth tokenizing, by default.

Text of n bytes holds at least n / (the longest token's bytes) tokens, so text longer than
``max_model_len`` x that (2x for normalizers that shorten text) cannot fit the context and is
refused before it is tokenized. With long tokens (tokenizers with tokens for long runs of spaces
or dashes spell 100+ bytes) that bound reaches tens of megabytes at a 128k context, seconds of
tokenizing for text that is then refused, so the default also caps the average at
``MAX_AVERAGE_TOKEN_BYTES`` per token of context: far above what text and code average (3 to 6
bytes a token), 4 MiB at a 128k context. A prompt that really averages more (long runs of
whitespace, say) needs ``max_prompt_bytes`` set higher.
"""
from __future__ import annotations

MAX_AVERAGE_TOKEN_BYTES = 32
SLACK_BYTES = 1024


def default_max_prompt_bytes(max_model_len: int, max_token_bytes: int) -> int:
    """The default ``max_prompt_bytes`` for a context of ``max_model_len`` tokens."""
    per_token = min(2 * max(1, max_token_bytes), MAX_AVERAGE_TOKEN_BYTES)
    return max_model_len * per_token + SLACK_BYTES
