// Typed errors: each carries a message that says what to change.
#pragma once

#include <string.h>  // GNU strerror_r (g++ defines _GNU_SOURCE)
#include <stdexcept>
#include <string>

namespace dpstream {

// The process's exit codes (README.md): each error kind below has its own.
constexpr int kExitOther = 1;       // unexpected (MPI_Abort)
constexpr int kExitConfig = 2;      // ConfigError
constexpr int kExitInput = 3;       // InputError
constexpr int kExitCheckpoint = 4;  // CheckpointError
constexpr int kExitStopped = 5;     // a clean stop on a signal

// A job spec value or command-line option is wrong.
class ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The input data is missing, unreadable or malformed.
class InputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A checkpoint cannot be used: missing, damaged, from another job, or from a changed job spec.
class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The system's text for an errno value, thread-safe (the checkpoint I/O thread reports errors beside
// the trigger loop): GNU strerror_r writes into our buffer or returns an immutable string, while
// std::strerror (and libstdc++'s error_category::message, which calls it) may share one buffer.
inline std::string errno_text(int err) {
  char buf[256];
  return strerror_r(err, buf, sizeof buf);
}

}  // namespace dpstream
