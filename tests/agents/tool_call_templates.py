"""Chat templates of the tool-call formats the template families (template_families.py) do not
cover, written for these tests: Qwen3-Coder's XML calls, and a call format no parser knows.

Qwen3-Coder writes a call as <tool_call>, a <function=NAME> line, one <parameter=KEY> block per
argument (a string as it is, anything else as JSON, each on its own line), </function>,
</tool_call>; tool responses go in a user turn inside <tool_response>. Read from the model's
public chat template; none of it is copied.
"""

from template_families import CHATML_TOKENS, Family

_CHATML_TURNS = (
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\nFunctions you may call:\\n' }}"
    "{%- for t in tools %}{{- (t | tojson) + '\\n' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
)

QWEN3_CODER = (
    _TOOLS + "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}"
    "{%- if m.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n<function=' + c.function.name + '>\\n' }}"
    "{%- for key, value in c.function.arguments.items() %}"
    "{{- '<parameter=' + key + '>\\n' }}{{- value if value is string else (value | tojson) }}"
    "{{- '\\n</parameter>\\n' }}"
    "{%- endfor %}{{- '</function>\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}" + _CHATML_TURNS
)

# calls as <invoke name="..."> blocks: a format no parser reads
UNKNOWN_CALLS = (
    _TOOLS + "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}"
    "{{- '<invoke name=\"' + c.function.name + '\">' + (c.function.arguments | tojson) + '</invoke>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}" + _CHATML_TURNS
)

QWEN3_CODER_FAMILY = Family("qwen3-coder", QWEN3_CODER, CHATML_TOKENS, "<|im_end|>", "<|im_end|>")
UNKNOWN_FAMILY = Family("unknown", UNKNOWN_CALLS, CHATML_TOKENS, "<|im_end|>", "<|im_end|>")
