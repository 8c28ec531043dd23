# The kernels layer's sources, relative to this folder: one list for the build (kernels/CMakeLists.txt) and for
# the fuzz project's instrumented copy (tests/fuzz/CMakeLists.txt), so that a new file joins both.
set(DPSTREAM_KERNELS_SOURCES
    bounding.cpp
    key_accumulate.cpp
    cpu_features.cpp
    aes_blocks.cpp
    noise.cpp
    exact_normal.cpp
    banded_counter.cpp
    plain_steps.cpp
    dp_release.cpp
    baseline_release.cpp
    releaser.cpp)
