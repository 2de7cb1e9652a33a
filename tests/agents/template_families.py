"""Chat templates of the model families people train with tools, written for these tests.

Each reproduces the features of its family's real template that decide whether messages appended
after a sampled turn render as a piece of one conversation (read from the models'
tokenizer_config.json and vLLM's examples/tool_chat_template_*.jinja; none is copied). The
tokenizers are the tiny model's one-token-per-byte vocabulary plus each family's special tokens.

| family | what its template does that matters here |
| --- | --- |
| qwen2.5 | default system prompt, tools in the system turn, runs of tool messages in one user turn |
| qwen2.5-base | the same template; the tokenizer's eos is <|endoftext|>, never written in a chat turn |
| qwen3.5 | raises without a user query; reasoning kept only after the last one (empty reasoning only |
|  | in the last turn); tool responses in a user turn |
| llama3.1 | tools and the first user message in one turn, outputs in the ipython role, one call a turn |
| mistral-v0.3 | strict user/assistant alternation, 9-character call ids, [TOOL_RESULTS], no prompt |
| deepseek-v3 | tool calls and outputs in blocks, no assistant prompt after tool outputs |
| hermes | tool messages in a tool role, each naming its tool (raises without `name`) |
| gpt-oss | harmony: channels, a call is a message to functions.NAME ending on <|call|> (not the |
|  | <|end|> of other messages), one call a sampled turn, a tool answers as the role functions.NAME |
"""

from dataclasses import dataclass

from hybridflow.utils.tiny_model import byte_vocab

_CHATML_TOOLS = (
    "{%- if tools %}{{- '\\n\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\nCall a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call>.\' }}'
    "{%- endif %}"
)
_CHATML_CALLS = (
    "{%- for call in message.tool_calls %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- set args = call.function.arguments %}"
    '{{- \'<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' }}'
    "{{- args if args is string else (args | tojson) }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
)
_CHATML_TOOL_RUN = (
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
)

QWEN25 = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.' }}{%- endif %}"
    + _CHATML_TOOLS
    + "{{- '<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if message.content %}{{- message.content }}{%- endif %}"
    + _CHATML_CALLS
    + "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}" + _CHATML_TOOL_RUN + "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

QWEN35 = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' and not message.content.startswith('<tool_response>') %}"
    "{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- if ns.last_query < 0 %}{{- raise_exception('No user query found in messages.') }}{%- endif %}"
    "{%- if messages[0].role == 'system' or tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}"
    + _CHATML_TOOLS
    + "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set text = message.content or '' %}{%- set reasoning = '' %}"
    "{%- if '</think>' in text %}"
    "{%- set reasoning = text.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set text = text.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- text }}" + _CHATML_CALLS.replace("message.content or", "text or") + "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}" + _CHATML_TOOL_RUN + "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

