#!/usr/bin/env bash
# One node's Ray daemons, run in the foreground by `srun` from scripts/slurm/run_recipe.sbatch.
#
#   ray_node.sh head   HEAD_IP PORT TEMP_DIR    # GCS + raylet on the head node (PORT 0: one the
#                                               # GCS binds itself, written to TEMP_DIR/ray_current_cluster)
#   ray_node.sh worker HEAD_IP PORT TEMP_DIR    # raylet joining the head
#
# Devices come from the Slurm step: SLURM_CPUS_ON_NODE CPUs, SLURM_GPUS_ON_NODE GPUs (0 when the
# allocation has none). The node is labelled slurm-node=<Slurm node name> so the launcher can name
# nodes that failed to join. `ray start --block` runs in its own session, which holds every Ray
# process of this node (GCS, raylet, dashboard and runtime-env agents, and the workers, each in a
# process group of its own). On SIGTERM / SIGINT (srun's teardown) or when `ray start` ends, it
# gets SIGTERM to stop what it started, then whatever of its session is still there after
# HYBRIDFLOW_RAY_STOP_GRACE_S (default 10) seconds is killed: agents and workers that would
# otherwise wait to notice their raylet is gone. The script exits only once the session is empty,
# or that many seconds after the SIGKILL, naming what is still running (scripts/lib/session.sh).
set -euo pipefail

role="$1" head_ip="$2" port="$3" temp_dir="$4"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../lib/session.sh"
node_address_py="$here/../../hybridflow/launch/node_address.py"

if [[ $role == head ]]; then
  node_ip="$head_ip"
else
  node_ip="$("$HYBRIDFLOW_PYTHON" "$node_address_py" --toward "$head_ip")"
fi
common=(
  --block
  --node-ip-address="$node_ip"
  --num-cpus="$SLURM_CPUS_ON_NODE"
  --num-gpus="${SLURM_GPUS_ON_NODE:-0}"
  --labels="slurm-node=$SLURMD_NODENAME"
  --temp-dir="$temp_dir"
  --dashboard-agent-listen-port=0 # several jobs may share a node: no fixed agent port
  --disable-usage-stats
)
echo "[ray_node] $role on $SLURMD_NODENAME at $node_ip: ${SLURM_CPUS_ON_NODE} CPU, ${SLURM_GPUS_ON_NODE:-0} GPU"
# At teardown Slurm signals every process of the step, the GCS included: draining the node first
# (a Ray Serve feature) would only wait out its timeout on a GCS that is already gone.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0
grace_s="${HYBRIDFLOW_RAY_STOP_GRACE_S:-10}"
case "$role" in
  head) args=(start --head --port="$port" --include-dashboard=false "${common[@]}") ;;
  worker)
    [[ $head_ip == *:* ]] && head_ip="[$head_ip]"
    args=(start --address="$head_ip:$port" "${common[@]}")
    ;;
  *)
    echo "ray_node.sh: role must be head or worker, got '$role'" >&2
    exit 2
    ;;
esac

stop_ray() {  # SIGTERM to `ray start`, which stops what it started; then the rest of its session
  kill -TERM "$ray_pid" 2>/dev/null || true
  session_gone_within "$ray_pid" "$grace_s" && return 0
  echo "[ray_node] killing the Ray processes still running after ${grace_s}s" >&2
  kill_and_wait_session "$ray_pid" "$grace_s" "[ray_node]" || true
}
# Not a process-group leader (no job control here), so setsid execs in place: $! is `ray start`,
# and its PID is the new session's ID.
setsid "$HYBRIDFLOW_RAY" "${args[@]}" &
ray_pid=$!
trap 'stop_ray; exit 143' TERM
trap 'stop_ray; exit 130' INT
status=0
wait "$ray_pid" || status=$?
stop_ray
exit "$status"
