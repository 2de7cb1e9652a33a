#!/usr/bin/env bash
# One-command GPU check: 3 GRPO steps of the Megatron actor (bf16, distributed optimizer) and the
# hf rollout on CUDA, in one process through LocalWorkerGroup, on a random Qwen2-0.5B-shaped
# model; prints tokens/s, the actor update's MFU and peak memory (scripts/gpu_check.py). With
# --vlm, the same for the tiny LLaVA on the shapes task (recipes/vlm_quickstart.yaml). With
# --parity, the suite's parity workers at TP1 on the GPU instead (scripts/gpu_parity.py).
#
#   bash scripts/gpu_check.sh --cpu                     # the same path on CPU, tiny model (CI runs it)
#   bash scripts/gpu_check.sh --wheels .whl             # on a CUDA machine with torch but no Ray/SGLang/TE
#   bash scripts/gpu_check.sh --wheels .whl --vlm       # the VLM path: images through rollout and update
#   bash scripts/gpu_check.sh --wheels .whl --parity    # Megatron-vs-transformers parity on that GPU
#   HYBRIDFLOW_GPU_CHECK_WHEELS=.whl bash scripts/gpu_check.sh --steps 5
#
# Needs Python with torch (CUDA build for the GPU run), transformers, safetensors, numpy, pyarrow,
# pyyaml and huggingface-hub, plus what a GPU image usually lacks: megatron-core and its small
# dependencies, installed here from a folder of wheels (--wheels DIR or HYBRIDFLOW_GPU_CHECK_WHEELS)
# into $HYBRIDFLOW_GPU_CHECK_SITE (default /tmp/hybridflow-gpu-check-site), never into the
# environment itself. Prepare that folder where pip can reach an index, for the GPU machine's
# Python (3.12 on this workplace's device machines):
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl megatron-core==0.16.1 omegaconf==2.4.0 tensordict==0.15.3 pyvers==0.2.3 transformers==5.19.0 \
#       jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
#
# (docs/gpu.md lists why each is needed.) PYTHON picks the interpreter (default python3).
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
wheels="${HYBRIDFLOW_GPU_CHECK_WHEELS:-}"
site="${HYBRIDFLOW_GPU_CHECK_SITE:-/tmp/hybridflow-gpu-check-site}"
args=()
script=gpu_check.py
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) [ $# -ge 2 ] || { echo "error: --wheels needs a folder" >&2; exit 2; }; wheels="$2"; shift 2 ;;
    --wheels=*) wheels="${1#--wheels=}"; shift ;;
    --parity) script=gpu_parity.py; shift ;;
    -h|--help) sed -n '2,27p' "$0"; exec "$python" "$repo/scripts/$script" --help ;;
    *) args+=("$1"); shift ;;
  esac
done

pythonpath="$repo"
if [ -n "$wheels" ]; then
  shopt -s nullglob
  found=("$wheels"/*.whl)
  [ ${#found[@]} -gt 0 ] || { echo "error: no .whl files in $wheels (see the header of $0)" >&2; exit 2; }
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "${found[@]}"
  pythonpath="$site:$repo"
fi
export PYTHONPATH="$pythonpath${PYTHONPATH:+:$PYTHONPATH}"

missing="$("$python" - <<'EOF'
import importlib.util
needed = ["torch", "megatron.core", "transformers", "omegaconf", "tensordict", "safetensors", "pyarrow", "yaml", "jsonschema"]
print(" ".join(name for name in needed if importlib.util.find_spec(name.split(".")[0]) is None))
EOF
)"
if [ -n "$missing" ]; then
  echo "error: $python cannot import: $missing; give a folder of wheels with --wheels (see the header of $0)" >&2
  exit 2
fi
exec "$python" "$repo/scripts/$script" ${args[@]+"${args[@]}"}