LLAMA31 = (
    "{{- bos_token }}"
    "{%- set rest = messages %}{%- set system = '' %}"
    "{%- if messages[0].role == 'system' %}"
    "{%- set system = messages[0].content %}{%- set rest = messages[1:] %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Knowledge cutoff: 2023-12\\n\\n' + system + '<|eot_id|>' }}"
    "{%- if tools %}"
    "{%- if not rest or rest[0].role != 'user' %}"
    "{{- raise_exception('the tools go into the first user message, and there is none') }}{%- endif %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\nTools you may call, answering with one JSON object"
    ' {"name": ..., "parameters": ...}:\\n\' }}'
    "{%- for tool in tools %}{{- (tool | tojson(indent=2)) + '\\n' }}{%- endfor %}"
    "{{- '\\n' + rest[0].content + '<|eot_id|>' }}{%- set rest = rest[1:] %}"
    "{%- endif %}"
    "{%- for message in rest %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{%- if message.tool_calls | length != 1 %}"
    "{{- raise_exception('This template supports one tool call per turn.') }}{%- endif %}"
    "{%- set call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    '{{- \'{"name": "\' + call.name + \'", "parameters": \' }}'
    "{{- call.arguments if call.arguments is string else (call.arguments | tojson) }}{{- '}<|eot_id|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
    "{{- (message.content | tojson) if message.content is mapping else message.content }}{{- '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

MISTRAL03 = (
    "{%- set rest = messages %}"
    "{%- if messages[0].role == 'system' %}{%- set rest = messages[1:] %}{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in rest %}"
    "{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in rest | rejectattr('role', 'equalto', 'tool') | rejectattr('tool_calls') %}"
    "{%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('roles must alternate user/assistant after an optional system message') }}"
    "{%- endif %}{%- endfor %}"
    "{{- bos_token }}"
    "{%- for message in rest %}"
    "{%- if message.role == 'user' %}"
    "{%- if tools and loop.index0 == ns.last_user %}"
    "{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{%- set text = message.content %}"
    "{%- if loop.index0 == ns.last_user and messages[0].role == 'system' %}"
    "{%- set text = messages[0].content + '\\n\\n' + text %}{%- endif %}"
    "{{- '[INST] ' + text + '[/INST]' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '[TOOL_CALLS] [' }}"
    "{%- for call in message.tool_calls %}"
    "{%- if call.id is not string or call.id | length != 9 %}"
    "{{- raise_exception('tool call ids must be 9 letters or digits') }}{%- endif %}"
    "{%- set args = call.function.arguments %}"
    '{{- \'{"name": "\' + call.function.name + \'", "arguments": \' }}'
    "{{- args if args is string else (args | tojson) }}{{- ', \"id\": \"' + call.id + '\"}' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}"
    "{%- endfor %}{{- ']' + eos_token }}"
    "{%- elif message.role == 'assistant' %}{{- ' ' + message.content | trim + eos_token }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if message.tool_call_id is not string or message.tool_call_id | length != 9 %}"
    "{{- raise_exception('tool call ids must be 9 letters or digits') }}{%- endif %}"
    '{{- \'[TOOL_RESULTS] {"content": \' + (message.content | tojson) + \', "call_id": "\' }}'
    "{{- message.tool_call_id + '\"}[/TOOL_RESULTS]' }}"
    "{%- endif %}"
    "{%- endfor %}"
)

DEEPSEEK_V3 = (
    "{%- set ns = namespace(in_outputs=false, system='') %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}{%- set ns.system = message.content %}{%- endif %}{%- endfor %}"
    "{{- bos_token + ns.system }}"
    "{%- if tools %}{{- '\\n\\n## Tools\\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson) + '\\n' }}{%- endfor %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role != 'tool' and ns.in_outputs %}"
    "{{- '<｜tool▁outputs▁end｜>' }}{%- set ns.in_outputs = false %}{%- endif %}"
    "{%- if message.role == 'user' %}{{- '<｜User｜>' + message.content }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<｜Assistant｜>' }}{%- endif %}"
    "{{- message.content or '' }}"
    "{%- if message.tool_calls %}{{- '<｜tool▁calls▁begin｜>' }}"
    "{%- for call in message.tool_calls %}"
    "{%- set args = call.function.arguments %}"
    "{{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + call.function.name + '\\n```json\\n' }}"
    "{{- args if args is string else (args | tojson) }}{{- '\\n```<｜tool▁call▁end｜>' }}"
    "{%- endfor %}{{- '<｜tool▁calls▁end｜>' }}{%- endif %}"
    "{{- '<｜end▁of▁sentence｜>' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if not ns.in_outputs %}{{- '<｜tool▁outputs▁begin｜>' }}{%- set ns.in_outputs = true %}{%- endif %}"
    "{{- '<｜tool▁output▁begin｜>' + message.content + '<｜tool▁output▁end｜>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if ns.in_outputs %}{{- '<｜tool▁outputs▁end｜>' }}"
    "{%- elif add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}"
)

HERMES = (
    "{{- '<|im_start|>system\\nYou are a function calling AI model.' }}"
    + _CHATML_TOOLS
    + "{%- if messages[0].role == 'system' %}{{- '\\n' + messages[0].content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if message.content %}{{- message.content }}{%- endif %}"
    + _CHATML_CALLS
    + "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if message.name is not defined or not message.name %}"
    "{{- raise_exception('every tool message needs the name of its tool') }}{%- endif %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>tool' }}{%- endif %}"
    '{{- \'\\n<tool_response>\\n{"name": "\' + message.name + \'", "content": \' }}'
    "{{- message.content | tojson }}"
    "{{- '}\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# gpt-oss (the harmony format): every message is <|start|>ROLE ... <|message|>BODY<|end|>; the
# assistant writes on a channel (final: answers, commentary: preambles and tool calls, addressed
# `to=functions.NAME`, which end on <|call|>); a tool answers as the role functions.NAME.
GPT_OSS = (
    "{%- set ns = namespace(system='', last_call='') %}"
    "{%- if messages[0].role == 'system' %}{%- set ns.system = messages[0].content %}{%- endif %}"
    "{{- '<|start|>system<|message|>You answer on channels: analysis, commentary or final; '"
    " + 'tools are called on commentary.<|end|>' }}"
    "{%- if ns.system or tools %}{{- '<|start|>developer<|message|>' }}"
    "{%- if ns.system %}{{- '# Instructions\\n\\n' + ns.system + '\\n\\n' }}{%- endif %}"
    "{%- if tools %}{{- '# Tools\\n\\nnamespace functions {\\n' }}"
    "{%- for tool in tools %}{{- '// ' + tool.function.description + '\\ntype ' + tool.function.name }}"
    "{{- ' = (_: ' + (tool.function.parameters | tojson) + ') => any;\\n' }}{%- endfor %}"
    "{{- '} // functions' }}{%- endif %}{{- '<|end|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|start|>user<|message|>' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{%- if message.content %}"
    "{{- '<|start|>assistant<|channel|>commentary<|message|>' + message.content + '<|end|>' }}{%- endif %}"
    "{%- for call in message.tool_calls %}{%- set args = call.function.arguments %}"
    "{{- '<|start|>assistant<|channel|>commentary to=functions.' + call.function.name }}"
    "{{- ' <|constrain|>json<|message|>' + (args if args is string else (args | tojson)) + '<|call|>' }}"
    "{%- set ns.last_call = call.function.name %}{%- endfor %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start|>functions.' + (message.name or ns.last_call) + ' to=assistant<|channel|>commentary' }}"
    "{{- '<|message|>' + message.content + '<|end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)

DEEPSEEK_TOKENS = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
]
CHATML_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
]
GPT_OSS_TOKENS = [
    "<|startoftext|>",
    "<|endoftext|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|call|>",
    "<|return|>",
]
MISTRAL_TOKENS = [
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
]


@dataclass(frozen=True)
class Family:
    name: str
    template: str
    special_tokens: list[str]
    eos: str  # the tokenizer's eos_token
    end_of_turn: str  # what the model samples to end a turn
    bos: str = "<s>"
    parallel_calls: bool = True  # the template renders two calls in one turn

    def tokenizer(self):
        from transformers import Qwen2Tokenizer

        tokenizer = Qwen2Tokenizer(
            vocab=byte_vocab(),
            merges=[],
            pad_token="<pad>",
            eos_token=self.eos,
            bos_token=self.bos,
            unk_token="<unk>",
            additional_special_tokens=self.special_tokens,
        )
        tokenizer.chat_template = self.template
        return tokenizer


FAMILIES = [
    Family("qwen2.5", QWEN25, CHATML_TOKENS, "<|im_end|>", "<|im_end|>"),
    Family("qwen2.5-base", QWEN25, CHATML_TOKENS, "<|endoftext|>", "<|im_end|>"),
    Family("qwen3.5", QWEN35, CHATML_TOKENS, "<|im_end|>", "<|im_end|>"),
    Family("llama3.1", LLAMA31, LLAMA_TOKENS, "<|eot_id|>", "<|eot_id|>", "<|begin_of_text|>", False),
    Family("mistral-v0.3", MISTRAL03, MISTRAL_TOKENS, "</s>", "</s>"),
    Family(
        "deepseek-v3",
        DEEPSEEK_V3,
        DEEPSEEK_TOKENS,
        "<｜end▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "<｜begin▁of▁sentence｜>",
    ),
    Family("hermes", HERMES, CHATML_TOKENS, "<|im_end|>", "<|im_end|>"),
    # a sampled turn ends on <|call|> after a call (and on its EOS <|return|> after an answer)
    Family("gpt-oss", GPT_OSS, GPT_OSS_TOKENS, "<|return|>", "<|call|>", "<|startoftext|>", False),
]
