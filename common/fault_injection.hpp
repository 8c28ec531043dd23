// Fault injection for the kill-and-resume tests: DPSTREAM_FAULT="<point>@<hit>:<rank>[:<signal>]"
// makes rank <rank> (default 0) send itself <signal> (KILL, the default; TERM or USR1 to test the
// clean stop; STOP to hold it there until a SIGCONT) the <hit>-th time (default 1) it reaches fault point <point>.
// Unset, a fault point costs one relaxed atomic load. The points are listed in docs/CHECKPOINTS.md.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace dpstream::fault {

struct Plan {
  std::string point;
  std::uint64_t hit = 1;
  int rank = 0;
  int signal = SIGKILL;
};

// Parses DPSTREAM_FAULT (throws std::invalid_argument with the expected form).
inline bool parse_plan(const char* text, Plan& plan) {
  if (!text || !*text) return false;
  const std::string s(text);
  const auto at = s.find('@'), colon = s.find(':');
  const auto colon2 = colon == std::string::npos ? colon : s.find(':', colon + 1);
  plan.point = s.substr(0, std::min(at, colon));
  bool ok = true;
  try {
    if (at != std::string::npos)
      plan.hit = std::stoull(s.substr(at + 1, colon == std::string::npos ? colon : colon - at - 1));
    if (colon != std::string::npos)
      plan.rank = std::stoi(s.substr(colon + 1, colon2 == std::string::npos ? colon2 : colon2 - colon - 1));
  } catch (const std::exception&) {
    ok = false;
  }
  if (colon2 != std::string::npos) {
    const std::string name = s.substr(colon2 + 1);
    plan.signal = name == "KILL"   ? SIGKILL
                  : name == "TERM" ? SIGTERM
                  : name == "USR1" ? SIGUSR1
                  : name == "STOP" ? SIGSTOP
                                   : 0;
  }
  if (!ok || plan.point.empty() || plan.hit == 0 || plan.rank < 0 || plan.signal == 0)
    throw std::invalid_argument("DPSTREAM_FAULT='" + s +
                                "': expected <point>[@<hit>][:<rank>[:KILL|TERM|USR1|STOP]], e.g. shuffle_user@3:1");
  return true;
}

namespace detail {
inline std::atomic<bool> armed{false};
inline Plan plan;
inline std::atomic<std::uint64_t> hits{0};
}  // namespace detail

// Reads DPSTREAM_FAULT on this rank (once, at start-up, before any fault point is reached).
inline void arm_from_environment(int rank) {
  Plan p;
  // NOLINTNEXTLINE(concurrency-mt-unsafe): read once at start-up, before any other thread exists
  const char* text = std::getenv("DPSTREAM_FAULT");
  if (!parse_plan(text, p) || p.rank != rank) return;
  detail::plan = p;
  detail::armed.store(true, std::memory_order_release);
}

// A place where a crash (or a stop signal) must be survivable. Thread-safe; the signal goes to the
// whole process, not the thread.
inline void point(const char* name) {
  if (!detail::armed.load(std::memory_order_acquire) || detail::plan.point != name) return;
  if (detail::hits.fetch_add(1) + 1 == detail::plan.hit) ::kill(::getpid(), detail::plan.signal);
}

}  // namespace dpstream::fault
