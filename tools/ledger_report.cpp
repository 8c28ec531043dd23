#include "tools/ledger_report.hpp"
#include "common/printable.hpp"

#include <fmt/format.h>

#include <algorithm>

namespace dpstream {

namespace {
nlohmann::json charge_json(const ledger::Charge& c) {
  nlohmann::json j = {{"seq", c.seq},
                      {"job", c.job},
                      {"run_id", c.run_id},
                      {"at", c.at},
                      {"mechanism", c.mechanism},
                      {"accounting", c.zcdp ? "zcdp" : "approx"},
                      {"epsilon", c.epsilon},
                      {"delta", c.delta}};
  if (c.zcdp) j["rho"] = c.rho, j["failure_one_sided"] = c.delta_extra, j["failure_coupled"] = c.coupled;
  return j;
}

std::string composition_text(const ledger::BlockSpend& b, const ledger::Ceiling& g) {
  if (b.charges.empty()) return "nothing charged";
  if (b.zcdp)
    return fmt::format(
        "zCDP: rho {:.6g} = sum of {} charge(s), failure mass {:.3g} one-sided and {:.3g} coupled; "
        "epsilon {:.6g} = the smallest eps with zcdp_delta(rho, eps) + one-sided + (e^eps + 1) "
        "coupled <= delta_g (Canonne-Kamath-Steinke conversion; docs/LEDGER.md)",
        b.rho, b.charges.size(), b.delta_extra, b.coupled, b.epsilon);
  const bool all_zcdp = std::all_of(b.charges.begin(), b.charges.end(), [](const auto& c) { return c.zcdp; });
  return fmt::format("basic composition of {} charge(s) ({}): epsilon {:.6g}, delta {:.3g}", b.charges.size(),
                     all_zcdp ? "every charge is zCDP, but the sum of their own (epsilon, delta) is the smaller bound"
                              : "not every charge is zCDP",
                     b.epsilon, b.delta);
  (void)g;
}
}  // namespace

nlohmann::json ledger_json(const std::string& path, const ledger::Ledger& book, bool explain) {
  const auto& g = book.ceiling();
  nlohmann::json j = {{"ledger", path},
                      {"ceiling", {{"epsilon", g.epsilon}, {"delta", g.delta}}},
                      {"block_seconds", g.block_seconds},
                      {"blocks", nlohmann::json::array()}};
  if (const auto r = book.retired_through()) j["retired_through"] = *r;
  for (const auto& b : book.blocks()) {
    const auto time = g.block_time(b.block);  // null: outside int64 seconds
    nlohmann::json bj = {{"block", b.block},
                         {"event_time", time ? nlohmann::json{time->first, time->second} : nlohmann::json(nullptr)},
                         {"retired", b.retired},
                         {"charges", b.charges.size()},
                         {"accounting", b.zcdp ? "zcdp" : "basic"},
                         {"epsilon_spent", b.epsilon},
                         {"delta_spent", b.delta},
                         {"epsilon_left", std::max(0.0, b.epsilon_left)},
                         {"delta_left", std::max(0.0, b.delta_left)}};
    if (b.zcdp)
      bj["rho_spent"] = b.rho, bj["failure_one_sided"] = b.delta_extra, bj["failure_coupled"] = b.coupled,
      bj["rho_left"] = b.rho_left;
    if (explain) {
      bj["composition"] = composition_text(b, g);
      bj["charge_list"] = nlohmann::json::array();
      for (const auto& c : b.charges) bj["charge_list"].push_back(charge_json(c));
    }
    j["blocks"].push_back(bj);
  }
  return j;
}

std::string ledger_text(const std::string& path, const ledger::Ledger& book, bool explain) {
  const auto& g = book.ceiling();
  std::string out = fmt::format(
      "ledger {}: ceiling per block (epsilon, delta) = ({:.6g}, {:.3g}); blocks are "
      "event-time windows of {} s\n",
      path, g.epsilon, g.delta, g.block_seconds);
  if (const auto r = book.retired_through()) out += fmt::format("retired: every block <= {}\n", *r);
  const auto blocks = book.blocks();
  if (blocks.empty()) out += "no block has been charged yet\n";
  for (const auto& b : blocks) {
    out += fmt::format(
        "block {} {}{}: {} charge(s), spent epsilon {:.6g}{}, left epsilon {:.6g}{}\n", b.block,
        g.block_time_text(b.block), b.retired ? " (retired)" : "", b.charges.size(), b.epsilon,
        b.zcdp ? fmt::format(" (zCDP rho {:.6g})", b.rho) : fmt::format(", delta {:.3g}", b.delta),
        std::max(0.0, b.epsilon_left),
        b.zcdp ? fmt::format(" (rho {:.6g})", b.rho_left) : fmt::format(", delta {:.3g}", std::max(0.0, b.delta_left)));
    if (!explain) continue;
    out += "  " + composition_text(b, g) + "\n";
    for (const auto& c : b.charges)
      out += fmt::format(
          "  #{} {} job '{}' run {}: {}; {}\n", c.seq, c.at, printable(c.job), c.run_id.substr(0, 12), c.mechanism,
          c.zcdp ? fmt::format("rho {:.6g}, failure mass {:.3g} one-sided, {:.3g} coupled (alone: epsilon "
                               "{:.6g}, delta {:.3g})",
                               c.rho, c.delta_extra, c.coupled, c.epsilon, c.delta)
                 : fmt::format("epsilon {:.6g}, delta {:.3g}", c.epsilon, c.delta));
  }
  return out;
}

}  // namespace dpstream
