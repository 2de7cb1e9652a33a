"""Recipe loading and validation: typed overrides, and one test per validation error (no Ray)."""

import ast
import importlib
import sys
import typing
from pathlib import Path

import pytest
import yaml

from hybridflow.checks.recipe import RecipeError, validate_recipe
from hybridflow.config.loader import load_recipe, write_resolved_recipe
from hybridflow.config.schema import RecipeConfig
from hybridflow.utils.tiny_model import make_tiny_model

# the shipped recipes' relative paths exist, as after `make quickstart` (tests/working_tree.py)
pytestmark = pytest.mark.usefixtures("in_quickstart_working_tree")

ROOT = Path(__file__).resolve().parents[1]
PPO = ROOT / "recipes/gsm8k_ppo.yaml"
GRPO = ROOT / "recipes/gsm8k_grpo.yaml"
QWEN3 = ROOT / "recipes/qwen3_grpo.yaml"
QWEN3_MOE = ROOT / "recipes/qwen3_moe_grpo.yaml"


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> dict:
    """A tiny model directory and (empty but real) parquet files to point recipes at."""
    root = tmp_path_factory.mktemp("local")
    model = make_tiny_model(root / "tiny")
    # the MoE recipe's EP 8 splits 8 experts
    moe = make_tiny_model(root / "tiny_moe", arch="qwen3_moe", num_experts=8)
    for name in ("train", "test"):
        (root / f"{name}.parquet").write_bytes(b"")
    files = {"train": str(root / "train.parquet"), "test": str(root / "test.parquet")}
    return {"model": str(model), "moe": str(moe), **files}


