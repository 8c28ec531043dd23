# Writes the version header (cmake/version.hpp.in) with the source tree's git commit as it is now: run
# at every build (target dpstream_version), so that `cmake --build` after a pull or an edit stamps the
# binary it builds, not the commit of the last configure. The header is rewritten only when its text
# changes, so an unchanged tree recompiles nothing.
# Inputs (-D): SOURCE_DIR, OUTPUT, PROJECT_VERSION, GIT_EXECUTABLE (empty: no git).
set(DPSTREAM_GIT_COMMIT "unknown")
if(GIT_EXECUTABLE AND EXISTS "${SOURCE_DIR}/.git")
  execute_process(COMMAND ${GIT_EXECUTABLE} describe --always --dirty --abbrev=12
                  WORKING_DIRECTORY ${SOURCE_DIR} OUTPUT_VARIABLE commit
                  OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE git_rc)
  if(git_rc EQUAL 0 AND NOT commit STREQUAL "")
    set(DPSTREAM_GIT_COMMIT "${commit}")
  endif()
endif()
configure_file(${SOURCE_DIR}/cmake/version.hpp.in ${OUTPUT}.new @ONLY)
file(COPY_FILE ${OUTPUT}.new ${OUTPUT} ONLY_IF_DIFFERENT)
file(REMOVE ${OUTPUT}.new)
