#!/usr/bin/env bash
# GRPO settings for the VLM learning claim, over many seeds at once on one GPU (docs/vlm.md, "Seeds
# on a GPU"): each job is 20 steps of recipes/vlm_quickstart.yaml from an SFT warm start through
# scripts/gpu_check.py (the trainer in process, fp32, TP1), eight jobs at a time, held-out greedy
# accuracy at steps 0, 10 and 20 on the 200 test rows and on 1,000 more unseen images.
#
#   bash scripts/vlm_gpu_sweep.sh WARM90 WARM100 DATA [JOB_REGEX]
#
# WARM90 / WARM100: exports of recipes/vlm_quickstart_sft.yaml at 90 and 100 steps (made on any
# machine: bash scripts/run_recipe.sh recipes/vlm_quickstart_sft.yaml trainer.total_training_steps=N),
# DATA: the quadrant data they were trained on (python scripts/make_shapes_data.py --task quadrant).
# JOB_REGEX picks jobs by name (default: all 60). Results, one line per job: $OUT/results.txt (OUT
# defaults to /tmp/vlm_sweep); GPU_CHECK_ARGS go to gpu_check.py after the sweep's own ("--cpu --steps 1"
# rehearses a job on CPU). Needs what scripts/gpu_check.sh needs (PYTHONPATH set to the wheels).
set -u
[ $# -ge 3 ] || { sed -n '2,15p' "$0"; exit 2; }
warm90=$1 warm100=$2 data=$3 pick=${4:-.}
out=${OUT:-/tmp/vlm_sweep}; work=$(mktemp -d); mkdir -p "$out"
export OMP_NUM_THREADS=2 PYTHONUNBUFFERED=1
python3 - "$data" "$work/test1000.parquet" <<'PY'
# 1,000 quadrant rows drawn with another seed, none of them an image of the train or test split;
# data_source "arith" (also the "#### n" rule) so validation reports them apart as val/arith.
import sys
import pyarrow as pa
import pyarrow.parquet as pq
from hybridflow.data.shapes import ShapesConfig, make_splits
data, target = sys.argv[1:]
seen = {r["images"][0]["bytes"] for split in ("train", "test") for r in pq.read_table(f"{data}/{split}.parquet").to_pylist()}
drawn = make_splits(ShapesConfig(task="quadrant", seed=7, num_test=3000, num_train=1))["test"]
rows = [dict(r, data_source="arith") for r in drawn if r["images"][0]["bytes"] not in seen][:1000]
pq.write_table(pa.Table.from_pylist(rows), target)
PY
run() {  # name warm dataseed rolloutseed [--set KEY=VALUE ...]
  name=$1 warm=$2 ds=$3 rs=$4; shift 4
  python3 scripts/gpu_check.py --vlm --steps 20 --workdir "$work/$name" --model "$warm" --data "$data" \
    --set actor.megatron.params_dtype=float32 --set rollout.dtype=float32 \
    --set actor.megatron.use_distributed_optimizer=false \
    --set "data.val_files=[$data/test.parquet,$work/test1000.parquet]" --set trainer.test_freq=10 \
    --set trainer.val_before_train=true --set data.train_batch_size=128 \
    --set actor.update.ppo_mini_batch_size=1024 --set actor.update.ppo_micro_batch_size=64 \
    --set actor.log_prob_micro_batch_size=64 --set actor.optim.lr=3e-4 \
    --set data.seed="$ds" --set rollout.seed="$rs" "$@" ${GPU_CHECK_ARGS:-} > "$work/$name.log" 2>&1
  python3 - "$name" "$?" "$work/$name/out/metrics.jsonl" >> "$out/results.txt" <<'PY'
import json, sys
name, rc, path = sys.argv[1:]
try:
    rows = [json.loads(line) for line in open(path)]
except OSError:
    rows = []
val = [(r["step"], r["val/shapes/accuracy"], r.get("val/arith/accuracy")) for r in rows if "val/shapes/accuracy" in r]
print(name, "rc", rc, "val (step, 200 test rows, 1000 more)", val, flush=True)
PY
}
export -f run
export work data out
cos5="--set actor.optim.lr=5e-4 --set actor.optim.lr_decay_style=cosine --set actor.optim.lr_decay_iters=20"
for seed in 1 2 3 4 5 6; do
  rs=$seed; [ $seed = 1 ] && rs=42  # the recipe's seeds first, then n / n
  echo "base_s$seed $warm90 $seed $rs"
  echo "cos5_s$seed $warm90 $seed $rs $cos5"
  echo "w100_s$seed $warm100 $seed $rs"
  echo "cos5w100_s$seed $warm100 $seed $rs $cos5"
  echo "wu5_s$seed $warm90 $seed $rs $cos5 --set actor.optim.lr_warmup_iters=5"
  echo "mini2_s$seed $warm90 $seed $rs --set actor.update.ppo_mini_batch_size=512"
  echo "mini2_s$((seed + 6)) $warm90 $((seed + 6)) $((seed + 6)) --set actor.update.ppo_mini_batch_size=512"
  echo "mini4_s$seed $warm90 $seed $rs --set actor.update.ppo_mini_batch_size=256"
  echo "mini2w100_s$seed $warm100 $seed $rs --set actor.update.ppo_mini_batch_size=512"
  echo "mini2lr2_s$seed $warm90 $seed $rs --set actor.update.ppo_mini_batch_size=512 --set actor.optim.lr=2e-4"
done | grep -E "^($pick)" | xargs -P "${PAR:-8}" -L 1 bash -c 'run "$@"' _
echo "results: $out/results.txt"
