// Text from outside (a damaged file's bytes, a job name in a ledger) made safe to print on a terminal and to put
// into JSON: every byte outside printable ASCII becomes '?' (no escape sequence reaches the terminal, no line is
// faked).
#pragma once

#include <string>

namespace dpstream {

inline std::string printable(std::string s) {
  for (char& c : s)
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7e) c = '?';
  return s;
}

}  // namespace dpstream
