#include "src/stop_request.hpp"

#include <signal.h>
#include <unistd.h>

#include <cstring>

namespace dpstream::stop_request {

namespace {

volatile sig_atomic_t first_signal = 0;
constexpr int kStopSignals[] = {SIGTERM, SIGUSR1};

void write_stderr(const char* text) {  // async-signal-safe
  const ssize_t ignored = ::write(STDERR_FILENO, text, std::strlen(text));
  (void)ignored;
}

void on_signal(int signo) {
  if (first_signal == 0) {
    first_signal = signo;
    write_stderr(signo == SIGTERM ? "dpstream: SIGTERM received: stopping after the current trigger; a second signal aborts\n"
                                  : "dpstream: SIGUSR1 received: stopping after the current trigger; a second signal aborts\n");
    return;
  }
  // Second signal: give up at once with the signal's default action (terminate); the last
  // committed checkpoint stays usable.
  write_stderr("dpstream: second stop signal: aborting now (the last committed checkpoint is kept)\n");
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  ::sigemptyset(&dfl.sa_mask);
  ::sigaction(signo, &dfl, nullptr);
  ::raise(signo);
}

}  // namespace

void install() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  ::sigemptyset(&sa.sa_mask);
  for (int s : kStopSignals) ::sigaddset(&sa.sa_mask, s);  // the two handlers never interleave
  sa.sa_flags = SA_RESTART;                                 // interrupted writes and waits resume
  for (int s : kStopSignals) ::sigaction(s, &sa, nullptr);
}

int signal_received() { return first_signal; }

const char* signal_name(int signo) {
  switch (signo) {
    case SIGTERM: return "SIGTERM";
    case SIGUSR1: return "SIGUSR1";
    default: return "a signal";
  }
}

void reset_for_test() {
  first_signal = 0;
  install();
}

}  // namespace dpstream::stop_request
