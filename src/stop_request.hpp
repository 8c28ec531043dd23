// Clean stop on SIGTERM / SIGUSR1 (SLURM's pre-emption and time-limit warnings): the first signal
// only records itself; the trigger loop agrees on it across ranks after the current trigger, commits
// the checkpoint and returns. A second signal more than DPSTREAM_STOP_REPEAT_SECONDS (default 2)
// after the first terminates the process at once; earlier repeats are the same request arriving
// by two paths (SLURM signals both the ranks and mpirun, which forwards). docs/SLURM.md.
#pragma once

namespace dpstream::stop_request {

// What a first signal stops: a stream job after its current trigger (it commits and exits 5), or a one-shot release
// (a query, choose-c) at its end: it may have charged a ledger already, so it finishes and writes its output rather
// than die with the budget spent (the command says so when it ends).
enum class Stops { AfterTrigger, AfterRelease };
// Installs the handlers (idempotent). Until then the signals keep their default action.
void install(Stops stops = Stops::AfterTrigger);
// 0, or the first stop signal this process received (async-signal-safe read).
int signal_received();
// The process is ending after an error it has reported: a first stop signal from now on (mpirun's to the other
// ranks once one has exited non-zero) prints nothing, rather than announce a stop that will not come; a second one
// later than the repeat window still aborts a process stuck on its way out.
void ending();
// The signal's name for log lines ("SIGTERM", "SIGUSR1").
const char* signal_name(int signo);

}  // namespace dpstream::stop_request