def cpu_overrides(local: dict, **extra) -> list[str]:
    """Point a GPU recipe at local files and 2 CPU processes (TP 2 -> DP 1)."""
    base = {
        "model.path": local["model"],
        "data.train_files": f"[{local['train']}]",
        "data.val_files": f"[{local['test']}]",
        "trainer.use_gpu": "false",
        "trainer.n_gpus_per_node": "2",
        "rollout.name": "hf",
        "rollout.tensor_model_parallel_size": "1",
        "data.max_prompt_length": "256",  # prompt + response fit the tiny model's 512 positions
        "rollout.response_length": "256",
    }
    base.update({k.replace("__", "."): v for k, v in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]


def load_valid(recipe: Path, local: dict, *overrides: str) -> RecipeConfig:
    cfg = load_recipe(recipe, [*cpu_overrides(local), *overrides])
    validate_recipe(cfg, cuda_available=False)
    return cfg


def invalid(recipe: Path, local: dict, *overrides: str, cuda_available: bool = False) -> str:
    cfg = load_recipe(recipe, [*cpu_overrides(local), *overrides])
    with pytest.raises(RecipeError) as err:
        validate_recipe(cfg, cuda_available=cuda_available)
    return str(err.value)


def test_both_recipes_state_the_gpu_setup(local):
    for recipe in (PPO, GRPO):
        cfg = load_recipe(recipe)
        assert cfg.actor.megatron.tensor_model_parallel_size == 2
        assert cfg.actor.megatron.params_dtype == "bfloat16"
        assert (cfg.rollout.name, cfg.rollout.dtype) == ("sglang", "bfloat16")
        assert (cfg.trainer.n_gpus_per_node, cfg.trainer.use_gpu) == (8, True)
    assert load_recipe(PPO).algorithm.adv_estimator == "gae" and load_recipe(PPO).critic.enable
    assert load_recipe(GRPO).algorithm.adv_estimator == "grpo" and not load_recipe(GRPO).critic.enable


def test_lora_recipe_is_the_grpo_recipe_with_adapters_and_validates_on_eight_devices(local):
    lora, full = load_recipe(ROOT / "recipes/gsm8k_grpo_lora.yaml"), load_recipe(GRPO)
    assert (lora.actor.lora.rank, lora.actor.lora.alpha) == (32, 64)
    assert len(lora.actor.lora.target_modules) == 4 and lora.actor.optim.lr > full.actor.optim.lr
    assert lora.actor.update.use_kl_loss and lora.trainer.output_dir != full.trainer.output_dir
    local_files = [f"model.path={local['model']}", f"data.train_files=[{local['train']}]"]
    local_files += ["data.max_prompt_length=256", "rollout.response_length=256"]  # 512 positions
    hf_rollout = ["rollout.name=hf", "rollout.tensor_model_parallel_size=1"]  # no sglang here
    overrides = [*local_files, f"data.val_files=[{local['test']}]", *hf_rollout]
    cfg = load_recipe(ROOT / "recipes/gsm8k_grpo_lora.yaml", overrides)
    assert validate_recipe(cfg, cuda_available=True).actor_devices == 8


def test_qwen3_recipes_state_the_gpu_setup_and_validate_on_eight_devices(local):
    dense, moe = load_recipe(QWEN3), load_recipe(QWEN3_MOE)
    assert dense.actor.megatron.tensor_model_parallel_size == 2
    megatron = moe.actor.megatron
    assert (megatron.tensor_model_parallel_size, megatron.expert_model_parallel_size) == (1, 8)
    assert (megatron.moe_token_dispatcher_type, megatron.moe_aux_loss_coeff) == ("alltoall", 0.001)
    for recipe, model in ((QWEN3, local["model"]), (QWEN3_MOE, local["moe"])):
        cfg = load_recipe(recipe)
        assert (cfg.trainer.n_gpus_per_node, cfg.rollout.name) == (8, "sglang")
        local_files = [f"model.path={model}", f"data.train_files=[{local['train']}]"]
        local_files += ["data.max_prompt_length=256", "rollout.response_length=256"]  # 512 positions
        hf_rollout = [
            "rollout.name=hf",
            "rollout.tensor_model_parallel_size=1",
        ]  # sglang is not installed here
        cfg = load_recipe(recipe, [*local_files, f"data.val_files=[{local['test']}]", *hf_rollout])
        assert validate_recipe(cfg, cuda_available=True).actor_devices == 8


def test_expert_parallelism_must_fit_the_devices(local):
    moe = f"model.path={local['moe']}"
    message = invalid(QWEN3_MOE, local, moe)  # EP 8 on the 2 CPU processes of cpu_overrides
    assert "actor.megatron: expert TP × EP × PP = 1×8×1 does not divide the 2 devices" in message
    load_valid(QWEN3_MOE, local, moe, "actor.megatron.expert_model_parallel_size=2")
    with pytest.raises(ValueError) as err:  # a Literal: the loader rejects it
        load_recipe(QWEN3_MOE, [*cpu_overrides(local), moe, "actor.megatron.moe_token_dispatcher_type=flex"])
    assert "actor.megatron.moe_token_dispatcher_type='flex' is not one of ['allgather', 'alltoall']" in str(
        err.value
    )


def test_overrides_parse_lists_booleans_numbers_and_keep_defaults(local):
    cfg = load_valid(
        GRPO, local, "trainer.logger=[console,tensorboard]", "data.shuffle=false", "actor.optim.lr=3e-6"
    )
    assert cfg.trainer.logger == ["console", "tensorboard"]
    assert cfg.data.shuffle is False
    assert cfg.actor.optim.lr == 3e-6
    assert cfg.data.train_files == [local["train"]]
    assert cfg.actor.optim.adam_beta1 == 0.9  # not stated anywhere: the schema default
    assert cfg.algorithm.kl_ctrl.type == "fixed"


def test_resolved_recipe_round_trips(local, tmp_path):
    cfg = load_valid(PPO, local, "trainer.total_training_steps=7")
    path = write_resolved_recipe(cfg, tmp_path)
    written = yaml.safe_load(path.read_text())
    assert written["trainer"]["total_training_steps"] == 7
    assert written["actor"]["optim"]["adam_beta2"] == 0.999  # defaults are written out too
    assert load_recipe(path) == cfg


def test_unknown_key_suggests_the_nearest(local, tmp_path):
    with pytest.raises(
        ValueError, match=r"unknown key 'actor.optim.weight_decy'.*did you mean 'actor.optim.weight_decay'"
    ) as e:
        load_recipe(GRPO, ["actor.optim.weight_decy=0.1"])
    assert "command-line override" in str(e.value)
    with pytest.raises(
        ValueError, match=r"'actor.optim.learning_rate'; valid keys under 'actor.optim': \['optimizer', 'lr'"
    ):
        load_recipe(GRPO, ["actor.optim.learning_rate=1"])
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("trainer:\n  n_gpu_per_node: 2\n")
    with pytest.raises(
        ValueError, match=rf"{recipe}: unknown key 'trainer.n_gpu_per_node'.*'trainer.n_gpus_per_node'"
    ):
        load_recipe(recipe)


def test_wrong_type_names_the_key_and_expected_type():
    with pytest.raises(TypeError, match=r"data.train_batch_size.*'many'.*expected int"):
        load_recipe(GRPO, ["data.train_batch_size=many"])
    with pytest.raises(TypeError, match=r"trainer.use_gpu.*expected bool"):
        load_recipe(GRPO, ["trainer.use_gpu=maybe"])


def test_malformed_override_and_missing_required_key(tmp_path):
    with pytest.raises(ValueError, match=r"key\.path=value"):
        load_recipe(GRPO, ["data.shuffle"])
    recipe = tmp_path / "empty.yaml"
    recipe.write_text("{}\n")
    with pytest.raises(ValueError, match=r"model\.path is required"):
        load_recipe(recipe)
    with pytest.raises(FileNotFoundError, match=r"nope\.yaml"):
        load_recipe(tmp_path / "nope.yaml")


def test_choice_values_are_literal_types_that_suggest_the_nearest():
    with pytest.raises(ValueError, match=r"trainer.logger\[1\]='tensorbord' is not one of .*'tensorboard'"):
        load_recipe(GRPO, ["trainer.logger=[console,tensorbord]"])


def test_an_unknown_estimator_is_refused_suggesting_the_nearest(local):
    # a registered name or a dotted path to one's own: refused by the recipe check, not the loader
    message = invalid(GRPO, local, "algorithm.adv_estimator=rlooo")
    assert "unknown advantage estimator 'rlooo' (algorithm.adv_estimator)" in message
    assert "did you mean 'rloo'?" in message


def test_gae_without_a_critic(local):
    message = invalid(PPO, local, "critic.enable=false")
    assert "algorithm.adv_estimator=gae needs a critic: set critic.enable=true" in message


def test_group_estimator_needs_several_samples(local):
    assert "set rollout.sampling.n >= 2" in invalid(GRPO, local, "rollout.sampling.n=1")


def test_batch_sizes_must_split_over_data_parallel_ranks(local):
    # 4 processes, TP 2 -> DP 2; 3 prompts x 1 response cannot split in two
    message = invalid(
        PPO,
        local,
        "trainer.n_gpus_per_node=4",
        "data.train_batch_size=3",
        "actor.update.ppo_mini_batch_size=3",
        "critic.update.ppo_mini_batch_size=3",
    )
    assert "= 3 responses do not split over the 2 data-parallel ranks" in message
    assert "actor.update.ppo_mini_batch_size=3 does not split over the 2 data-parallel ranks" in message
    assert "critic.update.ppo_mini_batch_size=3 does not split" in message
    message = invalid(PPO, local, "data.train_batch_size=8", "actor.update.ppo_mini_batch_size=3")
    assert "actor.update.ppo_mini_batch_size=3 sequences does not divide the 8 responses" in message
    message = invalid(
        GRPO,
        local,
        "data.train_batch_size=4",
        "rollout.sampling.n=3",
        "actor.update.ppo_mini_batch_size=6",
        "actor.update.ppo_micro_batch_size=4",
    )
    assert "actor.update.ppo_micro_batch_size=4 does not divide the 6 sequences" in message


def test_parallel_sizes_must_match_the_devices(local):
    message = invalid(GRPO, local, "trainer.n_gpus_per_node=3")
    assert "actor.megatron: TP × PP × CP = 2×1×1 = 2 does not divide the 3 devices" in message
    message = invalid(PPO, local, "critic.megatron.tensor_model_parallel_size=1")
    assert "critic.megatron parallel sizes (1, 1, 1) differ from actor.megatron's (2, 1, 1)" in message
    layout = validate_recipe(
        load_recipe(
            GRPO,
            cpu_overrides(
                local,
                trainer__n_gpus_per_node="8",
                data__train_batch_size="16",
                actor__update__ppo_mini_batch_size="64",
            ),
        ),
        cuda_available=False,
    )
    assert (layout.actor_devices, layout.actor_dp) == (8, 4)


def test_sglang_needs_cuda_and_an_install(local):
    message = invalid(GRPO, local, "rollout.name=sglang", "rollout.tensor_model_parallel_size=2")
    assert "rollout.name=sglang needs CUDA GPUs" in message
    assert "trainer.use_gpu=true but CUDA is not available here; set trainer.use_gpu=false" in invalid(
        GRPO, local, "trainer.use_gpu=true"
    )
    message = invalid(
        GRPO,
        local,
        "rollout.name=sglang",
        "rollout.tensor_model_parallel_size=2",
        "trainer.use_gpu=true",
        cuda_available=True,
    )
    assert "sglang is not installed" in message


def test_paths_must_exist(local, tmp_path):
    message = invalid(
        GRPO, local, f"model.path={tmp_path}/missing_model", f"data.train_files=[{tmp_path}/x.parquet]"
    )
    assert f"model.path={tmp_path}/missing_model is not a Hugging Face model directory" in message
    assert f"data.train_files has {tmp_path}/x.parquet, which does not exist" in message


def test_validation_needs_val_files_and_a_custom_reward_must_import(local):
    assert "data.val_files is empty" in invalid(GRPO, local, "data.val_files=[]", "trainer.test_freq=1")
    assert "reward.custom_fn='nowhere.fn' cannot be imported" in invalid(
        GRPO, local, "reward.custom_fn=nowhere.fn"
    )


def test_remax_needs_a_greedy_baseline_and_sft_mode_skips_the_rl_checks(local):
    message = invalid(
        GRPO,
        local,
        "algorithm.adv_estimator=remax",
        "rollout.val_sampling.do_sample=true",
        "rollout.val_sampling.temperature=1.0",
    )
    assert "set rollout.val_sampling.do_sample=false" in message
    load_valid(GRPO, local, "algorithm.adv_estimator=remax")
    # SFT: no sampling groups needed; a batch must split into micro-batches on each DP rank
    load_valid(
        GRPO,
        local,
        "trainer.mode=sft",
        "rollout.sampling.n=1",
        "data.train_batch_size=4",
        "actor.update.ppo_micro_batch_size=2",
    )
    message = invalid(
        GRPO, local, "trainer.mode=sft", "data.train_batch_size=6", "actor.update.ppo_micro_batch_size=4"
    )
    assert "actor.update.ppo_micro_batch_size=4 does not divide the 6 rows" in message


def test_forward_micro_batches_must_divide_each_ranks_rows(local):
    # GRPO: 4 prompts x 2 responses over DP 1 = 8 rows per rank
    message = invalid(
        GRPO,
        local,
        "data.train_batch_size=4",
        "rollout.sampling.n=2",
        "actor.update.ppo_mini_batch_size=8",
        "actor.update.ppo_micro_batch_size=2",
        "actor.log_prob_micro_batch_size=3",
        "ref.log_prob_micro_batch_size=8",
    )
    assert "actor.log_prob_micro_batch_size=3 does not divide the 8 responses" in message
    assert "ref.log_prob_micro_batch_size" not in message


def engine_validators() -> list:
    """Every `validate_*` function in engines/ and every `__post_init__` of an engine config class,
    found by reading the source (so a validator added later is walked too)."""
    found = []
    for path in sorted((ROOT / "engines").rglob("*.py")):
        module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("validate_"):
                found.append(getattr(module, node.name))
            elif isinstance(node, ast.ClassDef):
                found += [
                    getattr(module, node.name).__post_init__
                    for item in node.body
                    if isinstance(item, ast.FunctionDef) and item.name == "__post_init__"
                ]
    return found


def test_every_engine_validator_runs_in_validate_recipe(local):
    validators = {f"{fn.__module__}.{fn.__qualname__}": fn for fn in engine_validators()}
    assert {
        "engines.megatron.checks.validate_actor_update_config",
        "engines.rollout.config.RolloutConfig.__post_init__",
    } <= set(validators)
    cfg = load_valid(
        PPO, local, "reward_model.enable=true", f"reward_model.path={local['model']}",
        "reward_model.megatron.tensor_model_parallel_size=2",
    )  # fmt: skip
    called = set()
    sys.setprofile(lambda frame, event, arg: called.add(frame.f_code) if event == "call" else None)
    try:
        validate_recipe(cfg, cuda_available=False)
    finally:
        sys.setprofile(None)
    assert [name for name, fn in validators.items() if fn.__code__ not in called] == []


def test_engine_checks_accept_exactly_the_schema_choices():
    """The engines still check values given to them directly (not through a recipe); their lists
    must be the schema's Literal values."""
    from engines.megatron.checks import LR_DECAY_STYLES
    from engines.megatron.config import LrDecayStyle, ParamsDtype
    from engines.megatron.model import DTYPES

    assert set(DTYPES) == set(typing.get_args(ParamsDtype))
    assert set(LR_DECAY_STYLES) == set(typing.get_args(LrDecayStyle))


def test_token_budgets_in_use_must_fit_the_longest_sequence(local):
    # cpu_overrides: max_prompt_length 256 + response_length 256 = 512 tokens
    message = invalid(
        PPO,
        local,
        "actor.update.use_dynamic_bsz=true",
        "actor.update.max_token_len_per_gpu=500",
        "critic.update.use_dynamic_bsz=false",
        "critic.forward_max_token_len_per_gpu=10",
    )
    assert "actor.update.max_token_len_per_gpu=500 is below the longest sequence" in message
    assert "512 tokens" in message and "critic.forward_max_token_len_per_gpu" not in message
    load_valid(PPO, local, "actor.update.use_dynamic_bsz=false", "actor.update.max_token_len_per_gpu=10")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rollout.name=vllm", "rollout.vllm.max_model_len=384"],
            "rollout.vllm.max_model_len=384 is below the longest sequence the engine serves, "
            "data.max_prompt_length=256 + rollout.response_length=256 = 512 tokens",
        ),
        (
            ["rollout.name=vllm", "data.max_prompt_length=100", "rollout.vllm.max_model_len=1024"],
            "rollout.vllm.max_model_len=1024 exceeds max_position_embeddings=512 of the model in",
        ),
    ],
)
def test_the_engine_context_length_must_hold_prompt_and_response(local, overrides, message):
    """vLLM refuses a longer request (or cuts its response short) only after the workers started."""
    assert message in invalid(GRPO, local, *overrides)


