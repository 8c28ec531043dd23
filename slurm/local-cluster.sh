#!/usr/bin/env bash
# Start, stop or inspect a real single-node SLURM cluster on this machine, kept entirely inside DIR.
#
#   slurm/local-cluster.sh start   DIR   # munged + slurmctld + slurmd; last stdout line:
#                                        #   export SLURM_CONF=DIR/slurm.conf
#   slurm/local-cluster.sh stop    DIR   # cancel the jobs, stop the daemons and job processes of DIR
#   slurm/local-cluster.sh restart DIR   # stop, then start a fresh cluster
#   slurm/local-cluster.sh status  DIR   # exit 0 if the cluster answers, 1 if not (prints a summary)
#
# Typical use in a test or a benchmark:
#   eval "$(slurm/local-cluster.sh start /tmp/c1 | tail -n 1)"
#   sbatch --wait -n 2 job.sh
#   slurm/local-cluster.sh stop /tmp/c1
#
# What it does
#   * Runs as root (SlurmUser=root). Installs nothing: slurm-wlm and munge must be there
#     (DEBIAN_FRONTEND=noninteractive apt-get install -y slurm-wlm munge), exit code 3 otherwise.
#   * A private munged (own key, socket, pid, log and seed files in DIR/munge) and
#     AuthInfo=socket=DIR/munge/munge.socket: neither /etc/munge nor a system munged is used.
#   * slurm.conf is written at every start: node $(hostname -s) at 127.0.0.1 with CPUs = the CPUs this process may use (nproc without the OpenMP variables) and
#     90 % of the RAM, one partition "local" (Default, OverSubscribe=YES), no accounting, no cgroups
#     (proctrack/linuxproc, task/none), MpiDefault=pmix, JobRequeue=1, ReturnToService=2.
#   * SlurmctldPort and SlurmdPort are free TCP ports probed at start (retried if someone else takes
#     them first), so clusters in different DIRs run side by side.
#   * Every start is a fresh cluster: job state (DIR/state), the slurmd spool and DIR/tmp are wiped,
#     job ids restart at 1; logs in DIR/log are appended. `start` on a DIR whose cluster is up and
#     answering only prints the export line again; a half-dead cluster in DIR is stopped first.
#   * stop only touches processes of DIR: the daemons are started with LOCAL_CLUSTER_DIR=DIR in
#     their environment; slurmstepds (which overwrite their environment) are recognised by their
#     working directory DIR/log and open DIR/log/slurmd.log; job processes are the descendants of
#     those slurmstepds. This works even if DIR was deleted under the running cluster.
#
# Tunables (environment):
#   LOCAL_CLUSTER_START_TIMEOUT  s to wait for the node to be idle (60)
#   LOCAL_CLUSTER_STOP_GRACE     s the cancelled jobs get after SIGTERM before SIGKILL at stop (3)
#   LOCAL_CLUSTER_STOP_TIMEOUT   s the daemons get after SIGTERM before SIGKILL at stop (10)
#   LOCAL_CLUSTER_CRED_EXPIRE    AuthInfo cred_expire, s (10, min 5; SLURM default 120): also the
#                                delay before a requeued job may start again
#   LOCAL_CLUSTER_MIN_JOB_AGE    MinJobAge, s (300): how long scontrol show job still shows a
#                                finished job (there is no sacct: accounting is off). It also
#                                paces sbatch --wait, which polls 2, 10, 42, 74, ... s after
#                                submission with 300, every 2 s with MinJobAge <= 4.
#   LOCAL_CLUSTER_MPI_DEFAULT    MpiDefault (pmix; none = SLURM default)
#   LOCAL_CLUSTER_CTLD_PORT, LOCAL_CLUSTER_SLURMD_PORT   fixed ports instead of probed ones
#
# Exit codes: 0 ok, 1 failure, 2 usage, 3 slurm/munge not installed.
set -euo pipefail

die() { echo "local-cluster: $*" >&2; exit 1; }
log() { echo "local-cluster: $*" >&2; }
usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

[[ $# -eq 2 && -n $2 ]] || usage
CMD=$1
case $CMD in
  start | restart) mkdir -p -- "$2" ;;
  stop | status) ;;
  *) usage ;;
