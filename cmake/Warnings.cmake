# Warning flags and sanitizers as an interface target that every project target links.
add_library(dpstream_warnings INTERFACE)
target_compile_options(dpstream_warnings INTERFACE
  -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion
  -Wnon-virtual-dtor -Wold-style-cast -Woverloaded-virtual -Wnull-dereference -Wimplicit-fallthrough)
if(DPSTREAM_WERROR)
  target_compile_options(dpstream_warnings INTERFACE -Werror)
endif()
if(DPSTREAM_SANITIZE)
  target_compile_options(dpstream_warnings INTERFACE -fsanitize=address,undefined -fno-omit-frame-pointer)
  target_link_options(dpstream_warnings INTERFACE -fsanitize=address,undefined)
endif()