def test_an_engine_context_length_that_is_no_number_is_refused_when_the_recipe_loads(local):
    """Checked against the kind of value vLLM's EngineArgs.max_model_len takes, with every other
    rollout.vllm value (tests/rollout/test_vllm_engine_arg_kinds.py)."""
    overrides = [*cpu_overrides(local), "rollout.name=vllm", "rollout.vllm.max_model_len=big"]
    with pytest.raises(
        ValueError, match=r"rollout\.vllm\.max_model_len='big' is a str, but vLLM \S+ EngineArgs"
    ):
        load_recipe(GRPO, overrides)


def test_an_agent_loop_budget_is_named_in_the_context_length_refusal(local):
    tool = ["rollout.agent.loop=tool", "rollout.agent.tools=[hybridflow.agents.tools.calculator.Calculator]"]
    message = invalid(GRPO, local, "rollout.name=vllm", "rollout.vllm.max_model_len=300", *tool)
    assert "(rollout.agent.loop=tool: every turn, tool responses included, fits in the response)" in message
    load_valid(GRPO, local, "rollout.name=vllm", "rollout.vllm.max_model_len=512", *tool)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor.lora.alpha=32", "actor.lora.alpha=32.0 has no effect with actor.lora.rank=0"),
        (
            "actor.lora.target_modules=[linear_qkv]",
            "actor.lora.target_modules=['linear_qkv'] has no effect with actor.lora.rank=0",
        ),
        ("actor.lora.dropout=0.1", "actor.lora.dropout=0.1 has no effect with actor.lora.rank=0"),
    ],
)
def test_lora_settings_without_adapters_are_refused(local, override, message):
    """A LoRA setting with rank 0 (full fine-tuning) is ignored: refused like any ignored setting."""
    error = invalid(GRPO, local, override)
    assert message in error and "set actor.lora.rank > 0 to train adapters, or remove it" in error


