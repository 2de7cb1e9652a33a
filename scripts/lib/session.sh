# Sourced by scripts/run_recipe.sh and scripts/slurm/ray_node.sh: the processes of a session, and
# stopping them all with a bounded wait.
#
# Each script starts its command with setsid, so the session (ID = the command's PID) holds every
# process the command starts. A session, not a process group: Ray's raylet puts each worker in a
# process group of its own (inside the session), so a signal to the command's group misses the
# workers, which then outlive the script until they notice their raylet is gone. A session ID is
# not given to another process while any member of the session is alive, so signalling members by
# their session ID cannot reach a stranger.

# The PIDs of the session's processes that are still running (a zombie has exited already).
session_members() {
  ps -o pid=,stat= -s "$1" 2>/dev/null | awk '$2 !~ /^Z/ { print $1 }' || true
}

# signal_session SIGNAL SID: the signal to every running process of the session.
signal_session() {
  local pids
  pids="$(session_members "$2")"
  [[ -z $pids ]] || kill "-$1" $pids 2>/dev/null || true
}

# session_gone_within SID SECONDS: 0 once the session has no running process, 1 if some are still
# running after SECONDS.
session_gone_within() {
  local tenths
  for ((tenths = 0; ; tenths++)); do
    [[ -z "$(session_members "$1")" ]] && return 0
    ((tenths < $2 * 10)) || return 1
    sleep 0.1
  done
}

# stop_session SID GRACE_S WHO: SIGTERM to every process of the session, SIGKILL to what is left
# after GRACE_S seconds, then up to GRACE_S more seconds for them to be gone. Returns 0 when the
# session is empty; otherwise names what is still running (PID and command line) on stderr as WHO
# and returns 1: a process in uninterruptible sleep (a hung filesystem, a device driver) outlives
# SIGKILL, and waiting for it without a bound would hang the caller too.
stop_session() {
  session_gone_within "$1" 0 && return 0
  signal_session TERM "$1"
  session_gone_within "$1" "$2" && return 0
  kill_and_wait_session "$@"
}

# kill_and_wait_session SID GRACE_S WHO: the SIGKILL half of stop_session.
kill_and_wait_session() {
  signal_session KILL "$1"
  session_gone_within "$1" "$2" && return 0
  local pids
  pids="$(session_members "$1")"
  [[ -z $pids ]] && return 0
  echo "$3: these processes of the run are still running ${2}s after SIGKILL (uninterruptible?):" >&2
  ps -o pid=,stat=,args= -p "$(echo $pids | tr ' ' ,)" >&2 || true
  return 1
}
