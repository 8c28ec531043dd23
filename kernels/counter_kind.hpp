// The continual counter behind a DP-SQLP counter family (docs/PRIVACY.md sections 4 and 5): the
// binary tree with Honaker estimates (kernels/dp_tree.hpp) or the banded-inverse factorization with
// exact normal noise (kernels/banded_counter.hpp).
#pragma once

namespace dpstream::kernels {
enum class CounterKind { Tree, Banded };
}
