"""requirements-gpu.txt resolves to the SGLang runtime the GPU path is written against, and
requirements-gpu-vllm.txt to the CUDA vLLM the vllm engine is written against.

pip resolves the GPU pins from the package index without installing anything (`--dry-run
--report`, wheels only, metadata only) and the report must hold every pin exactly, sglang's CUDA
runtime (sglang-kernel, flashinfer-python) and Transformer Engine's prebuilt core. The looser pins
this replaces (`sglang>=0.5` beside the CPU torch and transformers) resolved to sglang 0.5.2, whose
runtime sits behind its `srt` extra, so nothing of it was installed. Transformer Engine's torch
extension is a source archive only; it is built after this install (README, "GPU machines") and
is therefore not part of this wheels-only resolution.
"""

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
GPU_PINS = REPO / "requirements-gpu.txt"
VLLM_GPU_PINS = REPO / "requirements-gpu-vllm.txt"
COMMON_PINS = REPO / "requirements-common.txt"
SGLANG_RUNTIME = ("sglang-kernel", "flashinfer-python")
DEFAULT_INDEX = "https://pypi.org/simple"
RESOLVE_TIMEOUT_S = 900


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _exact_pins(path: Path) -> dict[str, str]:
    """`name==version` lines of a pin file (extras dropped), by normalized name."""
    pins = {}
    for line in path.read_text().splitlines():
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==(\S+)", line.strip())
        if match:
            pins[_normalize(match.group(1))] = match.group(2)
    return pins


def _index_url() -> str:
    """The index pip would use first: an `index-url` from pip's configuration, else PyPI."""
    config = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
    ).stdout
    for line in config.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".index-url"):
            return value.strip().strip("'\"")
    return DEFAULT_INDEX


def _skip_unless_index_reachable() -> None:
    """Skip when the index cannot be reached at all; any HTTP answer counts as reachable, so that a
    missing package or version surfaces as pip's resolution failure instead."""
    url = f"{_index_url().rstrip('/')}/sglang/"
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=30).close()
    except urllib.error.HTTPError:
        return
    except (urllib.error.URLError, OSError) as err:
        pytest.skip(f"package index unreachable ({url}: {err}); cannot resolve requirements-gpu.txt")


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _resolve(pin_file: Path, report: Path) -> dict[str, dict]:
    """Resolved distributions of `pip install -r pin_file`, by normalized name."""
    _skip_unless_index_reachable()
    # A machine-wide constraint file (PIP_CONSTRAINT or pip.conf) would change the resolution;
    # the repository's pins alone must resolve.
    env = {**os.environ, "PIP_CONSTRAINT": os.devnull}
    cmd = [
        *(sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed"),
        *("--only-binary=:all:", "--progress-bar", "off", "--report", str(report)),
        *("-r", str(pin_file)),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=RESOLVE_TIMEOUT_S)
    if proc.returncode != 0:
        pytest.fail(
            f"pip could not resolve {pin_file.name} (exit {proc.returncode}):\n"
            f"--- stdout (tail) ---\n{_tail(proc.stdout)}\n--- stderr (tail) ---\n{_tail(proc.stderr)}"
        )
    installs = json.loads(report.read_text())["install"]
    return {_normalize(item["metadata"]["name"]): item["metadata"] for item in installs}


def _mismatched_pins(pin_file: Path, resolved: dict[str, dict]) -> dict[str, tuple]:
    """Pins whose resolved version is not exactly the pinned string (a local build such as torch
    2.14.1+cpu would also satisfy `==2.14.1`)."""
    pins = {**_exact_pins(COMMON_PINS), **_exact_pins(pin_file)}
    return {
        name: (version, resolved.get(name, {}).get("version"))
        for name, version in pins.items()
        if resolved.get(name, {}).get("version") != version
    }


@pytest.fixture(scope="module")
def resolved(tmp_path_factory) -> dict[str, dict]:
    return _resolve(GPU_PINS, tmp_path_factory.mktemp("gpu_pins") / "report.json")


def test_every_gpu_pin_resolves_exactly(resolved):
    pins = _exact_pins(GPU_PINS)
    for name in ("sglang", "torch", "transformers", "tokenizers", "transformer-engine"):
        assert name in pins, f"requirements-gpu.txt must pin {name}"
    mismatched = _mismatched_pins(GPU_PINS, resolved)
    assert not mismatched, f"pinned vs resolved: {mismatched}"


def test_every_vllm_gpu_pin_resolves_exactly_with_vllms_cuda_runtime(tmp_path):
    resolved = _resolve(VLLM_GPU_PINS, tmp_path / "report.json")
    pins = _exact_pins(VLLM_GPU_PINS)
    for name in ("vllm", "torch", "transformers", "tokenizers"):
        assert name in pins, f"requirements-gpu-vllm.txt must pin {name}"
    # torch 2.13.0 is also the CPU pin: where a local index serves its +cpu build (the development
    # machines do), pip prefers that build of the same version; a GPU machine gets the CUDA one.
    resolved["torch"]["version"] = resolved["torch"]["version"].removesuffix("+cpu")
    mismatched = _mismatched_pins(VLLM_GPU_PINS, resolved)
    assert not mismatched, f"pinned vs resolved: {mismatched}"
    assert "flashinfer-python" in resolved, "vllm resolved without its CUDA sampling kernels"


def test_sglang_runtime_is_resolved(resolved):
    missing = [name for name in SGLANG_RUNTIME if name not in resolved]
    assert not missing, (
        f"sglang {resolved['sglang']['version']} resolved without its runtime {missing}: "
        "these pins install an sglang that cannot start an engine"
    )


def test_transformer_engine_core_matches_its_pin(resolved):
    te_version = _exact_pins(GPU_PINS).get("transformer-engine")
    assert te_version, "requirements-gpu.txt must pin transformer-engine[core_cu13]==<version>"
    core = resolved.get("transformer-engine-cu13", {}).get("version")
    assert core == te_version, f"transformer-engine-cu13 resolved to {core}, expected {te_version}"