esac
# Absolute, symlinks resolved: the mark must be canonical. A DIR deleted under a running cluster
# can still be stopped.
if [[ -d $2 ]]; then DIR=$(cd -- "$2" && pwd -P); else DIR=$(realpath -m -- "$2"); fi
case $DIR in *[[:space:]]* | *'#'* | *'='* | *','*) die "DIR must not contain blanks, '#', '=' or ',': $DIR" ;; esac
# Unix socket paths are limited to 108 bytes (DIR/munge/munge.socket, DIR/spool/HOST_JOB.STEP, ...).
((${#DIR} <= 60)) || die "DIR path is too long for the unix sockets in it (max 60 characters): $DIR"

CONF=$DIR/slurm.conf
MUNGE_DIR=$DIR/munge
MUNGE_SOCKET=$MUNGE_DIR/munge.socket
MUNGE_PID=$MUNGE_DIR/munged.pid
CTLD_PID=$DIR/run/slurmctld.pid
SLURMD_PID=$DIR/run/slurmd.pid
SLURMD_LOG=$DIR/log/slurmd.log
MARK="LOCAL_CLUSTER_DIR=$DIR"
START_TIMEOUT=${LOCAL_CLUSTER_START_TIMEOUT:-60}
STOP_GRACE=${LOCAL_CLUSTER_STOP_GRACE:-3}
STOP_TIMEOUT=${LOCAL_CLUSTER_STOP_TIMEOUT:-10}
CRED_EXPIRE=${LOCAL_CLUSTER_CRED_EXPIRE:-10}
MIN_JOB_AGE=${LOCAL_CLUSTER_MIN_JOB_AGE:-300}
MPI_DEFAULT=${LOCAL_CLUSTER_MPI_DEFAULT:-pmix}
# SLURM ignores cred_expire < 5 (logs "AuthInfo=cred_expire=2 invalid" and uses 120).
if ! [[ $CRED_EXPIRE =~ ^[0-9]+$ ]] || ((CRED_EXPIRE < 5)); then
  die "LOCAL_CLUSTER_CRED_EXPIRE must be an integer >= 5"
fi
for v in START_TIMEOUT STOP_GRACE STOP_TIMEOUT MIN_JOB_AGE; do
  [[ ${!v} =~ ^[0-9]+$ ]] || die "LOCAL_CLUSTER_$v must be an integer"
done

# The client commands used here talk to this cluster only, whatever the caller exported.
export SLURM_CONF=$CONF
unset SLURM_JOB_ID SLURM_JOBID SLURM_CLUSTERS 2>/dev/null || true
PATH=$PATH:/usr/sbin:/sbin

# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------

# stat_field PID N: field N of /proc/PID/stat counted after the "(comm)" field
# (1 = state, 2 = ppid, 20 = start time), safe for command names with blanks or parentheses.
stat_field() {
  local s
  s=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  s=${s##*) }
  awk -v n="$2" '{print $n}' <<<"$s"
}

# alive PID: the process exists and is not a zombie waiting to be reaped.
alive() {
  local state
  state=$(stat_field "$1" 1) || return 1
  [[ -n $state && $state != Z && $state != X ]]
}

# marked PID: a daemon started by this script for DIR (its environment holds the mark).
marked() {
  { tr '\0' '\n' <"/proc/$1/environ"; } 2>/dev/null | grep -qxF -- "$MARK"
}

# our_stepd PID: a slurmstepd (checked by the caller) of DIR's slurmd. slurmstepd overwrites its
# environment (process title), but runs in DIR/log and keeps DIR/log/slurmd.log open.
# (" (deleted)": DIR was removed under the running cluster.)
our_stepd() {
  local cwd
  cwd=$(readlink "/proc/$1/cwd" 2>/dev/null) || return 1
  [[ $cwd == "$DIR/log" || $cwd == "$DIR/log (deleted)" ]] && return 0
  [[ -n $(find "/proc/$1/fd" -maxdepth 1 \( -lname "$SLURMD_LOG" -o -lname "$SLURMD_LOG (deleted)" \) \
    2>/dev/null | head -n 1) ]]
}

# The pid in a pid file, if that process is alive and ours.
pid_from_file() {
  local pid
  [[ -r $1 ]] || return 1
  pid=$(tr -dc '0-9' <"$1")
  [[ -n $pid ]] && alive "$pid" && marked "$pid" && echo "$pid"
}

# The live slurmstepds of DIR.
stepd_pids() {
  local f pid
  # One grep over all /proc/*/comm (forks are slow in some VMs), then the few slurmstepds.
  for f in $(grep -lx slurmstepd /proc/[0-9]*/comm 2>/dev/null || true); do
    pid=${f#/proc/}
    pid=${pid%/comm}
    our_stepd "$pid" && alive "$pid" && echo "$pid"
  done
  return 0
}

# The live processes of DIR's cluster: munged, slurmctld (+ slurmscriptd), slurmd, slurmstepds.
cluster_roots() {
  local f pid
  for f in $(grep -lzxF -- "$MARK" /proc/[0-9]*/environ 2>/dev/null || true); do
    pid=${f#/proc/}
    pid=${pid%/environ}
    [[ $pid != "$$" ]] && alive "$pid" && echo "$pid"
  done
  stepd_pids
}

# The given pids and all their descendants (job shells, mpirun, ranks...), never this script or
# its ancestors.
with_descendants() {
  local self_chain=" " pid=$$
  while [[ -n $pid && $pid != 0 ]]; do
    self_chain+="$pid "
    pid=$(stat_field "$pid" 2 || true)
  done
  ps -e -o pid=,ppid= | awk -v roots=" $* " -v skip="$self_chain" '
    { parent[$1] = $2; pids[NR] = $1 }
    END {
      n = split(roots, r, " "); for (i = 1; i <= n; i++) keep[r[i]] = 1
      for (changed = 1; changed;) {
        changed = 0
        for (i = 1; i <= NR; i++) { p = pids[i]; if (!(p in keep) && (parent[p] in keep)) { keep[p] = 1; changed = 1 } }
      }
      for (p in keep) if (index(skip, " " p " ") == 0) print p
    }'
}

# Job processes (slurmstepds of DIR and all their descendants) seen so far, with their start
# times: a job process whose slurmstepd died is re-parented to init but is still found, and a
# recycled pid is not mistaken for it.
declare -A TRACKED=()
track() {
  local p t roots
  roots=$(stepd_pids)
  # shellcheck disable=SC2086  # word splitting of the pid list is intended
  for p in $(with_descendants $roots); do
    [[ -n ${TRACKED[$p]:-} ]] && continue
    t=$(stat_field "$p" 20) && TRACKED[$p]=$t
  done
}
same_process() { [[ $(stat_field "$1" 20 2>/dev/null) == "${TRACKED[$1]:-x}" ]] && alive "$1"; }
tracked_alive() {
  local p
  for p in "${!TRACKED[@]}"; do same_process "$p" && echo "$p"; done
  return 0
}

# wait_gone SECONDS PID...: wait until none of the pids is alive; returns 1 on timeout.
wait_gone() {
  local deadline=$((SECONDS + $1)) p left
  shift
  while :; do
    left=0
    for p in "$@"; do alive "$p" && { left=1; break; }; done
    ((left == 0)) && return 0
    ((SECONDS >= deadline)) && return 1
    sleep 0.1
  done
}

# terminate SECONDS PID...: SIGTERM, then SIGKILL to what is left after SECONDS.
terminate() {
  local secs=$1 p left=()
  shift
  [[ $# -gt 0 ]] || return 0
  kill -TERM "$@" 2>/dev/null || true
  wait_gone "$secs" "$@" && return 0
  for p in "$@"; do alive "$p" && left+=("$p"); done
  log "SIGKILL to $(for p in "${left[@]}"; do printf '%s(%s) ' "$p" "$(cat "/proc/$p/comm" 2>/dev/null)"; done)(alive ${secs}s after SIGTERM)"
  kill -KILL "${left[@]}" 2>/dev/null || true
  wait_gone 5 "${left[@]}" || log "pids ${left[*]} survive SIGKILL"
}

# ---------------------------------------------------------------------------------------------
# Ports
# ---------------------------------------------------------------------------------------------

port_in_use() { ss -Htan 2>/dev/null | awk '{print $4}' | grep -qE "[:.]$1\$"; }

# A TCP port in 20000-59999 that nobody listens on or uses right now (not $1).
free_port() {
  local p
  for _ in $(seq 200); do
    p=$((20000 + (RANDOM * 32768 + RANDOM) % 40000))
    [[ $p == "${1:-}" ]] && continue
    port_in_use "$p" || { echo "$p"; return 0; }
  done
  die "no free TCP port found"
}

# ---------------------------------------------------------------------------------------------
# start
# ---------------------------------------------------------------------------------------------

require_installed() {
  local missing=() b
  for b in munged mungekey munge unmunge slurmctld slurmd sinfo sbatch squeue scontrol scancel; do
    command -v "$b" >/dev/null 2>&1 || missing+=("$b")
  done
  if [[ ${#missing[@]} -gt 0 ]]; then
    echo "local-cluster: not installed: ${missing[*]}" >&2
    echo "local-cluster: install with: DEBIAN_FRONTEND=noninteractive apt-get install -y slurm-wlm munge" >&2
    exit 3
  fi
  [[ $(id -u) == 0 ]] || die "must run as root (the cluster runs with SlurmUser=root)"
}

# The cluster answers: slurmctld replies and the node is usable.
responding() {
  local state
  state=$(timeout 10 sinfo -h -N -o '%T' 2>/dev/null | head -n 1) || return 1
  [[ $state =~ ^(idle|mixed|allocated|completing)$ ]]
}

write_conf() {
  local host=$1 ctld_port=$2 slurmd_port=$3 cpus mem_mb
  cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc alone honours OMP_NUM_THREADS
  mem_mb=$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)
  cat >"$CONF" <<EOF
# Written by slurm/local-cluster.sh on $(date -Is); rewritten at every start.
ClusterName=local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long a requeued job waits before it may start again (SLURM default 120).
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=$CRED_EXPIRE
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$SLURMD_LOG
SlurmctldDebug=info
SlurmdDebug=info
# Where the pmix plugin puts spmix_appdir_<uid>_<job>.<step>: inside DIR, so that clusters with the
# same job ids do not collide in /tmp.
TmpFS=$DIR/tmp
PlugStackConfig=$DIR/plugstack.conf
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
# pmix: a plain "srun prog" starts Open MPI programs (Debian's Open MPI 4.1 speaks PMIx, not pmi2).
MpiDefault=$MPI_DEFAULT
SelectType=select/cons_tres
# CPUs are the consumable resource, memory is not: --mem is checked against RealMemory at submit,
# and jobs without --mem do not each claim the whole node's memory.
SelectTypeParameters=CR_CPU
# The main scheduling loop runs every sched_interval s (SLURM default 60); backfill does not pick
# up a requeued job once its BeginTime has passed, so with the default it waits up to a minute.
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
# Jobs that can never run here (more CPUs or nodes than exist) are rejected by sbatch instead of
# pending forever with Reason=PartitionConfig.
EnforcePartLimits=ALL
JobRequeue=1
ReturnToService=2
SlurmdTimeout=300
SlurmctldTimeout=120
InactiveLimit=0
KillWait=30
MinJobAge=$MIN_JOB_AGE
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

start_munged() {
  mkdir -p "$MUNGE_DIR"
  chmod 0755 "$MUNGE_DIR"   # munged wants the socket's directory searchable by all
  if [[ ! -s $MUNGE_DIR/munge.key ]]; then
    rm -f "$MUNGE_DIR/munge.key"
    mungekey --create --keyfile="$MUNGE_DIR/munge.key" >&2
  fi
  chmod 0400 "$MUNGE_DIR/munge.key"
  rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock" "$MUNGE_PID"
  # --force: munged only warns, instead of refusing, when its permission checks on the key, socket
  # or log paths fail (e.g. DIR under a group-writable directory). Not needed under /tmp as root.
  env -i PATH="$PATH" "$MARK" munged --force \
    --key-file="$MUNGE_DIR/munge.key" --socket="$MUNGE_SOCKET" --pid-file="$MUNGE_PID" \
    --log-file="$MUNGE_DIR/munged.log" --seed-file="$MUNGE_DIR/munged.seed" 9>&- \
    || die "munged failed to start; see $MUNGE_DIR/munged.log"
  for _ in $(seq 50); do
    munge -n -S "$MUNGE_SOCKET" 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  die "munged does not answer on $MUNGE_SOCKET; see $MUNGE_DIR/munged.log"
}

# One try at slurmctld + slurmd on the given ports: 0 when the node is idle, 1 if a port was taken
# (the caller retries with others); dies on any other failure.
start_slurm() {
  local host=$1 ctld_port=$2 slurmd_port=$3 deadline f ctld_log_from slurmd_log_from
  write_conf "$host" "$ctld_port" "$slurmd_port"
  rm -rf "$DIR/state" "$DIR/spool" "$DIR/tmp"
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log" "$DIR/run" "$DIR/tmp"
  : >"$DIR/plugstack.conf"   # no SPANK plugins from /etc/slurm/plugstack.conf
  rm -f "$CTLD_PID" "$SLURMD_PID"
  ctld_log_from=$(($(stat -c %s "$DIR/log/slurmctld.log" 2>/dev/null || echo 0) + 1))
  slurmd_log_from=$(($(stat -c %s "$SLURMD_LOG" 2>/dev/null || echo 0) + 1))

  # Both daemons fork into the background and write their pid files. fd 9 (the lock) is closed
  # so that it is released when this script ends.
  env -i PATH="$PATH" "$MARK" SLURM_CONF="$CONF" slurmctld -f "$CONF" 9>&- \
    || die "slurmctld failed to start; see $DIR/log/slurmctld.log"
  env -i PATH="$PATH" "$MARK" SLURM_CONF="$CONF" slurmd -f "$CONF" 9>&- \
    || die "slurmd failed to start; see $SLURMD_LOG"

  deadline=$((SECONDS + START_TIMEOUT))
  while ((SECONDS < deadline)); do
    responding && return 0
    for f in "$CTLD_PID" "$SLURMD_PID"; do
      if [[ -s $f ]] && ! pid_from_file "$f" >/dev/null; then
        if tail -c "+$ctld_log_from" "$DIR/log/slurmctld.log" 2>/dev/null | grep -q 'Address already in use' ||
          tail -c "+$slurmd_log_from" "$SLURMD_LOG" 2>/dev/null | grep -q 'Address already in use'; then
          return 1
        fi
        tail -n 20 "$DIR/log/slurmctld.log" "$SLURMD_LOG" >&2 || true
        die "$(basename "$f" .pid) exited during start-up"
      fi
    done
    sleep 0.2
  done
  tail -n 20 "$DIR/log/slurmctld.log" "$SLURMD_LOG" >&2 || true
  sinfo -N -l >&2 || true
  die "node not idle after ${START_TIMEOUT}s"
}

stop_slurm_daemons() {
  local pids=() pid f
  for f in "$SLURMD_PID" "$CTLD_PID"; do
    pid=$(pid_from_file "$f" || true)
    [[ -n $pid ]] && pids+=("$pid")
  done
  terminate "$STOP_TIMEOUT" "${pids[@]}"
  rm -f "$SLURMD_PID" "$CTLD_PID"
}

cmd_start() {
  local t0=$SECONDS host ctld_port slurmd_port attempt
  require_installed
  if [[ -n $(cluster_roots) ]]; then
    if [[ -n $(pid_from_file "$MUNGE_PID") && -n $(pid_from_file "$CTLD_PID") &&
      -n $(pid_from_file "$SLURMD_PID") ]] && responding; then
      log "a cluster is already running in $DIR; reusing it (use 'restart' for a fresh one)"
      echo "export SLURM_CONF=$CONF"
      return 0
    fi
    log "a broken cluster is left in $DIR; stopping it first"
    cmd_stop >&2
  fi

  host=$(hostname -s)
  # Whatever fails from here on, leave nothing half-started behind.
  trap 'log "start failed; cleaning up"; cmd_stop >&2 || true' EXIT
  start_munged
  for attempt in 1 2 3 4 5; do
    ctld_port=${LOCAL_CLUSTER_CTLD_PORT:-$(free_port)}
    slurmd_port=${LOCAL_CLUSTER_SLURMD_PORT:-$(free_port "$ctld_port")}
    if start_slurm "$host" "$ctld_port" "$slurmd_port"; then
      trap - EXIT
      log "cluster up in $DIR after $((SECONDS - t0))s (node $host, slurmctld port $ctld_port, slurmd port $slurmd_port)"
      echo "export SLURM_CONF=$CONF" >"$DIR/env.sh"
      echo "export SLURM_CONF=$CONF"
      return 0
    fi
    [[ -z ${LOCAL_CLUSTER_CTLD_PORT:-}${LOCAL_CLUSTER_SLURMD_PORT:-} ]] ||
      die "port $ctld_port or $slurmd_port (from LOCAL_CLUSTER_*_PORT) is taken"
    log "port $ctld_port or $slurmd_port is taken; retrying with other ports (attempt $attempt)"
    stop_slurm_daemons
  done
  die "could not start slurmctld/slurmd on free ports"
}

# ---------------------------------------------------------------------------------------------
# stop, status
# ---------------------------------------------------------------------------------------------

cmd_stop() {
  local jobs p deadline ctld slurmd munged stepds=() procs=() rest=()
  if [[ -z $(cluster_roots) ]]; then
    echo "local-cluster: nothing running in $DIR"
    return 0
  fi
  track
  ctld=$(pid_from_file "$CTLD_PID" || true)
  slurmd=$(pid_from_file "$SLURMD_PID" || true)
  munged=$(pid_from_file "$MUNGE_PID" || true)

  # 1. Cancel all jobs the normal way (SIGCONT + SIGTERM to every job process) and give them
  #    STOP_GRACE seconds to end.
  if [[ -n $ctld ]]; then
    jobs=$(timeout 10 squeue -h -o %A 2>/dev/null || true)
    if [[ -n $jobs ]]; then
      # shellcheck disable=SC2086
      timeout 10 scancel $jobs 2>/dev/null || true
      deadline=$((SECONDS + STOP_GRACE))
      while ((SECONDS < deadline)) && [[ -n $(stepd_pids) ]]; do sleep 0.2; done
    fi
  fi

  # 2. SIGKILL the job processes that are left (everything below the slurmstepds, including
  #    processes re-parented to init), then give the slurmstepds a moment to report the end of
  #    their steps to slurmd, and SIGKILL them too if they linger.
  track
  mapfile -t stepds < <(stepd_pids)
  for p in $(tracked_alive); do
    [[ " ${stepds[*]} " == *" $p "* ]] || procs+=("$p")
  done
  if [[ ${#procs[@]} -gt 0 ]]; then
    kill -KILL "${procs[@]}" 2>/dev/null || true
    wait_gone 5 "${procs[@]}" || log "job processes survive SIGKILL: ${procs[*]}"
  fi
  if [[ ${#stepds[@]} -gt 0 ]] && ! wait_gone 3 "${stepds[@]}"; then
    kill -KILL "${stepds[@]}" 2>/dev/null || true
    wait_gone 5 "${stepds[@]}" || true
  fi
  # Let slurmctld take the node out of "completing" before slurmd goes (otherwise slurmd spends
  # MessageTimeout trying to send epilog-complete to a controller that is shutting down).
  if [[ -n $ctld ]]; then
    for _ in $(seq 15); do
      [[ -z $(timeout 5 squeue -h -t CG -o %A 2>/dev/null || true) ]] && break
      sleep 0.2
    done
  fi

  # 3. slurmd, then slurmctld (with slurmscriptd), then munged, which both use until the end.
  # shellcheck disable=SC2086  # an empty pid vanishes
  terminate "$STOP_TIMEOUT" $slurmd
  # shellcheck disable=SC2086
  terminate "$STOP_TIMEOUT" $ctld
  # Leftovers: anything else of DIR except munged (e.g. slurmscriptd if slurmctld was killed).
  # shellcheck disable=SC2046
  for p in $(tracked_alive) $(with_descendants $(cluster_roots)); do
    [[ $p != "$munged" ]] && rest+=("$p")
  done
  [[ ${#rest[@]} -eq 0 ]] || terminate 2 "${rest[@]}"
  # shellcheck disable=SC2086
  terminate "$STOP_TIMEOUT" $munged
  mapfile -t rest < <(cluster_roots)
  [[ ${#rest[@]} -eq 0 ]] || terminate 2 "${rest[@]}"
  rm -f "$SLURMD_PID" "$CTLD_PID" "$MUNGE_PID" "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
  echo "local-cluster: stopped the cluster in $DIR"
}

cmd_status() {
  local name f pid rc=0
  for name in munged slurmctld slurmd; do
    case $name in munged) f=$MUNGE_PID ;; slurmctld) f=$CTLD_PID ;; slurmd) f=$SLURMD_PID ;; esac
    if pid=$(pid_from_file "$f"); then echo "$name: running (pid $pid)"; else echo "$name: not running"; rc=1; fi
  done
  echo "slurmstepd: $(stepd_pids | wc -l) running"
  if [[ $rc == 0 ]] && responding; then
    echo "export SLURM_CONF=$CONF"
    sinfo -N -o '%N %T %C %m' 2>/dev/null || true
    squeue 2>/dev/null || true
    return 0
  fi
  echo "cluster in $DIR: not usable"
  return 1
}

# Serialise the commands on one DIR. The daemons are started with fd 9 closed, so the lock is
# released when this script exits.
if [[ -d $DIR ]]; then
  exec 9>"$DIR/.lock"
  flock 9
fi

case $CMD in
  start) cmd_start ;;
  stop) cmd_stop ;;
  restart) cmd_stop >&2; cmd_start ;;
  status) cmd_status ;;
esac
