# Warning flags and sanitizers as an interface target that every project target links.
add_library(dpstream_warnings INTERFACE)
target_compile_options(dpstream_warnings INTERFACE
  -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion
  -Wnon-virtual-dtor -Wold-style-cast -Woverloaded-virtual -Wnull-dereference -Wimplicit-fallthrough)
if(DPSTREAM_WERROR)
  target_compile_options(dpstream_warnings INTERFACE -Werror)
endif()
if(DPSTREAM_SANITIZE AND DPSTREAM_SANITIZE_THREAD)
  message(FATAL_ERROR "DPSTREAM_SANITIZE and DPSTREAM_SANITIZE_THREAD cannot be combined: use two build directories")
endif()
if(DPSTREAM_SANITIZE)
  target_compile_options(dpstream_warnings INTERFACE -fsanitize=address,undefined -fno-omit-frame-pointer)
  target_link_options(dpstream_warnings INTERFACE -fsanitize=address,undefined)
endif()
if(DPSTREAM_SANITIZE_THREAD)  # data races, e.g. between the checkpoint I/O thread and the trigger loop
  target_compile_options(dpstream_warnings INTERFACE -fsanitize=thread -fno-omit-frame-pointer)
  target_link_options(dpstream_warnings INTERFACE -fsanitize=thread)
endif()
