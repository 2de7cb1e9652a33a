#!/usr/bin/env bash
# Run a recipe: bash scripts/run_recipe.sh <recipe.yaml> [key.path=value ...]
#
# Joins the Ray cluster named by RAY_ADDRESS (or one already running here; RAY_ADDRESS=local
# starts a fresh one), otherwise starts a local cluster sized to the machine. Exits non-zero with
# the error when the recipe is invalid or the run fails; 130 after Ctrl-C (SIGINT), 143 after SIGTERM.
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
# The driver runs in its own session, which holds everything it starts (a local Ray cluster with
# its agents, the workers, each in a process group of its own). SIGINT / SIGTERM are passed on to
# the driver; when it ends, however it ends (SIGKILL included), what is left of its session gets
# SIGTERM and, after HYBRIDFLOW_STOP_GRACE_S (default 10) seconds, SIGKILL (scripts/lib/session.sh).
# The script exits once the session is empty, or HYBRIDFLOW_STOP_GRACE_S seconds after the SIGKILL
# with the processes still running named on stderr.
source "$ROOT/scripts/lib/session.sh"
grace_s="${HYBRIDFLOW_STOP_GRACE_S:-10}"
setsid "$PYTHON" -m hybridflow.trainer.main "$@" & # no job control: setsid execs in place, $! is the driver
driver=$!
trap 'kill -INT "$driver" 2>/dev/null || true' INT
trap 'kill -TERM "$driver" 2>/dev/null || true' TERM
status=0
while true; do
  wait "$driver" && status=0 || status=$?
  kill -0 "$driver" 2>/dev/null || break # wait also returns when a trapped signal arrives
done
stop_session "$driver" "$grace_s" run_recipe.sh || true
exit "$status"
