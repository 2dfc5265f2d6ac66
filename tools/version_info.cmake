# Writes OUT (tools' version_info.h) for `batchgen --version`: the version, the git commit of SOURCE_DIR (+ "-dirty"
# with uncommitted changes) and the CUDA architectures. Run at every build; the file is rewritten only when it changes.
execute_process(COMMAND git -C "${SOURCE_DIR}" rev-parse --short=12 HEAD OUTPUT_VARIABLE commit
                OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR commit STREQUAL "")
  set(commit "unknown (not a git checkout)")
else()
  execute_process(COMMAND git -C "${SOURCE_DIR}" status --porcelain --untracked-files=no OUTPUT_VARIABLE dirty
                  OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(NOT dirty STREQUAL "")
    set(commit "${commit}-dirty")
  endif()
endif()
set(text "#pragma once\n#define BG_VERSION_STRING \"${VERSION}\"\n#define BG_GIT_COMMIT \"${commit}\"\n#define BG_CUDA_ARCHS \"${CUDA_ARCHS}\"\n")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
endif()
if(NOT old STREQUAL text)
  file(WRITE "${OUT}" "${text}")
endif()
