"""Settings of the rollout engines (SGLang's or vLLM's names where the engine has one).

Imports nothing heavy so that the recipe schema can compose these dataclasses. Each class checks
its own values in `__post_init__` and raises `ValueError` naming the key and what was expected.
Choice fields are `Literal` types (the recipe loader rejects other values); the tuples below are
read from them so each list of valid values is written once.
"""

import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from engines.passthrough import check_setting_bounds, check_setting_names, check_setting_values
from engines.rollout.sglang_server_args import SERVER_ARGS_FIELDS, SGLANG_VERSION
from engines.rollout.vllm_engine_args import (
    ENGINE_ARGS_BOUNDS,
    ENGINE_ARGS_CHOICES,
    ENGINE_ARGS_FIELDS,
    ENGINE_ARGS_KINDS,
    VLLM_VERSION,
)

# hf: transformers generate (CPU or CUDA) | vllm: vLLM (CPU build or CUDA) | sglang: CUDA only
RolloutName = Literal["hf", "vllm", "sglang"]
RolloutDtype = Literal["float32", "bfloat16", "float16"]
# single_turn: the engine's batch generation | tool: multi-turn tool use (hybridflow/agents/loop.py)
# openai: a user function written against the openai client (hybridflow/agents/openai_loop.py)
# environment: episodes against an environment server (hybridflow/agents/environments.py)
AgentLoopName = Literal["single_turn", "tool", "openai", "environment"]
# openenv: an OpenEnv server, over its WebSocket session protocol (hybridflow/agents/openenv_env.py)
EnvironmentName = Literal["openenv"]
# sum: the episode's step rewards added, on its last sampled token | final: the last step's reward
# there | per_turn: each step's reward on the last sampled token of the turn it answers
EpisodeReward = Literal["sum", "final", "per_turn"]
ToolCallFormatName = Literal[
    "auto", "hermes", "qwen3_coder", "llama3_json", "mistral", "deepseek_v3", "harmony"
]
LoadFormat = Literal["dummy", "auto"]  # dummy: random init, weights arrive with the first sync
# vLLM's CPU build: packed (oneDNN, vLLM's default) | plain (engines/rollout/vllm_cpu_weights.py)
VLLMCPUWeights = Literal["packed", "plain"]
OPENAI_AGENT = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")  # package.module:function
ROLLOUT_ENGINES = get_args(RolloutName)
ROLLOUT_DTYPES = get_args(RolloutDtype)
LOAD_FORMATS = get_args(LoadFormat)
VLLM_CPU_WEIGHTS = get_args(VLLMCPUWeights)
VLLM_MAX_LOGPROBS = 20  # vLLM 0.32's default max_logprobs (vllm/config/model.py ModelConfig)

# ServerArgs fields the sglang engine sets from the rollout settings (or needs as they are)
SGLANG_SET_ELSEWHERE = {
    "model_path": "model.path",
    "dtype": "rollout.dtype",
    "tp_size": "rollout.tensor_model_parallel_size",
    "mem_fraction_static": "rollout.gpu_memory_utilization",
    "load_format": "rollout.load_format",
    "random_seed": "rollout.seed",
    "base_gpu_id": "the rollout group's GPUs (engines/placement.py)",
    "enable_deterministic_inference": "rollout.enable_deterministic_inference",
    "enable_memory_saver": "the hybrid engine (it must be true to release memory between phases)",
    "skip_tokenizer_init": "whether stop strings are used",
}
# EngineArgs fields the vllm engine sets from the rollout settings (or needs as they are)
VLLM_SET_ELSEWHERE = {
    "model": "model.path",
    "dtype": "rollout.dtype",
    "tensor_parallel_size": "rollout.tensor_model_parallel_size",
    "gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "load_format": "rollout.load_format",
    "seed": "rollout.seed",
    "enable_sleep_mode": "rollout.free_cache_engine (memory is released between phases on CUDA)",
    "distributed_executor_backend": "the rollout group (external_launcher when TP > 1)",
    "skip_tokenizer_init": "whether stop strings are used",
    "logprobs_mode": "the engine (rollout_log_probs are the log-probs of the distribution sampled from)",
    "generation_config": "the engine (sampling comes from the recipe, never the checkpoint's defaults)",
}