def test_a_lora_rank_beyond_the_layers_it_adapts_is_warned_about(local, caplog):
    """The tiny model's k_proj and v_proj are 64 x 128: a rank-64 adapter has 12288 parameters, more
    than their 8192. Legal (a smoke test may reuse a large model's rank), so a warning."""
    qkv = "actor.lora.target_modules=[linear_qkv]"
    load_valid(GRPO, local, "actor.lora.rank=16", qkv)
    assert "actor.lora.rank" not in caplog.text
    load_valid(GRPO, local, "actor.lora.rank=64", qkv)
    assert (
        "actor.lora.rank=64 gives self_attn.k_proj, self_attn.v_proj (64 x 128) adapters with more "
        "parameters than the layers themselves" in caplog.text
    )
    assert "lower actor.lora.rank to 42 or less" in caplog.text


def test_a_cpu_kv_cache_too_small_for_one_sequence_is_refused_before_vllm_starts(local, monkeypatch):
    """The tiny model: 4 layers x 2 KV heads x 32 x 2 (K, V) x 4 bytes (float32) = 2048 bytes a token,
    so its 512 positions need 1 MiB. vLLM's own error names gpu_memory_utilization, not the CPU key."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    vllm = ("rollout.name=vllm", "rollout.dtype=float32")
    message = invalid(GRPO, local, *vllm, "rollout.vllm.kv_cache_memory_bytes=524288")
    assert (
        "rollout.vllm.kv_cache_memory_bytes=524288 (512.0 KiB) holds 256 tokens of the model in "
        f"{local['model']} (4 layers x 2 KV heads x 32 x 2 (K, V) x 4 bytes of float32 = 2048 bytes a "
        "token), fewer than the 512 of rollout.vllm.max_model_len (unset: max_position_embeddings)"
    ) in message
    assert "raise rollout.vllm.kv_cache_memory_bytes to at least 1048576" in message
    load_valid(GRPO, local, *vllm, "rollout.vllm.kv_cache_memory_bytes=1048576")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")  # vLLM's legacy GiB setting, which wins
    assert "VLLM_CPU_KVCACHE_SPACE=0 (0 B) holds 0 tokens" in invalid(GRPO, local, *vllm)


def test_what_vllm_on_cpu_cannot_do_is_refused_before_it_starts(local, tmp_path):
    """Found by the engine only in the workers before: a head size its CPU attention lacks, and
    chunked prefill with seeded requests."""
    narrow = make_tiny_model(tmp_path / "narrow", hidden_size=64)  # 4 heads of 16
    message = invalid(GRPO, {**local, "model": str(narrow)}, "rollout.name=vllm")
    assert "rollout.name=vllm on CPU: the model's head size 16" in message
    message = invalid(GRPO, local, "rollout.name=vllm", "rollout.vllm.enable_chunked_prefill=true")
    assert "rollout.vllm.enable_chunked_prefill=true fails on CPU with seeded requests" in message
    cfg = load_recipe(
        GRPO, [*cpu_overrides(local), "rollout.name=vllm", "rollout.vllm.enable_chunked_prefill=true"]
    )
    cfg.trainer.use_gpu = True
    validate_recipe(cfg, cuda_available=True)  # CUDA takes it


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.top_k_log_probs=-1"], "rollout.top_k_log_probs must be an int >= 0 (0: off), got -1"),
        (
            ["rollout.top_k_log_probs=3", "rollout.calculate_log_probs=false"],
            "rollout.top_k_log_probs=3 needs the engine's log-probs: set rollout.calculate_log_probs=true",
        ),
        (
            ["rollout.top_k_log_probs=3", "rollout.name=sglang"],
            "rollout.top_k_log_probs=3 with rollout.name='sglang': only the hf and vllm engines return the "
            "top K; use one of them or set rollout.top_k_log_probs=0",
        ),
        (
            [
                "rollout.top_k_log_probs=3",
                "rollout.name=vllm",
                "rollout.agent.loop=tool",
                "rollout.agent.tools=[hybridflow.agents.tools.calculator.Calculator]",
            ],
            "rollout.top_k_log_probs=3 with rollout.agent.loop='tool': tool-response tokens have no engine "
            "distribution; set rollout.top_k_log_probs=0 or rollout.agent.loop=single_turn",
        ),
        (
            ["rollout.top_k_log_probs=21", "rollout.name=vllm"],
            "rollout.top_k_log_probs=21 exceeds vLLM's max_logprobs=20: lower rollout.top_k_log_probs or "
            "set rollout.vllm.max_logprobs to at least 21",
        ),
    ],
    ids=["negative", "no-log-probs", "sglang", "agent-loop", "vllm-max-logprobs"],
)
def test_top_k_log_probs_an_engine_cannot_return_are_refused_when_the_recipe_loads(local, overrides, message):
    with pytest.raises(ValueError) as err:
        load_recipe(GRPO, [*cpu_overrides(local), *overrides])
    assert message in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        (
            "trainer.placement=disaggregated",
            "trainer.rollout_pool.n_gpus_per_node=1",
            "trainer.async_training.mode=async",
            "trainer.async_training.max_staleness=2",
            "trainer.async_training.partial_rollout=true",
        ),
        ("trainer.async_training.mode=stream",),
    ],
    ids=["partial-rollout", "stream"],
)
def test_top_k_log_probs_with_request_level_generation_are_refused(local, overrides):
    """Partial rollouts and mode=stream generate through requests, which do not return them yet."""
    setting = overrides[-1].removeprefix("trainer.async_training.")
    message = invalid(GRPO, local, "rollout.top_k_log_probs=3", "rollout.name=vllm", *overrides)
    assert (
        f"rollout.top_k_log_probs=3 with trainer.async_training.{setting}: request-level generation does not "
        "return the top-K log-probs yet; set rollout.top_k_log_probs=0"
    ) in message


def test_top_k_log_probs_within_what_the_engine_returns_are_accepted(local):
    load_valid(GRPO, local, "rollout.top_k_log_probs=3")
    load_valid(GRPO, local, "rollout.top_k_log_probs=21", "rollout.name=vllm", "rollout.vllm.max_logprobs=32")
    load_valid(GRPO, local, "rollout.top_k_log_probs=21", "rollout.name=vllm", "rollout.vllm.max_logprobs=-1")
