"""Messages appended after a sampled assistant turn, rendered as a piece of the chat template.

An agent loop never re-renders the conversation: the ids it trains on are the prompt, each turn's
sampled ids, and the ids of what came after each turn (tool responses, an agent's next messages).
Those ids are the text the template writes for the new messages *in the context of a
conversation*, from the assistant's end of turn up to the next assistant prompt:

    text = render([stand-in user, assistant, *new], add_generation_prompt=True)
    ids  = tokenize(text[end of the assistant's turn:])

The stand-in user turn is there because real templates need one: Qwen3.5-style templates raise
without a user query (they anchor reasoning on the last one), Mistral's require a user turn
first, Llama 3.1 puts the tools into the first user message. The assistant is the sampled turn
as a message, with its tool calls, so that templates which check calls (Mistral's 9-character
ids, Hermes' tool `name`s) render the tool messages as they will in training data.

The end of an assistant turn is found by rendering, not by searching for `tokenizer.eos_token`:
the token a template writes right after an assistant's content (`<|im_end|>` for a Qwen base
tokenizer whose eos is `<|endoftext|>`, `<|eot_id|>` for Llama 3.1). A turn that ended on it is
`closed`; one stopped by a stop string (`</tool_call>`) is not, and its appended ids start with it.

`check_incremental_template` is the recipe check: it refuses, before any worker starts, a
template that cannot be rendered this way, naming what it does and the fix.
"""

from collections.abc import Callable, Iterable
from typing import Any

STAND_IN_USER = {"role": "user", "content": "Hello."}
MARK = "§content§"  # an assistant content no template writes by itself


class TemplateNotIncremental(ValueError):
    """A chat template whose rendering of appended messages is not a piece of one conversation."""


def call_id(turn: int, index: int) -> str:
    """The id of call `index` of a trajectory's `turn`: 9 letters and digits, the form Mistral's
    templates require and every other accepts."""
    return f"c{turn % 10000:04d}{index % 10000:04d}"


def _render(tokenizer, messages: list[dict], tools, generation_prompt: bool, template_kwargs=None) -> str:
    extra = template_kwargs or {}
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt, **extra
    )


def template_end_of_turn(tokenizer, template_kwargs: dict | None = None) -> tuple[str, int]:
    """(text, id) of the special token the template writes right after an assistant's content."""
    turn = [STAND_IN_USER, {"role": "assistant", "content": MARK}]
    text = _render(tokenizer, turn, None, False, template_kwargs)
    after = text[text.rindex(MARK) + len(MARK) :]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    if not ids or ids[0] not in tokenizer.added_tokens_decoder:
        raise TemplateNotIncremental(
            f"the chat template writes no end-of-turn token after an assistant turn (it writes "
            f"{after[:40]!r}), so a sampled turn has no end to continue from; use a template that "
            "ends every assistant turn with a special token (as Qwen, Llama, Mistral and DeepSeek do)"
        )
    return str(tokenizer.added_tokens_decoder[ids[0]]), ids[0]


def template_end_of_call(tokenizer, template_kwargs: dict | None = None) -> tuple[str, int]:
    """(text, id) of the special token that ends an assistant turn calling a tool: the last one the
    template writes after the call (gpt-oss's `<|call|>`; the end of turn in the other families).
    The end of turn where the template writes no calls or cannot render one."""
    call = {"id": call_id(0, 0), "type": "function", "function": {"name": "probe", "arguments": {"q": MARK}}}
    turn = [STAND_IN_USER, {"role": "assistant", "content": "", "tool_calls": [call]}]
    try:
        text = _render(tokenizer, turn, PROBE_TOOLS, False, template_kwargs)
    except Exception:  # a chat-only template: its turns never end on a call
        return template_end_of_turn(tokenizer, template_kwargs)
    ids = tokenizer(text[text.rfind(MARK) + len(MARK) :], add_special_tokens=False)["input_ids"]
    special = [i for i in ids if i in tokenizer.added_tokens_decoder]
    if MARK not in text or not special:
        return template_end_of_turn(tokenizer, template_kwargs)
    return str(tokenizer.added_tokens_decoder[special[-1]]), special[-1]


