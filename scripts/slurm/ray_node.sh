#!/usr/bin/env bash
# One node's Ray daemons, run in the foreground by `srun` from scripts/slurm/run_recipe.sbatch.
#
#   ray_node.sh head   HEAD_IP PORT TEMP_DIR    # GCS + raylet on the head node
#   ray_node.sh worker HEAD_IP PORT TEMP_DIR    # raylet joining the head
#
# Devices come from the Slurm step: SLURM_CPUS_ON_NODE CPUs, SLURM_GPUS_ON_NODE GPUs (0 when the
# allocation has none). The node is labelled slurm-node=<Slurm node name> so the launcher can name
# nodes that failed to join. `ray start --block` is exec'd, so the SIGTERM srun forwards at
# teardown reaches it and it stops exactly the Ray processes it started on this node.
set -euo pipefail

role="$1" head_ip="$2" port="$3" temp_dir="$4"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
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
case "$role" in
  head) exec "$HYBRIDFLOW_RAY" start --head --port="$port" --include-dashboard=false "${common[@]}" ;;
  worker)
    [[ $head_ip == *:* ]] && head_ip="[$head_ip]"
    exec "$HYBRIDFLOW_RAY" start --address="$head_ip:$port" "${common[@]}"
    ;;
  *)
    echo "ray_node.sh: role must be head or worker, got '$role'" >&2
    exit 2
    ;;
esac
