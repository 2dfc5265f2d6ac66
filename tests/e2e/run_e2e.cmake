# Runs the e2e API tests (CTest test `e2e_serve`): copies the node project into the build tree, `npm ci`, then
# `node --test` against the given batchgen binary. Inputs: NODE, NPM, BATCHGEN, SRC_DIR, WORK_DIR, optional SERVE_ARGS
# (extra `serve` flags, e.g. a rank set).
if(NOT NODE OR NOT EXISTS "${NODE}")
  message(FATAL_ERROR "e2e: node was not found. Install Node.js >= 20 (and npm) to run tests/e2e, then re-run cmake.")
endif()
if(NOT NPM OR NOT EXISTS "${NPM}")
  message(FATAL_ERROR "e2e: npm was not found. Install npm (it comes with Node.js >= 20), then re-run cmake.")
endif()
execute_process(COMMAND "${NODE}" --version OUTPUT_VARIABLE node_version OUTPUT_STRIP_TRAILING_WHITESPACE)
if(node_version VERSION_LESS "v20")
  message(FATAL_ERROR "e2e: node ${node_version} is too old; Node.js >= 20 is required")
endif()
if(NOT EXISTS "${BATCHGEN}")
  message(FATAL_ERROR "e2e: the batchgen binary ${BATCHGEN} does not exist; build the `batchgen` target first")
endif()

file(MAKE_DIRECTORY "${WORK_DIR}")
file(COPY "${SRC_DIR}/package.json" "${SRC_DIR}/package-lock.json" "${SRC_DIR}/serve.test.mjs" DESTINATION "${WORK_DIR}")
execute_process(COMMAND "${NPM}" ci --no-audit --no-fund --prefer-offline WORKING_DIRECTORY "${WORK_DIR}"
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "e2e: `npm ci` failed (${rc}); the npm registry must be reachable on the first run")
endif()
set(ENV{BATCHGEN} "${BATCHGEN}")
if(SERVE_ARGS)
  set(ENV{BG_E2E_SERVE_ARGS} "${SERVE_ARGS}")
endif()
execute_process(COMMAND "${NODE}" --test --test-concurrency=1 serve.test.mjs WORKING_DIRECTORY "${WORK_DIR}"
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "e2e: node --test failed (${rc})")
endif()
