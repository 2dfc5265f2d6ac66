# CTest fixture tokenizer_js_reference (cmake -P): runs generate.mjs (from SOURCE_DIR, whose node_modules the setup
# step installed: scripts/install-npm.sh) over CORPUS, so OUT_DIR holds o200k_base/tiktoken.model and
# o200k_expected.json for the C++ JsTiktoken tests. Never touches the network; fails clearly when node or the
# packages are missing.
foreach(var SOURCE_DIR CORPUS OUT_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_reference.cmake: pass -D${var}=...")
  endif()
endforeach()
find_program(NODE_EXE node)
if(NOT NODE_EXE)
  message(FATAL_ERROR "tokenizer_js_reference: node is required to build the js-tiktoken reference data "
                      "(Node.js 20; scripts/install-deps.sh installs it)")
endif()
if(NOT EXISTS "${SOURCE_DIR}/node_modules/.batchgen-installed")
  message(FATAL_ERROR "tokenizer_js_reference: the npm packages of ${SOURCE_DIR} are not installed: run "
                      "scripts/install-npm.sh (the setup step; ctest never fetches packages)")
endif()
file(MAKE_DIRECTORY "${OUT_DIR}")
execute_process(COMMAND "${NODE_EXE}" "${SOURCE_DIR}/generate.mjs" "${CORPUS}" "${OUT_DIR}" WORKING_DIRECTORY "${OUT_DIR}"
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "tokenizer_js_reference: generate.mjs failed (exit ${rc})")
endif()
