#!/usr/bin/env bash
# Start, stop or inspect a real single-node SLURM cluster on this machine, kept entirely inside DIR.
#
#   slurm/local-cluster.sh start   DIR   # start munged + slurmctld + slurmd; last stdout line:
#                                        #   export SLURM_CONF=DIR/slurm.conf
#   slurm/local-cluster.sh stop    DIR   # cancel jobs, stop the daemons and job processes of DIR
#   slurm/local-cluster.sh restart DIR   # stop, then start
#   slurm/local-cluster.sh status  DIR   # exit 0 if the cluster answers, 1 if not (prints a summary)
#
# Usage from a test or a benchmark:
#   eval "$(slurm/local-cluster.sh start /tmp/c1 | tail -n 1)"
#   sbatch --wait -n 2 job.sh
#   slurm/local-cluster.sh stop /tmp/c1
#
# What it does
#   * Runs as root (SlurmUser=root). Nothing is installed: slurm-wlm and munge must already be there
#     (`DEBIAN_FRONTEND=noninteractive apt-get install -y slurm-wlm munge`); exit code 3 otherwise.
#   * A private munged (own key, socket, pid, log and seed files under DIR/munge) and
#     AuthInfo=socket=DIR/munge/munge.socket, so neither /etc/munge nor the system munged is used.
#   * slurm.conf is written at start: node = $(hostname) at 127.0.0.1 with CPUs=$(nproc) and 90 % of
#     the RAM, one partition "local" (OverSubscribe=YES), no accounting, no cgroups
#     (proctrack/linuxproc, task/none), MpiDefault=none, JobRequeue=1, ReturnToService=2.
#   * SlurmctldPort and SlurmdPort are free TCP ports probed at start (retried if another start grabs
#     them first), so clusters in different DIRs run side by side. Override with
#     LOCAL_CLUSTER_CTLD_PORT / LOCAL_CLUSTER_SLURMD_PORT.
#   * Every start is a fresh cluster: job state (DIR/state) and the slurmd spool are wiped; logs in
#     DIR/log are kept (appended). `start` on a DIR whose cluster is up and answering does nothing but
#     print the export line again (idempotent); a half-dead cluster in DIR is stopped and restarted.
#   * Each daemon is started with LOCAL_CLUSTER_DIR=DIR in its environment (inherited by the
#     slurmstepds); `stop` only signals processes carrying that exact mark, and their descendants
#     (the job processes), so clusters of other DIRs and the caller are never touched.
#
# Tunables (environment): LOCAL_CLUSTER_START_TIMEOUT (s, default 60), LOCAL_CLUSTER_STOP_TIMEOUT
# (s to wait after SIGTERM before SIGKILL, default 10), LOCAL_CLUSTER_CRED_EXPIRE (s, default 10, min 5:
# AuthInfo cred_expire, also the delay before a requeued job may start again; SLURM's default is 120),
# LOCAL_CLUSTER_MIN_JOB_AGE (s, default 300: how long `scontrol show job` still shows a finished job).
#
# Exit codes: 0 ok, 1 failure, 2 usage, 3 slurm/munge not installed.
set -euo pipefail

