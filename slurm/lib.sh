# Shared by the sbatch scripts in slurm/ (sourced, not run). Layout comes from SLURM:
#   ranks   = SLURM_NTASKS (sbatch -n; the scripts' #SBATCH --ntasks wins over --ntasks-per-node x -N)
#   threads = SLURM_CPUS_PER_TASK (sbatch -c), exported as OMP_NUM_THREADS
# Settings (environment, all optional):
#   DPSTREAM_HOME      the dpstream checkout (default: the submit directory, else this file's parent)
#   DPSTREAM_BIN       the binary (default: $DPSTREAM_HOME/build/src/dpstream, else dpstream on PATH)
#   DPSTREAM_LAUNCHER  mpirun (default) or srun; DPSTREAM_SRUN_MPI sets srun --mpi (default pmix)
#   DPSTREAM_STOP_GRACE seconds mpirun waits for ranks to stop cleanly after a SIGTERM before it
#                      kills them (default 5; longer than one bounding batch plus one commit, below the
#                      cluster's KillWait, 30 s by default). mpirun also waits twice this long
#                      after a rank exits non-zero, e.g. 5 on a clean stop.
#   DPSTREAM_SRUN_WAIT seconds srun lets the other ranks run after the first one ended before it kills them
#                      (srun --wait; default 60; 0: no limit). Ranks end within moments of each other when
#                      they finish or stop cleanly; a rank that died alone (OOM kill, SIGBUS on a shrunk
#                      input: exit 3) can leave the others blocked in a collective until the time limit.
#   DPSTREAM_USR1_GRACE whole seconds after the launch before a SIGUSR1 is passed on (default 10): earlier,
#                      mpirun / srun or the ranks may not have installed their handlers yet and die of
#                      it (exit 138) or drop it; a SIGUSR1 in that time is held and passed on once it is up.

dpstream_log() { printf '[%s] slurm/%s: %s\n' "$(date +%H:%M:%S)" "${DPSTREAM_SCRIPT:-lib.sh}" "$*" >&2; }

dpstream_setup() {
  DPSTREAM_GOT_USR1=0
  dpstream_record_signals
  if [[ -z ${SLURM_JOB_ID:-} ]]; then
    dpstream_log "not inside a SLURM job: submit with sbatch (see docs/SLURM.md)"
    exit 2
  fi
  if [[ -z ${DPSTREAM_HOME:-} ]]; then
    if [[ -x ${SLURM_SUBMIT_DIR:-}/build/src/dpstream ]]; then
      DPSTREAM_HOME=$SLURM_SUBMIT_DIR
    else
      DPSTREAM_HOME=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    fi
  fi
  if [[ -z ${DPSTREAM_BIN:-} ]]; then  # a build in the checkout, else an installed dpstream on PATH
    DPSTREAM_BIN=$DPSTREAM_HOME/build/src/dpstream
    [[ -x $DPSTREAM_BIN ]] || DPSTREAM_BIN=$(command -v dpstream || echo "$DPSTREAM_BIN")
  fi
  if [[ ! -x $DPSTREAM_BIN ]]; then
    dpstream_log "dpstream binary not found at $DPSTREAM_BIN nor on PATH: build it (bash cmake/build.sh), install it (cmake --install build --prefix PREFIX) or set DPSTREAM_BIN / DPSTREAM_HOME"
    exit 2
  fi
  DPSTREAM_RANKS=${SLURM_NTASKS:-1}
  # A script's #SBATCH --ntasks takes precedence over sbatch --ntasks-per-node (which then only caps a node's
  # share): with -N 2 --ntasks-per-node=4 the job gets the script's 2 ranks, not 8.
  local per_node=${SLURM_NTASKS_PER_NODE:-} nodes=${SLURM_JOB_NUM_NODES:-1}
  if [[ $per_node =~ ^[0-9]+$ && $nodes =~ ^[0-9]+$ ]] && ((DPSTREAM_RANKS < per_node * nodes)); then
    dpstream_log "warning: $DPSTREAM_RANKS rank(s), fewer than --ntasks-per-node=$per_node x $nodes node(s): a script's #SBATCH --ntasks (or -n) takes precedence over --ntasks-per-node, which only caps a node's share; for $((per_node * nodes)) ranks submit with -n $((per_node * nodes))"
  fi
  export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-${OMP_NUM_THREADS:-1}}
  # Open MPI as root (containers, test clusters), more ranks than cores (oversubscribed tests), no
  # binding (ranks run OpenMP threads) and OMP_NUM_THREADS passed to every rank. Set as OMPI_MCA_*
  # variables, not flags: other MPIs ignore them (MPICH's mpirun passes the environment and does not bind).
  export OMPI_ALLOW_RUN_AS_ROOT=${OMPI_ALLOW_RUN_AS_ROOT:-1} OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}
  export OMPI_MCA_rmaps_base_oversubscribe=${OMPI_MCA_rmaps_base_oversubscribe:-1}
  export OMPI_MCA_hwloc_base_binding_policy=${OMPI_MCA_hwloc_base_binding_policy:-none}
  export OMPI_MCA_mca_base_env_list=${OMPI_MCA_mca_base_env_list:-OMP_NUM_THREADS}
  # mpirun answers a SIGTERM by killing its ranks after this many seconds: long enough for the
  # ranks (which get the SIGTERM too) to finish their trigger and commit.
  export OMPI_MCA_odls_base_sigkill_timeout=${DPSTREAM_STOP_GRACE:-5}
  dpstream_log "job $SLURM_JOB_ID${SLURM_ARRAY_TASK_ID:+ (array task $SLURM_ARRAY_TASK_ID)}: $DPSTREAM_RANKS rank(s) x $OMP_NUM_THREADS thread(s) on ${SLURM_JOB_NUM_NODES:-1} node(s) [${SLURM_JOB_NODELIST:-?}], restart ${SLURM_RESTART_COUNT:-0}, launcher ${DPSTREAM_LAUNCHER:-mpirun}"
}

