#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for testing scripts/slurm/run_recipe.sbatch.
#
#   bash scripts/slurm/setup_local_cluster.sh start      # install if absent, start, print SLURM_CONF=...
#   bash scripts/slurm/setup_local_cluster.sh status     # exit 0 when the node is idle/allocated
#   bash scripts/slurm/setup_local_cluster.sh teardown   # stop only the daemons `start` started
#
# `start` installs Debian's slurm-wlm and munge with apt-get when they are missing, starts munged
# (unless a working one is already running), then slurmctld and slurmd with a config of their own
# under $HYBRIDFLOW_SLURM_DIR, on ports of their own, so an existing Slurm set-up on the machine is
# neither read nor changed. It is idempotent: a second `start` finds the running cluster and only
# prints its SLURM_CONF line. Every daemon it starts is recorded by pid; `teardown` stops those
# pids (after checking each is still the daemon it started) and nothing else.
# Exit codes: 0 ok, 1 failure, 3 the packages are absent and cannot be installed here.
set -euo pipefail

STATE_DIR="${HYBRIDFLOW_SLURM_DIR:-/tmp/hybridflow-slurm}"
CTLD_PORT="${HYBRIDFLOW_SLURMCTLD_PORT:-16817}"
SLURMD_PORT="${HYBRIDFLOW_SLURMD_PORT:-16818}"
CONF="$STATE_DIR/slurm.conf"
NODE="$(hostname -s)"
export SLURM_CONF="$CONF"

log() { echo "[setup_local_cluster] $*" >&2; }

have_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null
}

install_packages() {
  if [[ $(id -u) -ne 0 ]]; then
    log "slurm-wlm/munge are not installed and installing them needs root (running as $(id -un))"
    exit 3
  fi
  if ! command -v apt-get >/dev/null; then
    log "slurm-wlm/munge are not installed and there is no apt-get to install them"
    exit 3
  fi
  log "installing slurm-wlm and munge with apt-get"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; } \
    >"$STATE_DIR/apt.log" 2>&1; then
    tail -n 20 "$STATE_DIR/apt.log" >&2
    log "apt-get could not install slurm-wlm/munge (log: $STATE_DIR/apt.log)"
    exit 3
  fi
}

pid_alive() { # pidfile expected-command-name
  local pid
  [[ -s $1 ]] || return 1
  pid="$(cat "$1")"
  [[ -r /proc/$pid/comm && "$(cat "/proc/$pid/comm")" == "$2" ]]
}

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
  if munge_works; then
    log "reusing the munged already running"
    return
  fi
  if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  rm -f /run/munge/munged.pid
  runuser -u munge -- munged --force
  for _ in $(seq 50); do
    [[ -s /run/munge/munged.pid ]] && munge_works && break
    sleep 0.1
  done
  munge_works || { log "munged did not start (see /var/log/munge/munged.log)"; exit 1; }
  cp /run/munge/munged.pid "$STATE_DIR/munged.pid"
}

write_config() {
  local node_line
  # slurmd's own view of the hardware (`nproc` would follow OMP_NUM_THREADS instead).
  node_line="$(slurmd -C | head -n 1)"
  [[ $node_line == "NodeName=$NODE "* ]] || { log "unexpected 'slurmd -C' output: $node_line"; exit 1; }
  mkdir -p "$STATE_DIR/spool" "$STATE_DIR/state" "$STATE_DIR/log"
  cat >"$CONF" <<EOF
# Written by scripts/slurm/setup_local_cluster.sh: a one-node test cluster.
ClusterName=hybridflow-local
SlurmctldHost=$NODE
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SchedulerType=sched/backfill
StateSaveLocation=$STATE_DIR/state
SlurmdSpoolDir=$STATE_DIR/spool
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd.log
$node_line State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

node_state() { sinfo -h -n "$NODE" -o %T 2>/dev/null | head -n 1; }

wait_for_idle_node() {
  local state=""
  for _ in $(seq 150); do
    state="$(node_state)"
    [[ $state == idle* || $state == mixed* || $state == allocated* ]] && return 0
    sleep 0.2
  done
  log "node $NODE is not idle after 30 s (state: '${state:-no answer}'); logs in $STATE_DIR/log"
  tail -n 20 "$STATE_DIR/log/slurmctld.log" "$STATE_DIR/log/slurmd.log" >&2 || true
  return 1
}

start() {
  mkdir -p "$STATE_DIR"
  have_packages || install_packages
  if pid_alive "$STATE_DIR/slurmctld.pid" slurmctld && pid_alive "$STATE_DIR/slurmd.pid" slurmd; then
    log "cluster already running"
  else
    start_munge
    write_config
    pid_alive "$STATE_DIR/slurmctld.pid" slurmctld || slurmctld -f "$CONF"
    pid_alive "$STATE_DIR/slurmd.pid" slurmd || slurmd -f "$CONF"
  fi
  wait_for_idle_node
  echo "SLURM_CONF=$CONF"
}

stop_pidfile() { # pidfile expected-command-name
  local pid
  pid_alive "$1" "$2" || { rm -f "$1"; return 0; }
  pid="$(cat "$1")"
  kill -TERM "$pid"
  for _ in $(seq 100); do
    [[ -d /proc/$pid ]] || break
    sleep 0.1
  done
  [[ -d /proc/$pid ]] && kill -KILL "$pid"
  rm -f "$1"
}

cancel_jobs() {
  # Every job on this private cluster was submitted to it: cancel them so their steps (and what
  # they started) end while slurmd can still clean up after them.
  pid_alive "$STATE_DIR/slurmctld.pid" slurmctld || return 0
  local jobs
  jobs="$(squeue -h -o %i 2>/dev/null || true)"
  [[ -n $jobs ]] || return 0
  log "cancelling jobs still on the cluster: $(echo $jobs)"
  scancel $jobs || true
  for _ in $(seq 60); do
    [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && return 0
    sleep 0.5
  done
  log "jobs still listed after 30 s: $(squeue -h 2>/dev/null | tr '\n' ' ')"
}

teardown() {
  [[ -d $STATE_DIR ]] || return 0
  cancel_jobs
  stop_pidfile "$STATE_DIR/slurmd.pid" slurmd
  stop_pidfile "$STATE_DIR/slurmctld.pid" slurmctld
  stop_pidfile "$STATE_DIR/munged.pid" munged
  rm -rf "$STATE_DIR"
}

case "${1:-start}" in
  start) start ;;
  status) wait_for_idle_node ;;
  teardown) teardown ;;
  *)
    echo "usage: $0 [start|status|teardown]" >&2
    exit 2
    ;;
esac
