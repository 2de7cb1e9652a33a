"""What of a tool's response reaches the model: at most `rollout.agent.max_tool_response_length`
tokens of it, then a marker the model can read, so one tool that prints 100 kB cannot spend the
trajectory's whole token budget (`rollout.response_length`)."""

from collections.abc import Callable

TRUNCATED_MARKER = "...(truncated)"
# text -> (the text the model reads, whether it was cut)
Truncate = Callable[[str], tuple[str, bool]]


def tool_response_truncator(tokenizer, max_tokens: int | None) -> Truncate:
    """`truncate(text)`: the first `max_tokens` tokens of `text` (the tokenizer's, no special
    tokens) followed by TRUNCATED_MARKER when it is longer; `text` itself otherwise, or always
    when `max_tokens` is None."""

    def truncate(text: str) -> tuple[str, bool]:
        if max_tokens is None:
            return text, False
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= max_tokens:
            return text, False
        return tokenizer.decode(ids[:max_tokens]) + TRUNCATED_MARKER, True

    return truncate