def end_of_turn_ids(tokenizer, eos_token_ids: Iterable[int] = ()) -> frozenset[int]:
    """Ids that close an assistant turn: the model's EOS ids (its generation config) and the
    template's end of a call (`template_end_of_call`: its end of turn, but for gpt-oss, whose
    `<|end|>` ends one message of a turn that goes on, and whose answers end on its EOS)."""
    return frozenset(eos_token_ids) | {template_end_of_call(tokenizer)[1]}


def stand_in_assistant(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """An assistant turn the `messages` can follow: one call per tool message, else plain text."""
    calls = [
        {
            "id": m.get("tool_call_id"),
            "type": "function",
            "function": {"name": m.get("name"), "arguments": {}},
        }
        for m in messages
        if m["role"] == "tool"
    ]
    return (
        {"role": "assistant", "content": "", "tool_calls": calls}
        if calls
        else {"role": "assistant", "content": "x"}
    )


RenderDelta = Callable[..., list[int]]  # (messages, tools=None, closed=True, after=None) -> ids


def message_delta_renderer(tokenizer, template_kwargs: dict | None = None) -> RenderDelta:
    """`render(messages, tools=None, closed=True, after=None)`: ids of `messages` as the template
    renders them after the assistant turn `after` (a message; default: a stand-in that the
    messages can follow), up to and including the next assistant prompt. `closed`: the turn
    ended on the end-of-turn token, and the ids start after it; otherwise they start with it.
    `template_kwargs`: extra variables of every render (rollout.chat_template_kwargs)."""
    end_texts = {
        False: template_end_of_turn(tokenizer, template_kwargs)[0],
        True: template_end_of_call(tokenizer, template_kwargs)[0],
    }  # by whether the assistant turn calls tools

    def render(messages: list[dict], tools=None, closed: bool = True, after: dict | None = None) -> list[int]:
        head = [STAND_IN_USER, after or stand_in_assistant(messages)]
        end_text = end_texts[bool(head[1].get("tool_calls"))]
        before = _render(tokenizer, head[:1], tools, False, template_kwargs)
        text = _render(tokenizer, head + messages, tools, True, template_kwargs)
        if not text.startswith(before):
            raise TemplateNotIncremental(
                f"the chat template renders the conversation before an assistant turn differently "
                f"once {[m['role'] for m in messages]} messages follow it (e.g. tools written before the "
                "last user message), so these messages are not a piece appended to the sampled ids"
            )
        end = text.find(end_text, len(before))
        if end < 0:
            raise TemplateNotIncremental(
                f"the chat template writes no {end_text!r} after an assistant turn that "
                f"{[m['role'] for m in messages]} messages follow"
            )
        cut = end + len(end_text) if closed else end
        return tokenizer(text[cut:], add_special_tokens=False)["input_ids"]

    return render


def tool_messages(names: list[str], responses: list[str], turn: int) -> list[dict[str, Any]]:
    """The tool messages answering the calls of a trajectory's `turn`, with `name` and the call's id."""
    return [
        {"role": "tool", "name": name, "tool_call_id": call_id(turn, index), "content": text}
        for index, (name, text) in enumerate(zip(names, responses, strict=True))
    ]


PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "probe",
            "description": "A tool of the template check.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


def check_incremental_template(
    tokenizer, key: str = "the tokenizer", messages: list[dict] | None = None
) -> None:
    """The recipe check of agent loops: TemplateNotIncremental, starting with the recipe `key` of
    the tokenizer, naming what keeps the chat template from rendering `messages` (default: a tool
    response; the environment loop's are user turns) incrementally (no end-of-turn token, or
    earlier turns that change when an assistant turn and the messages follow them) and the fix."""
    probe = messages or tool_messages(["probe"], ["42"], turn=0)
    try:
        message_delta_renderer(tokenizer)(probe, tools=None if messages else PROBE_TOOLS)
    except TemplateNotIncremental as err:
        raise TemplateNotIncremental(
            f"{key}: {err}; agent loops append tool responses and observations to the sampled ids, so set "
            "model.tokenizer_path to a tokenizer whose chat template ends each assistant turn with a "
            "special token and leaves earlier turns as they are"
        ) from None


def tokenize_chat(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict | None = None
) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template (with the `tools`' schemas,
    when given, and the template's extra variables `template_kwargs`), ending with the assistant
    prefix (where the response starts)."""
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
    )
    # The template already wrote any BOS/role tokens; adding special tokens again would double them.
    return tokenizer(text, add_special_tokens=False)["input_ids"]
