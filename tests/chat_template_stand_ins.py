"""Small chat templates standing in for model families' own, for the chat-template check's tests
(tests/test_chat_template_check.py) and the bad-input table (tests/test_bad_inputs.py)."""

# Qwen2.5's way: tool schemas in a system turn, calls as <tool_call> JSON, responses as user turns
HERMES = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# a chat-only template: any role but system, user and assistant is an error
NO_TOOL_ROLE = (
    "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Conversation roles must be system, user or assistant') }}{% endif %}"
    "<|{{ m.role }}|>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Llama 3.1's way: a call is a bare JSON object with "parameters"
BARE_JSON_CALLS = (
    HERMES.replace("<tool_call>\n", "")
    .replace("\n</tool_call>", "")
    .replace('"arguments": {{', '"parameters": {{')
)
# a template that renders tool messages without their content
NO_TOOL_CONTENT = HERMES.replace("<tool_response>{{ m.content }}</tool_response>", "<tool_response/>")
