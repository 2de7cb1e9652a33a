#!/usr/bin/env bash
# Run a recipe: bash scripts/run_recipe.sh <recipe.yaml> [key.path=value ...]
#
# Joins the Ray cluster named by RAY_ADDRESS (or one already running here; RAY_ADDRESS=local
# starts a fresh one), otherwise starts a local cluster sized to the machine. Exits non-zero with
# the error when the recipe is invalid or the run fails.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
  sed -n '2,6p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  [[ $# -ge 1 ]] && exit 0 || exit 2
fi
PYTHON="$ROOT/.venv/bin/python"
[[ -x "$PYTHON" ]] || PYTHON=python3
# Ray workers import hybridflow from the checkout, whatever directory the run starts in.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
exec "$PYTHON" -m hybridflow.trainer.main "$@"
