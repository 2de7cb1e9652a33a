"""D8: the CUDA/NCCL settings of Megatron worker processes (engines/process_env.py), decided from
the recipe and the environment, so that every rank of one Megatron group starts with the same
values, the ranks that will build an SGLang engine included."""

import pytest

from engines.process_env import differing_env, process_env, sglang_nccl_env


def test_megatron_ranks_get_one_device_connection():
    assert process_env("hf", {}, {}) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert process_env("hf", {}, {"CUDA_DEVICE_MAX_CONNECTIONS": "2"}) == {}  # exported: kept


def test_with_sglang_every_rank_gets_what_sglang_sets_in_the_engine_rank():
    assert process_env("sglang", {}, {}) == {
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "NCCL_CUMEM_ENABLE": "0",
        "NCCL_NVLS_ENABLE": "0",
    }
    exported = {"NCCL_CUMEM_ENABLE": "1", "NCCL_NVLS_ENABLE": "1"}
    assert sglang_nccl_env({}, exported) == {}  # SGLang keeps exported values: so does every rank
    assert sglang_nccl_env({"enable_symm_mem": True}, exported) == {
        "NCCL_CUMEM_ENABLE": "1",
        "NCCL_NVLS_ENABLE": "1",
    }
    assert sglang_nccl_env({"enable_nccl_nvls": True}, {}) == {
        "NCCL_CUMEM_ENABLE": "0",
        "NCCL_NVLS_ENABLE": "1",
    }
    assert sglang_nccl_env({"dcp_size": 2}, {})["NCCL_GRAPH_MIXING_SUPPORT"] == "0"


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([{"A": "1"}, {"A": "1"}], {}),
        ([{"A": "1", "B": None}, {"A": "0", "B": None}], {"A": ["1", "0"]}),
        ([{"A": "1"}, {}], {"A": ["1", None]}),
    ],
)
def test_differing_settings_are_named_with_each_ranks_value(values, expected):
    assert differing_env(values) == expected
