# CTest fixture tokenizer_js_reference (cmake -P): copies this node project into OUT_DIR, runs `npm ci` (the npm
# cache is used first) and generate.mjs over CORPUS, so OUT_DIR holds o200k_base/tiktoken.model and
# o200k_expected.json for the C++ JsTiktoken tests. Fails with a clear message when node or npm is missing.
foreach(var SOURCE_DIR CORPUS OUT_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_reference.cmake: pass -D${var}=...")
  endif()
endforeach()
find_program(NODE_EXE node)
find_program(NPM_EXE npm)
if(NOT NODE_EXE OR NOT NPM_EXE)
  message(FATAL_ERROR "tokenizer_js_reference: node and npm are required to build the js-tiktoken reference data "
                      "(Node.js 20 + npm; scripts/install-deps.sh installs them). node='${NODE_EXE}' npm='${NPM_EXE}'")
endif()
file(MAKE_DIRECTORY "${OUT_DIR}")
file(COPY "${SOURCE_DIR}/package.json" "${SOURCE_DIR}/package-lock.json" "${SOURCE_DIR}/generate.mjs"
     DESTINATION "${OUT_DIR}")
execute_process(COMMAND "${NPM_EXE}" ci --prefer-offline --no-audit --no-fund WORKING_DIRECTORY "${OUT_DIR}"
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "tokenizer_js_reference: `npm ci` failed in ${OUT_DIR} (exit ${rc}); the registry or an npm "
                      "cache holding js-tiktoken (see package-lock.json) is needed")
endif()
execute_process(COMMAND "${NODE_EXE}" generate.mjs "${CORPUS}" "${OUT_DIR}" WORKING_DIRECTORY "${OUT_DIR}"
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "tokenizer_js_reference: generate.mjs failed (exit ${rc})")
endif()
