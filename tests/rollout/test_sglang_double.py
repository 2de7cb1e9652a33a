"""The SGLang contract double follows sglang 0.5.23 where hybridflow's code depends on it (each
point cites the upstream file in tests/doubles/sglang/_double.py): what comes back from
`generate`, what a weight load does with an unknown name or a wrong shape, what a released and
resumed weight holds, when the engine's process tree is killed, what its unpickler accepts, and
what building an engine does to the caller's logging and environment."""

import logging
import os
import pickle
import threading
from pathlib import PurePosixPath

import pytest
import torch

GREEDY = {"max_new_tokens": 4, "temperature": 0.0}


@pytest.fixture
def engine(sglang_double, sglang_checkpoint):
    return sglang_double.Engine(
        model_path=str(sglang_checkpoint), tp_size=1, load_format="auto", enable_memory_saver=True
    )


def named_payloads(sglang_double, named: dict[str, torch.Tensor]) -> list:
    from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    return [
        (name, LocalSerializedTensor(values=[MultiprocessingSerializer.serialize(tensor)]))
        for name, tensor in named.items()
    ]


def load(engine, sglang_double, named: dict[str, torch.Tensor]):
    assert engine.begin_weight_update() == (True, "Success")
    result = engine.update_weights_from_tensor(named_payloads(sglang_double, named), flush_cache=True)
    engine.end_weight_update()
    return result


def test_output_ids_end_with_the_eos_and_carry_its_log_prob(engine):
    (free,) = engine.generate(input_ids=[[5, 6, 7]], sampling_params=GREEDY)
    eos = engine.model.config.eos_token_id = free["output_ids"][0]  # the first greedy token
    (out,) = engine.generate(input_ids=[[5, 6, 7]], sampling_params=GREEDY, return_logprob=True)
    assert out["output_ids"] == [eos]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert [entry[1] for entry in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]


def test_unknown_weight_names_are_skipped_with_a_warning(engine, sglang_double, caplog):
    embed = engine.params["model.embed_tokens.weight"]
    with caplog.at_level(logging.WARNING, logger="sglang"):
        result = load(
            engine,
            sglang_double,
            {"model.no_such.weight": torch.ones(2), "model.embed_tokens.weight": embed + 1},
        )
    assert result == (True, "Success")
    assert "Parameter model.no_such.weight not found in params_dict" in caplog.text
    assert torch.equal(engine.params["model.embed_tokens.weight"], embed)  # the known one loaded


def test_a_wrong_shape_kills_the_process_tree(engine, sglang_double):
    with pytest.raises(sglang_double._double.ProcessTreeKilled, match="Attempted to load weight"):
        load(engine, sglang_double, {"model.norm.weight": torch.ones(3)})
    with pytest.raises(sglang_double._double.ProcessTreeKilled):
        engine.flush_cache()


def test_released_weights_are_undefined_after_resume_until_reloaded(engine, sglang_double):
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    assert torch.isnan(engine.params["model.norm.weight"]).all()
    with pytest.raises(AssertionError, match="resumed without a CPU backup and not reloaded"):
        engine.generate(input_ids=[[5, 6]], sampling_params=GREEDY)


def test_weights_survive_release_with_a_cpu_backup(sglang_double, sglang_checkpoint):
    engine = sglang_double.Engine(
        model_path=str(sglang_checkpoint), enable_memory_saver=True, enable_weights_cpu_backup=True
    )
    norm = engine.params["model.norm.weight"].clone()
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    assert torch.equal(engine.params["model.norm.weight"], norm)
    engine.generate(input_ids=[[5, 6]], sampling_params=GREEDY)


def test_release_while_generating_kills_the_process_tree(engine, sglang_double):
    started, may_go_on = threading.Event(), threading.Event()
    forward = engine.model.forward

    def slow_forward(*args, **kwargs):
        started.set()
        may_go_on.wait()
        return forward(*args, **kwargs)

    engine.model.forward = slow_forward
    outcome = []

    def generate():
        try:
            engine.generate(input_ids=[[5, 6]], sampling_params=GREEDY)
        except BaseException as err:
            outcome.append(err)

    thread = threading.Thread(target=generate)
    thread.start()
    started.wait()
    try:
        with pytest.raises(sglang_double._double.ProcessTreeKilled, match="only when server is idle"):
            engine.release_memory_occupation(["kv_cache"])
    finally:
        may_go_on.set()
        thread.join()
    assert isinstance(outcome[0], sglang_double._double.ProcessTreeKilled)


def test_resuming_memory_that_was_not_released_kills_the_process_tree(engine, sglang_double):
    with pytest.raises(sglang_double._double.ProcessTreeKilled, match="KeyError"):
        engine.resume_memory_occupation(["weights"])


def test_the_unpickler_takes_only_allow_listed_globals(sglang_double):
    from sglang.srt.utils import MultiprocessingSerializer

    with pytest.raises(RuntimeError, match=r"Blocked unsafe global \(pathlib.*PosixPath\)"):
        MultiprocessingSerializer.deserialize(pickle.dumps(PurePosixPath("not/a/tensor")))
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    handle = MultiprocessingSerializer.deserialize(MultiprocessingSerializer.serialize(tensor))
    assert torch.equal(handle.value, tensor)


def test_building_an_engine_resets_the_callers_logging_and_writes_its_environment(
    sglang_double, sglang_checkpoint, monkeypatch
):
    for key in ("CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE"):
        monkeypatch.delenv(key, raising=False)
    marker = logging.NullHandler()
    logging.getLogger().addHandler(marker)
    sglang_double.Engine(model_path=str(sglang_checkpoint))
    root = logging.getLogger()
    assert marker not in root.handlers and root.level == logging.ERROR  # basicConfig(force=True), "error"
    assert (os.environ["CUDA_DEVICE_MAX_CONNECTIONS"], os.environ["NCCL_CUMEM_ENABLE"]) == ("8", "0")
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"


def test_sampling_seeds_must_be_int64(engine):
    with pytest.raises(ValueError, match=r"sampling_seed must be in \[-2\*\*63, 2\*\*63 - 1\]"):
        engine.generate(input_ids=[[5, 6]], sampling_params={**GREEDY, "sampling_seed": 2**63})
    engine.generate(input_ids=[[5, 6]], sampling_params={**GREEDY, "sampling_seed": 2**63 - 1})
