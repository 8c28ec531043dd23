// Clean stop on SIGTERM / SIGUSR1 (SLURM's pre-emption and time-limit warnings): the first signal
// only records itself; the trigger loop agrees on it across ranks after the current trigger, commits
// the checkpoint and returns. A second signal terminates the process at once (docs/SLURM.md).
#pragma once

namespace dpstream::stop_request {

// Installs the handlers (idempotent). Until then the signals keep their default action.
void install();
// 0, or the first stop signal this process received (async-signal-safe read).
int signal_received();
// The signal's name for log lines ("SIGTERM", "SIGUSR1").
const char* signal_name(int signo);
// Tests: forget a recorded signal and re-arm the handlers.
void reset_for_test();

}  // namespace dpstream::stop_request
