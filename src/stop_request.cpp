#include "src/stop_request.hpp"

#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace dpstream::stop_request {

namespace {

// Lock-free atomics are async-signal-safe; a handler may run on any thread of the process.
std::atomic<int> first_signal{0};
std::atomic<long long> first_signal_ns{0};
std::atomic<bool> process_ending{false};
long long repeat_window_ns = 2'000'000'000;  // set before the handlers are installed
Stops stops_at = Stops::AfterTrigger;        // set before the handlers are installed
static_assert(std::atomic<int>::is_always_lock_free && std::atomic<long long>::is_always_lock_free &&
              std::atomic<bool>::is_always_lock_free);
constexpr int kStopSignals[] = {SIGTERM, SIGUSR1};

long long now_ns() {  // clock_gettime is async-signal-safe
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<long long>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

void write_stderr(const char* text) {  // async-signal-safe
  const ssize_t ignored = ::write(STDERR_FILENO, text, std::strlen(text));
  (void)ignored;
}

void on_signal(int signo) {
  int expected = 0;
  if (first_signal.compare_exchange_strong(expected, signo)) {
    first_signal_ns.store(now_ns());
    if (process_ending.load()) return;  // nothing to stop: the process is on its way out with its error
    const bool term = signo == SIGTERM;
    if (stops_at == Stops::AfterTrigger)
      write_stderr(term ? "dpstream: SIGTERM received: stopping after the current trigger; a second signal aborts\n"
                        : "dpstream: SIGUSR1 received: stopping after the current trigger; a second signal aborts\n");
    else
      write_stderr(term ? "dpstream: SIGTERM received: finishing the release first; a second signal aborts\n"
                        : "dpstream: SIGUSR1 received: finishing the release first; a second signal aborts\n");
    return;
  }
  // One request often arrives twice within moments (SLURM signals the rank and mpirun, which
  // forwards it again): repeats inside the window are the same request.
  if (now_ns() - first_signal_ns.load() < repeat_window_ns) return;
  // A later second signal: give up at once with the signal's default action (terminate); the
  // last committed checkpoint stays usable.
  write_stderr("dpstream: second stop signal: aborting now (the last committed checkpoint is kept)\n");
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  ::sigemptyset(&dfl.sa_mask);
  ::sigaction(signo, &dfl, nullptr);
  ::raise(signo);
}

}  // namespace

void install(Stops stops) {
  stops_at = stops;
  // Tests: a shorter window. NOLINTNEXTLINE(concurrency-mt-unsafe): read at start-up, before other threads
  if (const char* w = std::getenv("DPSTREAM_STOP_REPEAT_SECONDS"))
    repeat_window_ns = static_cast<long long>(std::strtod(w, nullptr) * 1e9);
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  ::sigemptyset(&sa.sa_mask);
  for (int s : kStopSignals) ::sigaddset(&sa.sa_mask, s);  // the two handlers never interleave on a thread
  sa.sa_flags = SA_RESTART;                                // interrupted writes and waits resume
  for (int s : kStopSignals) ::sigaction(s, &sa, nullptr);
}

int signal_received() { return first_signal.load(); }

void ending() { process_ending.store(true); }

const char* signal_name(int signo) {
  switch (signo) {
    case SIGTERM:
      return "SIGTERM";
    case SIGUSR1:
      return "SIGUSR1";
    default:
      return "a signal";
  }
}

}  // namespace dpstream::stop_request
