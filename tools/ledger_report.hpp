// `dpstream ledger show | explain`: a budget ledger's blocks as text or JSON (src/ledger.hpp).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "src/ledger.hpp"

namespace dpstream {

// show: per block, what is spent and what remains; explain: also every charge (job, time,
// mechanism, rho or (epsilon, delta)) and how the block's total is composed.
nlohmann::json ledger_json(const std::string& path, const ledger::Ledger& book, bool explain);
std::string ledger_text(const std::string& path, const ledger::Ledger& book, bool explain);

}  // namespace dpstream
