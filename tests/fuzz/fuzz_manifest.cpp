// Fuzzes the checkpoint manifest reader (src/checkpoint.cpp, read_manifest): the fuzz input is
// written as MANIFEST-000001.json and read back twice, as it is and, when it is a JSON object, with
// its "checksum" member made to match (as a commit writes it), so that the fuzzer gets past the
// checksum to the fields. A damaged manifest may only be refused (false with a reason).
#include <xxhash.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include <fmt/format.h>

#include "src/checkpoint.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using namespace dpstream;
using nlohmann::json;

namespace {

void read_back(const std::string& text) {
  const auto path = fuzz::scratch_dir() / "MANIFEST-000001.json";
  fuzz::write_file(path, text.data(), text.size());
  checkpoint::Manifest m;
  std::string why;
  if (!checkpoint::read_manifest(path, m, why) && why.empty())
    fuzz::property_failed("a refused manifest without a reason");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  read_back(text);
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return 0;
  j.erase("checksum");
  std::string body;
  try {
    body = j.dump();
  } catch (const json::exception&) {  // invalid UTF-8: the reader refuses it the same way
    return 0;
  }
  j["checksum"] = fmt::format("{:016x}", XXH3_64bits(body.data(), body.size()));
  read_back(j.dump(1) + "\n");
  return 0;
}