@dataclass
class SamplingConfig:
    """How responses are sampled; validation uses its own (greedy by default).

    `do_sample: false` is greedy decoding (temperature, top_p and top_k are then unused).
    """

    n: int = 1  # samples per prompt; a caller that repeats the batch itself passes meta_info["n"]=1
    temperature: float = 1.0  # the sampling temperature; must be > 0 when do_sample is true
    top_p: float = 1.0  # 1.0: no nucleus filtering
    top_k: int = -1  # -1: no top-k filtering
    max_new_tokens: int | None = None  # the longest response, in tokens; None: rollout.response_length
    stop: list[str] = field(default_factory=list)  # stop strings; the response ends after the first one
    do_sample: bool = True  # false: greedy decoding

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"sampling.n must be >= 1, got {self.n}")
        if self.do_sample and self.temperature <= 0:
            raise ValueError(
                f"sampling.temperature must be > 0 when do_sample is true, got {self.temperature}; "
                "for greedy decoding set do_sample: false"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"sampling.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1 or null, got {self.max_new_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"sampling.stop must be a list of non-empty strings, got {self.stop!r}")

    def filters(self) -> dict[str, Any]:
        """`top_k` and `top_p` as the engines sample with them (off for greedy decoding): what the
        actor needs to compute log-probs of the same distribution (docs/sampling.md)."""
        if not self.do_sample:
            return {"top_k": -1, "top_p": 1.0}
        return {"top_k": self.top_k, "top_p": self.top_p}


@dataclass
class EnvironmentConfig:
    """The environment server episodes of `rollout.agent.loop=environment` run against
    (docs/environments.md): each sampled turn is an action, each observation a user turn."""

    name: EnvironmentName = "openenv"  # the connector that speaks the server's protocol
    url: str = ""  # the server's base URL, e.g. http://127.0.0.1:8000 (checked before any worker starts)
    action_field: str = "message"  # the action's field that carries the model's turn text
    observation_field: str = ""  # the observation's field the model reads; "": every field, as JSON
    reward: EpisodeReward = "sum"  # how step rewards become the trajectory's reward
    # opening an episode's session; a server that does not answer in time fails the call
    connect_timeout_s: float = 30.0
    step_timeout_s: float = 60.0  # one reset or step; a slower answer fails the generation call
    max_concurrent_episodes: int = 0  # sessions open at once per rollout worker; 0: every row of a call

    def __post_init__(self) -> None:
        names = get_args(EnvironmentName)
        if self.name not in names:
            raise ValueError(
                f"rollout.agent.environment.name must be one of {names}, got {self.name!r}; "
                "set rollout.agent.environment.name: openenv"
            )
        rewards = get_args(EpisodeReward)
        if self.reward not in rewards:
            raise ValueError(
                f"rollout.agent.environment.reward must be one of {rewards}, got {self.reward!r}"
            )
        if not isinstance(self.action_field, str) or not self.action_field:
            raise ValueError(
                "rollout.agent.environment.action_field must name a field of the action, "
                f"got {self.action_field!r}"
            )
        if self.connect_timeout_s <= 0 or self.step_timeout_s <= 0:
            raise ValueError(
                "rollout.agent.environment.connect_timeout_s and step_timeout_s must be > 0, got "
                f"{self.connect_timeout_s} and {self.step_timeout_s}"
            )
        if self.max_concurrent_episodes < 0:
            raise ValueError(
                "rollout.agent.environment.max_concurrent_episodes must be >= 0 (0: every row), "
                f"got {self.max_concurrent_episodes}"
            )


@dataclass
class AgentConfig:
    """How each prompt's trajectory is produced (docs/agents.md)."""

    loop: AgentLoopName = "single_turn"  # how a trajectory is generated
    # for loop: tool, each a dotted path of a Tool, or {path: <dotted path>, kwargs: {<its arguments>}}
    tools: list[Any] = field(default_factory=list)
    max_turns: int = 4  # sampled turns per trajectory (tool responses between them)
    tool_timeout_s: float = 30.0  # per tool call; a call that takes longer answers with an error
    # tool calls running at once in a rollout worker, over all its trajectories; 0: its CPU count
    max_concurrent_tool_calls: int = 0
    # tokens of a tool response the model reads (longer ones are cut, marked "...(truncated)"); None: all
    max_tool_response_length: int | None = 256
    # how the model writes tool calls (hybridflow/agents/tool_formats.py); auto: read from the chat template
    tool_call_format: ToolCallFormatName = "auto"
    # for loop: openai, `package.module:function`: async def run(client, model, messages, **row)
    openai_agent: str = ""
    # for loop: environment, the environment server and how its rewards count (docs/environments.md)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)

    def __post_init__(self) -> None:
        loops = get_args(AgentLoopName)
        if self.loop not in loops:
            raise ValueError(f"rollout.agent.loop must be one of {loops}, got {self.loop!r}")
        if self.max_turns < 1:
            raise ValueError(f"rollout.agent.max_turns must be >= 1, got {self.max_turns}")
        if self.tool_timeout_s <= 0:
            raise ValueError(f"rollout.agent.tool_timeout_s must be > 0, got {self.tool_timeout_s}")
        if self.max_concurrent_tool_calls < 0:
            raise ValueError(
                "rollout.agent.max_concurrent_tool_calls must be >= 0 (0: the worker's CPU count), "
                f"got {self.max_concurrent_tool_calls}"
            )
        formats = get_args(ToolCallFormatName)
        if self.tool_call_format not in formats:
            raise ValueError(
                f"rollout.agent.tool_call_format must be one of {formats}, got {self.tool_call_format!r}"
            )
        if self.max_tool_response_length is not None and self.max_tool_response_length < 1:
            raise ValueError(
                "rollout.agent.max_tool_response_length must be >= 1 token, or null for no limit, "
                f"got {self.max_tool_response_length}"
            )
        if self.loop == "tool" and not self.tools:
            raise ValueError("rollout.agent.loop=tool needs rollout.agent.tools (dotted paths of tools)")
        if self.tools and self.loop != "tool":
            raise ValueError(f"rollout.agent.tools is set but rollout.agent.loop={self.loop!r}; use tool")
        if self.loop == "openai" and not OPENAI_AGENT.fullmatch(self.openai_agent):
            raise ValueError(
                "rollout.agent.loop=openai needs rollout.agent.openai_agent='package.module:function' "
                f"(an async function of the openai client), got {self.openai_agent!r}"
            )
        if self.openai_agent and self.loop != "openai":
            raise ValueError(
                f"rollout.agent.openai_agent is set but rollout.agent.loop={self.loop!r}; use openai"
            )
        if self.loop == "environment" and not self.environment.url:
            raise ValueError(
                "rollout.agent.loop=environment needs rollout.agent.environment.url, the environment "
                "server's base URL (e.g. http://127.0.0.1:8000)"
            )

    def tool_call_limit(self) -> int:
        """How many tool calls may run at once in this process (each sandboxed call runs two
        interpreters beside the engine)."""
        return self.max_concurrent_tool_calls or os.cpu_count() or 1


# apply_chat_template's own arguments, which each render sets: not template variables
TEMPLATE_CALL_ARGUMENTS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
     "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


@dataclass
class ServerConfig:
    """The OpenAI-compatible endpoint agents of `rollout.agent.loop=openai` call (docs/agents.md);
    served in the rollout worker's process while it generates."""

    host: str = "127.0.0.1"  # the address it listens on; the agents run in the same process
    port: int = 0  # 0: a free port, chosen at each generation call
    model_name: str = "policy"  # the model name /v1/models lists and requests must name

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(
                f"rollout.server.host must be an interface address such as 127.0.0.1, got {self.host!r}"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"rollout.server.port must be in [0, 65535] (0: a free port), got {self.port}")
        if not isinstance(self.model_name, str) or not self.model_name.strip():
            raise ValueError(f"rollout.server.model_name must be a non-empty string, got {self.model_name!r}")


@dataclass
class RolloutConfig:
    """Which engine generates, and how weights reach it."""

    name: RolloutName = "hf"  # the engine that generates
    tensor_model_parallel_size: int = 1  # ranks per SGLang/vLLM engine; the hf engine has no TP (must be 1)
    dtype: RolloutDtype = "float32"  # the engine's weights and compute
    response_length: int = 256  # width of `responses`; max_new_tokens may not exceed it
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    val_sampling: SamplingConfig = field(
        default_factory=lambda: SamplingConfig(n=1, temperature=0.0, do_sample=False)
    )
    load_format: LoadFormat = "dummy"  # "auto": read the weights from the model directory
    seed: int = 42  # base of the per-call sampling seed when meta_info carries no "seed"
    # the engine's own per-token log-probs as rollout_log_probs: the mismatch monitor (every step) and the
    # off-policy corrections read them; false saves their small cost and turns the monitor off
    calculate_log_probs: bool = True
    # mixture-of-experts models: each input token's top-k experts per layer as routed_experts
    # (B, P+R, L, k), for actor.megatron.moe_routing_replay=rollout (hf engine; docs/routing-replay.md)
    return_routed_experts: bool = False
    # 0 = off; K > 0: every response token also gets the engine's K most likely tokens and their log-probs
    # (the opt-in full-distribution mismatch check)
    top_k_log_probs: int = 0
    weight_sync_bucket_mb: int = 512  # weights reach the engine in buckets of at most this many MiB
    # trainer.placement=disaggregated: a sync sends only the elements that changed since the version the
    # engines hold, checked by checksum (a full sync after a restart); a CPU copy of the weights per process
    weight_sync_delta: bool = False
    # after every sync: hf compares every tensor's checksum; vllm its log-probs of fixed tokens
    verify_weight_sync: bool = False
    # the share of GPU memory the engine may hold (SGLang's mem_fraction_static, vLLM's
    # gpu_memory_utilization)
    gpu_memory_utilization: float = 0.5
    free_cache_engine: bool = True  # release the engine's memory after generation
    # SGLang's name. True: per-request seeds are honoured, so sampling is reproducible (and a
    # resumed run samples as the uninterrupted one) at the cost of batch-invariant kernels.
    # False: SGLang sampling is not reproducible. The hf engine is always seeded.
    enable_deterministic_inference: bool = False
    # any other SGLang ServerArgs field by its own name (checked against the pinned version's fields),
    # e.g. {enable_torch_compile: true, attention_backend: fa3}
    sglang: dict[str, Any] = field(default_factory=dict)
    # any other vLLM EngineArgs field by its own name (checked against the pinned version's fields),
    # e.g. {max_model_len: 2048, enforce_eager: false}. On CPU the KV cache is
    # kv_cache_memory_bytes (default 1 GiB there); on CUDA gpu_memory_utilization decides.
    vllm: dict[str, Any] = field(default_factory=dict)
    # vLLM's CPU build only. packed: linears prepacked for oneDNN (vLLM's default: faster
    # generation, but every sync re-packs every layer); plain: torch linears on plain weights (a
    # sync loads them in place, about 5x faster; generation about 0.7x). docs/engines.md
    vllm_cpu_weights: VLLMCPUWeights = "packed"
    agent: AgentConfig = field(default_factory=AgentConfig)
    # extra variables of every chat-template render (prompts, agent turns), e.g. {enable_thinking: false}
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    server: ServerConfig = field(default_factory=ServerConfig)  # for rollout.agent.loop=openai
    # trainer.placement=disaggregated: a rollout process that dies is restarted with the current
    # weights (checked) and its lost calls generated again, this many times in a run; one more death
    # stops the run (0: the first one does). docs/async.md "Engine restarts"
    max_engine_restarts: int = 3
    # trainer.placement=disaggregated: a generation call still running after this many seconds gets
    # its engine health-checked; one that fails the check is hung and restarted like a dead one,
    # one that passes is busy and waited for up to trainer.worker_call_timeout_s
    engine_call_timeout_s: float = 600.0
    # the health check's own deadline (the engine's loop answers it between two decoding steps)
    engine_health_check_timeout_s: float = 60.0
    # trainer.placement=disaggregated: seconds a weight transfer to the rollout pool may take
    weight_transfer_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.name not in ROLLOUT_ENGINES:
            raise ValueError(f"rollout.name must be one of {ROLLOUT_ENGINES}, got {self.name!r}")
        if self.tensor_model_parallel_size < 1:
            raise ValueError(
                f"rollout.tensor_model_parallel_size must be >= 1, got {self.tensor_model_parallel_size}"
            )
        if self.name == "hf" and self.tensor_model_parallel_size != 1:
            raise ValueError(
                "rollout.tensor_model_parallel_size must be 1 for rollout.name=hf (each rank holds a "
                f"full replica), got {self.tensor_model_parallel_size}; use rollout.name=vllm or sglang"
            )
        if self.dtype not in ROLLOUT_DTYPES:
            raise ValueError(f"rollout.dtype must be one of {ROLLOUT_DTYPES}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"rollout.load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.response_length < 1:
            raise ValueError(f"rollout.response_length must be >= 1, got {self.response_length}")
        for key in ("sampling", "val_sampling"):
            limit = getattr(self, key).max_new_tokens
            if limit is not None and limit > self.response_length:
                raise ValueError(
                    f"rollout.{key}.max_new_tokens={limit} exceeds rollout.response_length="
                    f"{self.response_length}; raise response_length or lower max_new_tokens"
                )
        if self.max_engine_restarts < 0:
            raise ValueError(
                f"rollout.max_engine_restarts must be >= 0 (0: a dead rollout process ends the run), "
                f"got {self.max_engine_restarts}"
            )
        if not isinstance(self.chat_template_kwargs, dict):
            raise ValueError(
                "rollout.chat_template_kwargs must be a mapping of template variables, e.g. "
                f"{{enable_thinking: false}}, got {self.chat_template_kwargs!r}"
            )
        owned = sorted(set(self.chat_template_kwargs) & TEMPLATE_CALL_ARGUMENTS)
        if owned:
            raise ValueError(
                f"rollout.chat_template_kwargs sets {owned}, which the renders set themselves; "
                "keep only the template's own variables (e.g. enable_thinking)"
            )
        for key in ("engine_call_timeout_s", "engine_health_check_timeout_s", "weight_transfer_timeout_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"rollout.{key} must be > 0 seconds, got {getattr(self, key)}")
        if self.weight_sync_bucket_mb <= 0:
            raise ValueError(f"rollout.weight_sync_bucket_mb must be > 0, got {self.weight_sync_bucket_mb}")
        if not 0.0 < self.gpu_memory_utilization < 1.0:
            raise ValueError(
                f"rollout.gpu_memory_utilization must be in (0, 1), got {self.gpu_memory_utilization}"
            )
        self._check_engine_specific_settings()
        self._check_top_k_log_probs()

    def _check_engine_specific_settings(self) -> None:
        """Settings that only some engines take, and the engines' own pass-through settings."""
        if self.verify_weight_sync and self.name == "sglang":
            raise ValueError(
                "rollout.verify_weight_sync needs rollout.name=hf or vllm: SGLang exposes no read-back "
                "of its (fused, TP-sharded) parameters"
            )
        if self.agent.loop != "single_turn" and (self.name != "vllm" or self.tensor_model_parallel_size != 1):
            raise ValueError(
                f"rollout.agent.loop={self.agent.loop!r} runs requests one by one through vLLM: set "
                f"rollout.name=vllm and rollout.tensor_model_parallel_size=1 (got {self.name!r}, "
                f"{self.tensor_model_parallel_size})"
            )
        if self.vllm_cpu_weights not in VLLM_CPU_WEIGHTS:
            raise ValueError(
                f"rollout.vllm_cpu_weights must be one of {VLLM_CPU_WEIGHTS}, got {self.vllm_cpu_weights!r}"
            )
        if self.vllm_cpu_weights != "packed" and self.name != "vllm":
            raise ValueError(
                f"rollout.vllm_cpu_weights={self.vllm_cpu_weights!r} is a setting of the vllm engine, but "
                f"rollout.name={self.name!r}; remove it or use rollout.name=vllm"
            )
        for engine in ("sglang", "vllm"):
            if getattr(self, engine) and self.name != engine:
                raise ValueError(
                    f"rollout.{engine} is set but rollout.name={self.name!r}; remove it or use {engine}"
                )
        check_setting_names(
            "rollout.sglang",
            self.sglang,
            SERVER_ARGS_FIELDS,
            f"SGLang {SGLANG_VERSION} ServerArgs",
            SGLANG_SET_ELSEWHERE,
        )
        check_setting_names(
            "rollout.vllm",
            self.vllm,
            ENGINE_ARGS_FIELDS,
            f"vLLM {VLLM_VERSION} EngineArgs",
            VLLM_SET_ELSEWHERE,
        )
        # the values vLLM would refuse (or misread) only in the workers: a quoted number, a choice it
        # lacks, a number outside its config's bounds
        vllm = f"vLLM {VLLM_VERSION} EngineArgs"
        check_setting_values("rollout.vllm", self.vllm, ENGINE_ARGS_KINDS, ENGINE_ARGS_CHOICES, vllm)
        check_setting_bounds("rollout.vllm", self.vllm, ENGINE_ARGS_BOUNDS, vllm)

    def _check_top_k_log_probs(self) -> None:
        """What rollout.top_k_log_probs needs: the engine's log-probs, an engine that returns the top K
        (vLLM: at most its max_logprobs), and responses the engine sampled every token of."""
        k, key = self.top_k_log_probs, "rollout.top_k_log_probs"
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"{key} must be an int >= 0 (0: off), got {k!r}")
        if k == 0:
            return
        if not self.calculate_log_probs:
            raise ValueError(f"{key}={k} needs the engine's log-probs: set rollout.calculate_log_probs=true")
        if self.name not in ("hf", "vllm"):
            raise ValueError(
                f"{key}={k} with rollout.name={self.name!r}: only the hf and vllm engines return the top K; "
                f"use one of them or set {key}=0"
            )
        if self.agent.loop != "single_turn":
            raise ValueError(
                f"{key}={k} with rollout.agent.loop={self.agent.loop!r}: tool-response tokens have no engine "
                f"distribution; set {key}=0 or rollout.agent.loop=single_turn"
            )
        limit = self.vllm.get("max_logprobs", VLLM_MAX_LOGPROBS)  # -1: vLLM's "no cap"
        if self.name == "vllm" and limit != -1 and k > limit:
            raise ValueError(
                f"{key}={k} exceeds vLLM's max_logprobs={limit}: lower {key} or set "
                f"rollout.vllm.max_logprobs to at least {k}"
            )

    def max_new_tokens(self, sampling: SamplingConfig) -> int:
        """New tokens to generate under `sampling` (its own limit, else response_length)."""
        return sampling.max_new_tokens or self.response_length
