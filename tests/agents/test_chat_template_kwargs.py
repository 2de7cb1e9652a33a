"""rollout.chat_template_kwargs reach every chat-template render: the prompt, the tool responses
appended after a turn, and the OpenAI-compatible endpoint's renders (e.g. Qwen3's
`enable_thinking: false`)."""

import pytest

from engines.rollout.config import RolloutConfig
from hybridflow.agents.loop import ToolTurnResult, tool_response_renderer
from hybridflow.agents.openai_loop import OpenAIAgentRollout
from hybridflow.data.prompt_dataset import tokenize_chat
from hybridflow.utils.tiny_model import build_tokenizer

# the tiny template, whose assistant prompt opens an empty think block unless enable_thinking is false
THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ 'NOTHINK' }}{% endif %}{% endif %}"
)
OFF = {"enable_thinking": False}
USER = [{"role": "user", "content": "2+2?"}]


@pytest.fixture
def tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids)


def test_the_prompt_renders_with_the_kwargs(tokenizer):
    assert _text(tokenizer, tokenize_chat(tokenizer, USER)).endswith("<|assistant|>")
    off = tokenize_chat(tokenizer, USER, template_kwargs=OFF)
    assert _text(tokenizer, off).endswith("<|assistant|>NOTHINK")


def test_the_recipe_prompt_dataset_passes_them(tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hybridflow.config.schema import RecipeConfig
    from hybridflow.data.recipe_datasets import recipe_prompt_dataset

    path = tmp_path / "p.parquet"
    row = {"prompt": USER, "data_source": "x", "reward_model": {"ground_truth": "4"}}
    pq.write_table(pa.Table.from_pylist([row]), path)
    cfg = RecipeConfig()
    cfg.rollout.chat_template_kwargs = OFF
    dataset = recipe_prompt_dataset(cfg, tokenizer, [str(path)], None)
    assert _text(tokenizer, dataset.token_ids[0]).endswith("<|assistant|>NOTHINK")


def test_tool_responses_appended_after_a_turn_render_with_the_kwargs(tokenizer):
    result = ToolTurnResult(["4"], 0, ["calculator"])
    plain = tool_response_renderer(tokenizer)(result, True, 0)
    off = tool_response_renderer(tokenizer, template_kwargs=OFF)(result, True, 0)
    assert _text(tokenizer, plain) == "<|tool|>4<|assistant|>"
    assert _text(tokenizer, off) == "<|tool|>4<|assistant|>NOTHINK"


def test_the_endpoint_renders_with_the_kwargs(tokenizer):
    cfg = RolloutConfig(chat_template_kwargs=OFF)
    rollout = OpenAIAgentRollout(None, None, tokenizer, cfg, 0, [tokenizer.eos_token_id])
    session = rollout.session("s", 0)
    assert _text(tokenizer, session.render_full(USER, None)).endswith("<|assistant|>NOTHINK")
    appended = session.render_delta([{"role": "user", "content": "and 3+3?"}])
    assert _text(tokenizer, appended) == "<|user|>and 3+3?<|assistant|>NOTHINK"


def test_kwargs_must_be_a_mapping():
    with pytest.raises(ValueError, match=r"rollout\.chat_template_kwargs must be a mapping"):
        RolloutConfig(chat_template_kwargs=["enable_thinking"])


def test_kwargs_the_renders_set_themselves_are_refused():
    with pytest.raises(ValueError, match=r"rollout\.chat_template_kwargs sets \['tokenize'\]"):
        RolloutConfig(chat_template_kwargs={"tokenize": True, "enable_thinking": False})
