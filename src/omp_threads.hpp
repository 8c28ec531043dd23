// Threads per rank when the user does not say: OpenMP's own default is one thread per CPU the
// process may run on, which oversubscribes the node when mpirun or srun binds nothing (every rank
// then starts one thread per core of the node).
#pragma once

#include "shuffle/comm.hpp"

namespace dpstream {

// Without OMP_NUM_THREADS (or with a value OpenMP would not accept): the CPUs this rank may run on,
// at most the CPUs the node's ranks may use together divided by the ranks on the node (at least 1).
// A collective (every rank calls it, whatever its environment). Returns the threads per rank now in
// effect.
int choose_threads_per_rank(const shuffle::Comm& comm);

}  // namespace dpstream
