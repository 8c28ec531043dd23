// Typed errors: each carries a message that says what to change.
#pragma once

#include <stdexcept>
#include <string>
#include <system_error>

namespace dpstream {

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

// The system's text for an errno value; thread-safe, unlike std::strerror (the checkpoint I/O
// thread reports errors beside the trigger loop).
inline std::string errno_text(int err) { return std::generic_category().message(err); }

}  // namespace dpstream
