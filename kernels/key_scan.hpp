// Which keys DP key selection visits at a trigger (kernels/dp_release.hpp): the keys that can change
// (those of the micro-batch and those whose predicted release is due, DP-SQLP Algorithm 4), or every
// tracked key (the verification switch). The output is the same.
#pragma once

namespace dpstream::kernels {
enum class KeyScan { Predicted, Full };
}
