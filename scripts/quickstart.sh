#!/usr/bin/env bash
# Quickstart (what `make quickstart` runs): on 2 CPU processes, from nothing to a model that
# visibly learns, in about 10 minutes on 2 cores.
#   1. a tiny random Qwen2-shaped model and two-digit addition data (train / held-out test)
#   2. SFT warm start through the Megatron actor (recipes/quickstart_sft.yaml)
#   3. GRPO through the same actor, hf rollout and GSM8K rule reward (recipes/quickstart.yaml)
# then prints held-out accuracy before and after RL, time per stage and where the plots are.
#
# usage: bash scripts/quickstart.sh [--ppo] [--engine hf|vllm] [--fresh]
#   --ppo          PPO with a critic (GAE) instead of GRPO
#   --engine NAME  the RL stage's rollout engine (default: the recipe's; README has both timings)
#   --fresh        delete outputs/quickstart first; otherwise finished stages are kept and an
#                  interrupted RL stage resumes from its last checkpoint
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
[[ -x "$PY" ]] || PY=python3
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# A fresh Ray instance for this run, not one another job left running on the machine.
export RAY_ADDRESS="${RAY_ADDRESS:-local}"

OUT=outputs/quickstart
RL_NAME=grpo
RL_ARGS=()
while (( $# )); do
  case "$1" in
    --ppo) RL_NAME=ppo; RL_ARGS+=(algorithm.adv_estimator=gae critic.enable=true
                                  trainer.experiment_name=quickstart-ppo trainer.output_dir="$OUT/ppo") ;;
    --engine)
      [[ "${2:-}" == hf || "${2:-}" == vllm ]] || { echo "--engine takes hf or vllm, got '${2:-}'" >&2; exit 2; }
      RL_ARGS+=(rollout.name="$2"); shift ;;
    --fresh) rm -rf "$OUT" ;;
    -h|--help) sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

# Each stage runs as a job of its own (set -m: its own process group, and SIGINT not ignored as
# it is for a background job without job control) while this script waits for it, so that SIGINT
# and SIGTERM sent to the script reach the stage once, through the traps below, and the script
# exits only after the stage's own teardown (run_recipe.sh stops everything its driver started).
set -m
stage_pid=""
forward() { [[ -z "$stage_pid" ]] || kill "-$1" "$stage_pid" 2>/dev/null || true; }
trap 'forward INT' INT
trap 'forward TERM' TERM
declare -A SECONDS_FOR
stage() {  # stage <name> <command...>: runs the command and records its wall time
  local name="$1" start status
  shift
  echo "== $name"
  start=$(date +%s)
  "$@" &
  stage_pid=$!
  while true; do
    wait "$stage_pid" && status=0 || status=$?
    kill -0 "$stage_pid" 2>/dev/null || break # wait also returns when a trapped signal arrives
  done
  stage_pid=""
  (( status == 0 )) || exit "$status"
  SECONDS_FOR[$name]=$(( $(date +%s) - start ))
}

stage data "$PY" -c "
from hybridflow.utils.tiny_model import make_tiny_model
from hybridflow.data.arith import write_arith_parquet
make_tiny_model('$OUT/tiny_model')
print('tiny model:', '$OUT/tiny_model')
for split, path in write_arith_parquet('$OUT/data').items():
    print(f'{split}:', path)
"

if [[ -f "$OUT/sft/hf/config.json" ]]; then
  echo "== sft: $OUT/sft/hf exists, skipped (--fresh to redo)"
  SECONDS_FOR[sft]=0
else
  stage sft bash scripts/run_recipe.sh recipes/quickstart_sft.yaml
fi
stage "$RL_NAME" bash scripts/run_recipe.sh recipes/quickstart.yaml "${RL_ARGS[@]}"

"$PY" - "$OUT" "$RL_NAME" "${SECONDS_FOR[data]}" "${SECONDS_FOR[sft]}" "${SECONDS_FOR[$RL_NAME]}" <<'EOF'
import sys

from hybridflow.utils.tracking import read_metrics

out, rl, *seconds = sys.argv[1:]
acc = [(r["step"], r["val/accuracy"]) for r in read_metrics(f"{out}/{rl}/metrics.jsonl") if "val/accuracy" in r]
(first_step, first), (last_step, last) = acc[0], acc[-1]
print(f"\nheld-out accuracy (greedy, {out}/data/test.parquet):")
print(f"  {f'SFT warm start (RL step {first_step})':<28} {first:6.1%}")
print(f"  {f'after {rl.upper()} (RL step {last_step})':<28} {last:6.1%}   ({100 * (last - first):+.1f} points)")
print("time per stage: " + ", ".join(f"{name} {s}s" for name, s in zip(("data", "sft", rl), seconds)))
print(f"plots: {out}/sft/plots/ and {out}/{rl}/plots/ (reward.png, val_accuracy.png, ...)")
print(f"final policy (Hugging Face format): {out}/{rl}/hf")
EOF
