#!/usr/bin/env bash
# Quickstart (what `make quickstart` runs): on 2 CPU processes, from nothing to a model that
# visibly learns, in about 10 minutes on 2 cores.
#   1. a tiny random Qwen2-shaped model and two-digit addition data (train / held-out test)
#   2. SFT warm start through the Megatron actor (recipes/quickstart_sft.yaml)
#   3. GRPO through the same actor, hf rollout and GSM8K rule reward (recipes/quickstart.yaml)
# then prints held-out accuracy before and after RL, time per stage and where the plots are.
# With --tools, the tool-use demo instead: three-digit multiplication, which the model cannot do
# in its head, with a calculator tool in vLLM agent loops (recipes/tool_demo*.yaml, docs/agents.md).
#
# usage: bash scripts/quickstart.sh [--tools] [--ppo] [--engine hf|vllm] [--fresh]
#   --tools        the tool-use demo (outputs/tool_demo; its rollout engine is vllm)
#   --ppo          PPO with a critic (GAE) instead of GRPO
#   --engine NAME  the RL stage's rollout engine (default: the recipe's; docs/engines.md compares them)
#   --fresh        delete the outputs first; otherwise finished stages are kept and an
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

TOOLS=0 PPO=0 FRESH=0 ENGINE=""
while (( $# )); do
  case "$1" in
    --tools) TOOLS=1 ;;
    --ppo) PPO=1 ;;
    --engine)
      [[ "${2:-}" == hf || "${2:-}" == vllm ]] || { echo "--engine takes hf or vllm, got '${2:-}'" >&2; exit 2; }
      ENGINE="$2"; shift ;;
    --fresh) FRESH=1 ;;
    -h|--help) sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if (( TOOLS )); then
  [[ "$ENGINE" != hf ]] || { echo "--tools needs --engine vllm (agent loops run on vLLM)" >&2; exit 2; }
  OUT=outputs/tool_demo SFT_RECIPE=recipes/tool_demo_sft.yaml RL_RECIPE=recipes/tool_demo.yaml
else
  OUT=outputs/quickstart SFT_RECIPE=recipes/quickstart_sft.yaml RL_RECIPE=recipes/quickstart.yaml
fi
(( FRESH )) && rm -rf "$OUT"
RL_NAME=grpo
RL_ARGS=()
if (( PPO )); then
  RL_NAME=ppo
  RL_ARGS+=(algorithm.adv_estimator=gae critic.enable=true
            trainer.experiment_name="$(basename "$OUT")-ppo" trainer.output_dir="$OUT/ppo")
fi
[[ -z "$ENGINE" ]] || RL_ARGS+=(rollout.name="$ENGINE")

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

if (( TOOLS )); then
  stage data "$PY" -c "
from transformers import AutoTokenizer
from hybridflow.data.tool_arith import TOOL_TOKENS, write_tool_arith_parquet
from hybridflow.utils.tiny_model import make_tiny_model
model = make_tiny_model('$OUT/tiny_model', added_tokens=TOOL_TOKENS)
print('tiny model:', model)
for split, path in write_tool_arith_parquet('$OUT/data', AutoTokenizer.from_pretrained(model)).items():
    print(f'{split}:', path)
"
else
  stage data "$PY" -c "
from hybridflow.utils.tiny_model import make_tiny_model
from hybridflow.data.arith import write_arith_parquet
make_tiny_model('$OUT/tiny_model')
print('tiny model:', '$OUT/tiny_model')
for split, path in write_arith_parquet('$OUT/data').items():
    print(f'{split}:', path)
"
fi

if [[ -f "$OUT/sft/hf/config.json" ]]; then
  echo "== sft: $OUT/sft/hf exists, skipped (--fresh to redo)"
  SECONDS_FOR[sft]=0
else
  stage sft bash scripts/run_recipe.sh "$SFT_RECIPE"
fi
stage "$RL_NAME" bash scripts/run_recipe.sh "$RL_RECIPE" "${RL_ARGS[@]}"

"$PY" - "$OUT" "$RL_NAME" "${SECONDS_FOR[data]}" "${SECONDS_FOR[sft]}" "${SECONDS_FOR[$RL_NAME]}" <<'EOF'
import sys

from hybridflow.utils.tracking import read_metrics

out, rl, *seconds = sys.argv[1:]
val = [r for r in read_metrics(f"{out}/{rl}/metrics.jsonl") if "val/accuracy" in r]
for key, what in (("val/accuracy", "held-out accuracy"), ("val/agent/tool_success_rate", "tool-call success")):
    if key not in val[0]:
        continue
    (first_step, first), (last_step, last) = ((r["step"], r[key]) for r in (val[0], val[-1]))
    print(f"\n{what} (greedy, {out}/data/test.parquet):")
    print(f"  {f'SFT warm start (RL step {first_step})':<28} {first:6.1%}")
    print(f"  {f'after {rl.upper()} (RL step {last_step})':<28} {last:6.1%}   ({100 * (last - first):+.1f} points)")
print("time per stage: " + ", ".join(f"{name} {s}s" for name, s in zip(("data", "sft", rl), seconds)))
print(f"plots: {out}/sft/plots/ and {out}/{rl}/plots/ (reward.png, val_accuracy.png, ...)")
print(f"final policy (Hugging Face format): {out}/{rl}/hf")
EOF