# Runs `dpstream ARGS...` on every task of the allocation and returns its exit code. A SIGUSR1
# reaching the batch shell (sbatch --signal=B:USR1@secs, scancel --signal=USR1 --batch) is passed
# on to mpirun or srun, which forward it to every rank: the engine then stops after its current
# trigger with the checkpoint committed and exits 5. DPSTREAM_GOT_USR1=1 afterwards says the stop
# was asked for this way (a time-limit warning: requeue), not by a cancel.
# A SIGUSR1 in the first DPSTREAM_USR1_GRACE seconds after the launch is held until they are over, then
# passed on once: mpirun / srun install their handlers a moment after they start, and so do the ranks
# (whose default action for SIGUSR1 is to terminate): passed on at once, it could kill them (mpirun
# exits 138, nothing is committed, the job is not requeued) or be lost (srun took it without passing
# it on, in a test). Held, it gives the same clean stop, a few seconds later. A SIGTERM before the held
# SIGUSR1 is due cancels it: the ranks stop on the SIGTERM, and a stop signal more than 2 s after the
# first counts as a second one (the ranks abort).
# A SIGUSR1 that came before the launch (dpstream_setup's trap recorded it) starts nothing: passed to
# a launcher that has not installed its handlers yet it would kill it (exit 138). It returns 5 with
# DPSTREAM_LAUNCHED=0: a clean stop with nothing to commit (nothing ran, nothing was lost), so a
# requeueing script requeues and its next run starts (or resumes) as this one would have.
# Exit 5 also when the launcher itself died of the SIGTERM that SLURM sends to every process of the
# job (mpirun then exits 1, and stops relaying the ranks' output) but rank 0 printed dpstream's stop
# line (src/engine.cpp, Engine::stopped): it prints it only after the stop's commit is durable, so a
# failure cannot produce it. Rank 0 is started as `bash -c 'exec dpstream ... 2> >(tee ...)'`:
# its stderr still goes to the launcher (the job's output) and, through a tee that ignores SIGTERM,
# straight to a private temporary file on the node, which is searched for that line.
dpstream_launch() {
  local launcher=${DPSTREAM_LAUNCHER:-mpirun} srun_wait=${DPSTREAM_SRUN_WAIT:-60} grace=${DPSTREAM_USR1_GRACE:-10}
  DPSTREAM_LAUNCHED=0
  case $launcher in
    mpirun | srun) ;;
    *)
      dpstream_log "DPSTREAM_LAUNCHER=$launcher: use mpirun or srun"
      return 2
      ;;
  esac
  if ! command -v "$launcher" > /dev/null; then
    dpstream_log "$launcher not found on PATH: load the MPI your dpstream was built with (e.g. module load openmpi), or set DPSTREAM_LAUNCHER"
    return 2
  fi
  if [[ $launcher == srun && ! $srun_wait =~ ^[0-9]+$ ]]; then
    dpstream_log "DPSTREAM_SRUN_WAIT=$srun_wait: whole seconds (0: no limit)"
    return 2
  fi
  if [[ ! $grace =~ ^[0-9]+$ ]]; then
    dpstream_log "DPSTREAM_USR1_GRACE=$grace: whole seconds (0: pass a SIGUSR1 on at once)"
    return 2
  fi
  grace=$((10#$grace))
  if ((DPSTREAM_GOT_USR1)); then
    dpstream_log "SIGUSR1 arrived before the launch: dpstream not started (nothing ran, nothing to commit); exit 5, a clean stop"
    return 5
  fi
  # Rank 0's stderr, copied to a private file by a tee of its own that ignores SIGTERM and SIGUSR1 (they
  # reach every process of the job) and SIGPIPE (-p: mpirun stops reading after its SIGTERM).
  local errlog
  if ! errlog=$(mktemp "${TMPDIR:-/tmp}/dpstream-stderr.XXXXXX"); then
    dpstream_log "no temporary file for dpstream's stderr: a launcher killed by SIGTERM will count as a failure"
    errlog=/dev/null
  fi
  # Rank 0 alone (it prints the stop line): other ranks, maybe on other nodes whose TMPDIR lacks the file, write
  # their stderr to the launcher only (no copy of raw-data-derived lines left behind there).
  local rank_cmd=(bash -c 'f=$1; shift
    r=${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-${SLURM_PROCID:-0}}}
    [ "$r" = 0 ] || exec "$@"
    umask 077
    exec "$@" 2> >(trap "" TERM USR1; exec tee -p -a "$f" >&2)' dpstream-rank "$errlog" "$DPSTREAM_BIN" "$@")
  DPSTREAM_LAUNCHED=1
  local launched_ms
  launched_ms=$(dpstream_now_ms)
  case $launcher in
    mpirun)
      mpirun -np "$DPSTREAM_RANKS" "${rank_cmd[@]}" &
      ;;
    srun)
      # --kill-on-bad-exit=0: a rank that ends with a non-zero code (5 after a clean stop) must not make
      # srun kill the others while they still commit (the cluster's KillOnBadExit may say so).
      # --wait: but once any rank has ended, for whatever reason, srun kills the others after
      # DPSTREAM_SRUN_WAIT seconds. Ranks that finish or stop cleanly end within moments of each other
      # (they end with collective operations); a rank that died alone (OOM kill, exit 3 on a shrunk
      # input) can leave the others blocked in a collective, without --wait until the time limit (Open
      # MPI over PMIx often notices the lost peer and aborts, other MPIs and transports may not). Both
      # are needed: --kill-on-bad-exit=1 would take precedence over --wait and kill at once.
      srun --mpi="${DPSTREAM_SRUN_MPI:-pmix}" --kill-on-bad-exit=0 --wait="$srun_wait" \
        -n "$DPSTREAM_RANKS" -c "$OMP_NUM_THREADS" "${rank_cmd[@]}" &
      ;;
  esac
  local child=$! code signalled=0 got_term=0 usr1_held=0 in_grace=$((grace > 0))
  # USR1 reaches the batch shell alone: pass it on (_dpstream_launch_usr1: at once, or held until the
  # grace period is over). SIGTERM (time limit, scancel, pre-emption) reaches every process of the
  # job, ranks included: passing it on would be a second signal; just keep waiting for the stop.
  trap _dpstream_launch_usr1 USR1
  trap 'signalled=1 got_term=1; dpstream_log "SIGTERM: every rank got it too; waiting for dpstream to stop after its current bounding batch"' TERM
  # A SIGUSR1 between the start of the launcher and the trap above was only recorded
  # (dpstream_record_signals): DPSTREAM_GOT_USR1 was 0 before the launch.
  if ((DPSTREAM_GOT_USR1)); then
    _dpstream_launch_usr1
  fi
  # The grace period: poll the launcher rather than `wait` for it, so that a held SIGUSR1 is passed on
  # when the period ends (a trap runs between commands: one run just before a `wait` would be stuck in it
  # until the launcher ends). in_grace is cleared here alone: a SIGUSR1 whose trap runs before that is
  # held, and passed on just below; one whose trap runs after it is passed on by the trap.
  local grace_until=$((launched_ms + grace * 1000))
  while ((in_grace)) && kill -0 "$child" 2>/dev/null; do
    if (($(dpstream_now_ms) < grace_until)); then
      sleep 0.1 || true  # SLURM's SIGTERM reaches it too
      continue
    fi
    in_grace=0
    if ((usr1_held && got_term)); then
      dpstream_log "not passing the held SIGUSR1 on: a SIGTERM came meanwhile; the ranks stop on it (a SIGUSR1 now would count as a second signal and abort them)"
    elif ((usr1_held)); then
      dpstream_log "passing the held SIGUSR1 on: asking dpstream to stop after its current bounding batch"
      kill -USR1 "$child" 2>/dev/null || true
    fi
  done
  if ((in_grace && usr1_held)); then
    dpstream_log "$launcher ended within the grace period: the held SIGUSR1 was not passed on"
  fi
  in_grace=0
  # `wait` returns early (status > 128) when a trapped signal arrives: wait again until the launcher ends.
  while true; do
    signalled=0 code=0
    wait "$child" || code=$?
    ((signalled)) || break
    kill -0 "$child" 2>/dev/null && continue
    code=0
    wait "$child" || code=$?  # it ended just after the signal: its own status
    break
  done
  dpstream_record_signals
  if [[ $errlog != /dev/null ]]; then
    local line= i
    for ((i = 0; i < 20 && code != 0 && code != 5; i++)); do  # rank 0's tee may still be writing: up to 2 s
      line=$(grep -E -m1 '^dpstream: stopped (cleanly )?on SIG[A-Z0-9]+ \(first seen by rank [0-9]+\) ' "$errlog" || true)
      [[ -n $line ]] && break
      sleep 0.1
    done
    if [[ -n $line ]]; then
      local after=
      ((got_term)) && after=" after the SIGTERM"
      dpstream_log "$launcher exited with code $code$after, but dpstream's ranks stopped cleanly: exit 5. Rank 0 said: $line"
      code=5
    fi
    rm -f "$errlog"
  fi
  return "$code"
}