usage() {
  sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

die() { echo "local-cluster: $*" >&2; exit 1; }
log() { echo "local-cluster: $*" >&2; }

[[ $# -eq 2 ]] || usage
CMD=$1
[[ -n $2 ]] || usage
mkdir -p -- "$2"
DIR=$(cd -- "$2" && pwd -P)        # absolute, symlinks resolved: the mark must be canonical
case $DIR in *[[:space:]]* | *'#'* | *'='* | *','*) die "DIR must not contain blanks, '#', '=' or ',': $DIR" ;; esac
# Unix sockets are limited to 108 bytes: DIR/munge/munge.socket and DIR/spool/HOST_JOBID.STEPID.
((${#DIR} <= 60)) || die "DIR path is too long for the unix sockets (max 60 characters): $DIR"

CONF=$DIR/slurm.conf
MUNGE_DIR=$DIR/munge
MUNGE_SOCKET=$MUNGE_DIR/munge.socket
MUNGE_PID=$MUNGE_DIR/munged.pid
CTLD_PID=$DIR/run/slurmctld.pid
SLURMD_PID=$DIR/run/slurmd.pid
MARK="LOCAL_CLUSTER_DIR=$DIR"
START_TIMEOUT=${LOCAL_CLUSTER_START_TIMEOUT:-60}
STOP_TIMEOUT=${LOCAL_CLUSTER_STOP_TIMEOUT:-10}
CRED_EXPIRE=${LOCAL_CLUSTER_CRED_EXPIRE:-10}
MIN_JOB_AGE=${LOCAL_CLUSTER_MIN_JOB_AGE:-300}
# SLURM ignores cred_expire < 5 (logs "AuthInfo=cred_expire=2 invalid" and falls back to 120).
[[ $CRED_EXPIRE =~ ^[0-9]+$ ]] && ((CRED_EXPIRE >= 5)) || die "LOCAL_CLUSTER_CRED_EXPIRE must be an integer >= 5"
[[ $MIN_JOB_AGE =~ ^[0-9]+$ ]] || die "LOCAL_CLUSTER_MIN_JOB_AGE must be an integer"

# Client commands of this script talk to this cluster only, whatever the caller had exported.
export SLURM_CONF=$CONF
unset SLURM_JOB_ID SLURM_JOBID SLURM_CLUSTERS 2>/dev/null || true

# ---------------------------------------------------------------------------------------------
# Process helpers
# ---------------------------------------------------------------------------------------------

# alive PID: the process exists and is not a zombie waiting to be reaped.
alive() {
  local state
  state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
  [[ -n $state && $state != Z && $state != X ]]
}

# marked PID: the process was started by this script for this DIR (environment holds the mark).
marked() {
  { tr '\0' '\n' <"/proc/$1/environ"; } 2>/dev/null | grep -qxF -- "$MARK"
}

# The pid in a pid file, if that process is alive and ours.
pid_from_file() {
  local pid
  [[ -r $1 ]] || return 1
  pid=$(tr -dc '0-9' <"$1")
  [[ -n $pid ]] && alive "$pid" && marked "$pid" && echo "$pid"
}

# All live processes carrying the mark of DIR (munged, slurmctld, slurmd, slurmstepd).
marked_pids() {
  local p pid
  for p in /proc/[0-9]*; do
    pid=${p#/proc/}
    [[ $pid == "$$" ]] && continue
    marked "$pid" && alive "$pid" && echo "$pid"
  done
  return 0
}

# The given pids and all their descendants (job shells, mpirun, ranks...), minus this script and
# its ancestors.
with_descendants() {
  local roots=" $* " tree self_chain pid
  self_chain=" "
  pid=$$
  while [[ -n $pid && $pid != 0 ]]; do
    self_chain+="$pid "
    pid=$(awk '{print $4}' "/proc/$pid/stat" 2>/dev/null || true)
  done
  tree=$(ps -e -o pid=,ppid=)
  # Breadth-first over the (pid, ppid) table.
  awk -v roots="$roots" -v skip="$self_chain" '
    { parent[$1] = $2; pids[NR] = $1 }
    END {
      n = split(roots, r, " "); for (i = 1; i <= n; i++) keep[r[i]] = 1
      changed = 1
      while (changed) {
        changed = 0
        for (i = 1; i <= NR; i++) { p = pids[i]; if (!(p in keep) && (parent[p] in keep)) { keep[p] = 1; changed = 1 } }
      }
      for (p in keep) if (index(skip, " " p " ") == 0) print p
    }' <<<"$tree"
}

# signal_and_wait SECONDS PID...: SIGTERM, wait up to SECONDS, then SIGKILL whatever is left.
signal_and_wait() {
  local secs=$1 pid left deadline
  shift
  [[ $# -gt 0 ]] || return 0
  kill -TERM "$@" 2>/dev/null || true
  deadline=$((SECONDS + secs))
  while :; do
    left=()
    for pid in "$@"; do alive "$pid" && left+=("$pid"); done
    [[ ${#left[@]} -eq 0 ]] && return 0
    ((SECONDS >= deadline)) && break
    sleep 0.1
  done
  log "SIGKILL to ${left[*]} (still alive ${secs}s after SIGTERM)"
  kill -KILL "${left[@]}" 2>/dev/null || true
  for _ in $(seq 50); do
    left=()
    for pid in "$@"; do alive "$pid" && left+=("$pid"); done
    [[ ${#left[@]} -eq 0 ]] && return 0
    sleep 0.1
  done
  log "processes ${left[*]} did not exit after SIGKILL"
  return 1
}

# ---------------------------------------------------------------------------------------------
# Ports
# ---------------------------------------------------------------------------------------------

port_in_use() {
  ss -Htan 2>/dev/null | awk '{print $4}' | grep -qE "[:.]$1\$"
}

# A TCP port (20000-59999) nobody listens on or uses right now.
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
# Commands
# ---------------------------------------------------------------------------------------------

require_installed() {
  local missing=() b
  for b in munged mungekey slurmctld slurmd sinfo sbatch squeue scontrol scancel; do
    command -v "$b" >/dev/null 2>&1 || [[ -x /usr/sbin/$b ]] || missing+=("$b")
  done
  if [[ ${#missing[@]} -gt 0 ]]; then
    echo "local-cluster: not installed: ${missing[*]}" >&2
    echo "local-cluster: install with: DEBIAN_FRONTEND=noninteractive apt-get install -y slurm-wlm munge" >&2
    exit 3
  fi
  [[ $(id -u) == 0 ]] || die "must run as root (SlurmUser=root)"
  PATH=$PATH:/usr/sbin:/sbin
}

# The cluster answers: slurmctld replies and the node is usable.
responding() {
  local state
  state=$(timeout 10 sinfo -h -N -o '%T' 2>/dev/null | head -n 1) || return 1
  [[ $state =~ ^(idle|mixed|allocated|completing)$ ]]
}

write_conf() {
  local host=$1 ctld_port=$2 slurmd_port=$3 cpus mem_mb
  cpus=$(nproc)
  mem_mb=$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)
  cat >"$CONF" <<EOF
# Written by slurm/local-cluster.sh on $(date -Is); regenerated at every start.
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
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig=$DIR/plugstack.conf
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
# pmix: a plain "srun prog" starts Open MPI programs (Debian's Open MPI 4.1 supports PMIx only, not
# pmi2). Set LOCAL_CLUSTER_MPI_DEFAULT=none for the SLURM default.
MpiDefault=${LOCAL_CLUSTER_MPI_DEFAULT:-pmix}
# TmpFS is where the pmix plugin puts spmix_appdir_<uid>_<job>.<step>; inside DIR so that clusters
# with the same job ids do not collide in /tmp.
TmpFS=$DIR/tmp
SelectType=select/cons_tres
# CPUs are the consumable resource; memory is not (--mem is only checked against RealMemory), so
# jobs without --mem do not each claim the whole node's memory.
SelectTypeParameters=CR_CPU
# The main scheduling loop also runs every sched_interval seconds (SLURM default 60): without it a
# requeued job whose BeginTime has passed waits up to a minute (backfill does not pick it up).
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
# Jobs that can never run here (more CPUs or nodes than exist) are rejected at submit time instead of
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
  chmod 0755 "$MUNGE_DIR"   # the socket must be reachable (munged warns otherwise)
  if [[ ! -s $MUNGE_DIR/munge.key ]]; then
    rm -f "$MUNGE_DIR/munge.key"
    mungekey --create --keyfile="$MUNGE_DIR/munge.key" >&2
  fi
  chmod 0400 "$MUNGE_DIR/munge.key"
  rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock" "$MUNGE_PID"
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

# One try at slurmctld + slurmd on the given ports. Returns 0 when the node is idle, 1 if a port
# was taken (caller retries), and dies on other failures.
start_slurm() {
  local host=$1 ctld_port=$2 slurmd_port=$3 deadline pid
  write_conf "$host" "$ctld_port" "$slurmd_port"
  rm -rf "$DIR/state" "$DIR/spool" "$DIR/tmp"
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log" "$DIR/run" "$DIR/tmp"
  : >"$DIR/plugstack.conf"
  rm -f "$CTLD_PID" "$SLURMD_PID"
  local ctld_log_start slurmd_log_start
  ctld_log_start=$(($(stat -c %s "$DIR/log/slurmctld.log" 2>/dev/null || echo 0) + 1))
  slurmd_log_start=$(($(stat -c %s "$DIR/log/slurmd.log" 2>/dev/null || echo 0) + 1))

  env -i PATH="$PATH" "$MARK" SLURM_CONF="$CONF" slurmctld -f "$CONF" -i 9>&- \
    || die "slurmctld failed to start; see $DIR/log/slurmctld.log"
  env -i PATH="$PATH" "$MARK" SLURM_CONF="$CONF" slurmd -f "$CONF" 9>&- \
    || die "slurmd failed to start; see $DIR/log/slurmd.log"

  deadline=$((SECONDS + START_TIMEOUT))
  while ((SECONDS < deadline)); do
    responding && return 0
    # A daemon that died early: a port grabbed by someone else is worth a retry.
    for pid in "$CTLD_PID" "$SLURMD_PID"; do
      if [[ -s $pid ]] && ! pid_from_file "$pid" >/dev/null; then
        if tail -c "+$ctld_log_start" "$DIR/log/slurmctld.log" 2>/dev/null | grep -q 'Address already in use' ||
          tail -c "+$slurmd_log_start" "$DIR/log/slurmd.log" 2>/dev/null | grep -q 'Address already in use'; then
          return 1
        fi
        tail -n 20 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
        die "$(basename "$pid" .pid) exited during start-up"
      fi
    done
    sleep 0.2
  done
  tail -n 20 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
  sinfo -N -l >&2 || true
  die "node not idle after ${START_TIMEOUT}s"
}

cmd_start() {
  require_installed
  if [[ -n $(marked_pids) ]]; then
    if [[ -n $(pid_from_file "$MUNGE_PID") && -n $(pid_from_file "$CTLD_PID") &&
      -n $(pid_from_file "$SLURMD_PID") ]] && responding; then
      log "a cluster is already running in $DIR; reusing it (use 'restart' for a fresh one)"
      echo "export SLURM_CONF=$CONF"
      return 0
    fi
    log "a broken cluster is left in $DIR; stopping it first"
    cmd_stop >&2
  fi

  local t0=$SECONDS host ctld_port slurmd_port attempt
  host=$(hostname -s)
  # Whatever fails from here on, leave nothing half-started behind.
  trap 'log "start failed; cleaning up"; cmd_stop >&2 || true' EXIT
  start_munged
  for attempt in 1 2 3 4 5; do
    ctld_port=${LOCAL_CLUSTER_CTLD_PORT:-$(free_port)}
    slurmd_port=${LOCAL_CLUSTER_SLURMD_PORT:-$(free_port "$ctld_port")}
    if start_slurm "$host" "$ctld_port" "$slurmd_port"; then
      log "cluster up in $DIR after $((SECONDS - t0))s (node $host, slurmctld port $ctld_port, slurmd port $slurmd_port)"
      trap - EXIT
      echo "export SLURM_CONF=$CONF" >"$DIR/env.sh"
      echo "export SLURM_CONF=$CONF"
      return 0
    fi
    log "port $ctld_port or $slurmd_port was taken; retrying with other ports (attempt $attempt)"
    stop_slurm_daemons
  done
  die "could not start slurmctld/slurmd on free ports"
}

stop_slurm_daemons() {
  local pids=() pid
  for f in "$SLURMD_PID" "$CTLD_PID"; do
    pid=$(pid_from_file "$f" || true)
    [[ -n $pid ]] && pids+=("$pid")
  done
  [[ ${#pids[@]} -eq 0 ]] || signal_and_wait "$STOP_TIMEOUT" "${pids[@]}"
  rm -f "$SLURMD_PID" "$CTLD_PID"
}

cmd_stop() {
  local pids munged_pid jobs
  if [[ -z $(marked_pids) ]]; then
    echo "local-cluster: nothing running in $DIR"
    return 0
  fi
  # 1. Cancel the jobs while slurmctld/slurmd still run, so job processes get SIGTERM the usual way
  #    (a few seconds at most; whatever outlives it is killed below).
  if [[ -n $(pid_from_file "$CTLD_PID") ]]; then
    jobs=$(timeout 10 squeue -h -o %A 2>/dev/null || true)
    if [[ -n $jobs ]]; then
      # shellcheck disable=SC2086
      timeout 10 scancel $jobs 2>/dev/null || true
      for _ in $(seq 30); do   # up to ~3 s; squeue lists pending, running and completing jobs
        [[ -z $(timeout 5 squeue -h -o %A 2>/dev/null || true) ]] && break
        sleep 0.1
      done
    fi
  fi
  # 2. slurmd, slurmctld, slurmstepd and all job processes under them (only this DIR's).
  munged_pid=$(pid_from_file "$MUNGE_PID" || true)
  mapfile -t pids < <(with_descendants $(marked_pids | grep -vxF "${munged_pid:-none}" || true))
  [[ ${#pids[@]} -eq 0 ]] || signal_and_wait "$STOP_TIMEOUT" "${pids[@]}"
  # 3. munged last (slurmd needs it until the end), then anything still carrying the mark.
  mapfile -t pids < <(marked_pids)
  [[ ${#pids[@]} -eq 0 ]] || signal_and_wait "$STOP_TIMEOUT" "${pids[@]}"
  rm -f "$SLURMD_PID" "$CTLD_PID" "$MUNGE_PID" "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
  echo "local-cluster: stopped the cluster in $DIR"
}

cmd_status() {
  local name f pid rc=0
  for name in munged slurmctld slurmd; do
    case $name in munged) f=$MUNGE_PID ;; slurmctld) f=$CTLD_PID ;; slurmd) f=$SLURMD_PID ;; esac
    if pid=$(pid_from_file "$f"); then echo "$name: running (pid $pid)"; else echo "$name: not running"; rc=1; fi
  done
  local stepds
  stepds=$(marked_pids | while read -r p; do grep -l '^slurmstepd' "/proc/$p/comm" 2>/dev/null || true; done | wc -l)
  echo "slurmstepd: $stepds"
  if [[ $rc == 0 ]] && responding; then
    echo "SLURM_CONF=$CONF"
    sinfo -N -o '%N %T %C %m' 2>/dev/null || true
    squeue 2>/dev/null || true
    return 0
  fi
  echo "cluster in $DIR: not usable"
  return 1
}

# Serialise start/stop/status on the same DIR (the daemons are started with fd 9 closed, so the
# lock is released when this script exits).
exec 9>"$DIR/.lock"
flock 9

case $CMD in
  start) cmd_start ;;
  stop) cmd_stop ;;
  restart) cmd_stop >&2; cmd_start ;;
  status) cmd_status ;;
  *) usage ;;
esac
