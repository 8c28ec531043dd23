// Typed errors: each carries a message that says what to change.
#pragma once

#include <string.h>  // GNU strerror_r (g++ defines _GNU_SOURCE)
#include <stdexcept>
#include <string>
#include <string_view>

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

// `text` as a terminal should get it: control bytes other than line breaks and tabs, DEL, and the UTF-8 forms of the
// C1 controls (U+0080..U+009F; U+009B opens an escape sequence on some terminals) written as \xNN, so that text from
// an input, a query or a path in a message cannot drive the user's terminal. `line_breaks` false: \n and \t too.
inline std::string terminal_safe(std::string_view text, bool line_breaks = true) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  const auto escape = [&out](unsigned char b) { out.append({'\\', 'x', kHex[b >> 4], kHex[b & 15]}); };
  for (std::size_t i = 0; i < text.size(); ++i) {
    const auto b = static_cast<unsigned char>(text[i]);
    const bool kept_break = line_breaks && (b == '\n' || b == '\t');
    if ((b < 0x20 && !kept_break) || b == 0x7f) {
      escape(b);
    } else if (b == 0xc2 && i + 1 < text.size() && static_cast<unsigned char>(text[i + 1]) >= 0x80 &&
               static_cast<unsigned char>(text[i + 1]) <= 0x9f) {
      escape(b);
      escape(static_cast<unsigned char>(text[++i]));
    } else {
      out += text[i];
    }
  }
  return out;
}

}  // namespace dpstream