# dpstream_launch's SIGUSR1 trap. It runs inside dpstream_launch, on its locals: sets signalled and
# usr1_held, reads in_grace, child, launcher, launched_ms and grace. Passes the signal on to the
# launcher or, during the grace period after the launch, holds it (dpstream_launch passes it on when
# the period ends); repeats while one is held are the same request.
_dpstream_launch_usr1() {
  DPSTREAM_GOT_USR1=1
  signalled=1
  if ((in_grace && usr1_held)); then
    dpstream_log "SIGUSR1 again: the first one is held, to be passed on ${grace} s after the launch"
  elif ((in_grace)); then
    usr1_held=1
    local age_ms
    age_ms=$(($(dpstream_now_ms) - launched_ms))
    dpstream_log "SIGUSR1 $((age_ms / 1000)).$(printf %03d $((age_ms % 1000))) s after the launch: held until ${grace} s after it (DPSTREAM_USR1_GRACE), then passed on: $launcher and the ranks may not have installed their handlers yet (it would kill them)"
  else
    dpstream_log "SIGUSR1: asking dpstream to stop after its current bounding batch"
    kill -USR1 "$child" 2>/dev/null || true
  fi
}

# Milliseconds since the epoch: bash 5's EPOCHREALTIME (its digits: seconds and microseconds, whatever
# the locale's decimal point), else GNU date (bash 4).
dpstream_now_ms() {
  if [[ -n ${EPOCHREALTIME:-} ]]; then
    local us=${EPOCHREALTIME//[!0-9]/}
    echo $((10#$us / 1000))
  else
    date +%s%3N
  fi
}

# Outside dpstream_launch a SIGUSR1 or SIGTERM must not kill the batch shell: record it.
dpstream_record_signals() {
  trap 'DPSTREAM_GOT_USR1=1; dpstream_log "SIGUSR1 recorded"' USR1
  trap 'dpstream_log "SIGTERM recorded"' TERM
}

# Logs a failed dpstream exit code with what it means (src/main.cpp), plus an optional note.
dpstream_log_failure() {
  dpstream_log "dpstream exited with code $1 (1 unexpected, 2 job spec, 3 input, 4 checkpoint: see the log above)${2:+; $2}"
}

# True when DIR holds a checkpoint to continue from (a started job: --resume, not a new run): a
# MANIFEST-<commit>.json, commit 0 or later.
# A commit is its manifest (docs/CHECKPOINTS.md): job.h5 alone (a start killed before commit 0) cannot be
# resumed (--resume is refused, exit 4), while a run without --resume starts the job over.
dpstream_has_checkpoint() { compgen -G "$1/checkpoint/MANIFEST-[0-9]*.json" > /dev/null; }
