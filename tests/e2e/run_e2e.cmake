# Runs one node:test file of tests/e2e against the built batchgen (CTest tests `e2e_serve`, `e2e_reliability`).
# The npm packages must already be installed (scripts/install-npm.sh, run by scripts/install-deps.sh): this never
# touches the network. Inputs: NODE, BATCHGEN, SRC_DIR (tests/e2e), TEST_FILE, WORK_DIR (scratch, the cwd).
if(NOT NODE OR NOT EXISTS "${NODE}")
  message(FATAL_ERROR "e2e: node was not found. Install Node.js >= 20 (scripts/install-deps.sh), then re-run cmake.")
endif()
execute_process(COMMAND "${NODE}" --version OUTPUT_VARIABLE node_version OUTPUT_STRIP_TRAILING_WHITESPACE)
if(node_version VERSION_LESS "v20")
  message(FATAL_ERROR "e2e: node ${node_version} is too old; Node.js >= 20 is required")
endif()
if(NOT EXISTS "${BATCHGEN}")
  message(FATAL_ERROR "e2e: the batchgen binary ${BATCHGEN} does not exist; build the `batchgen` target first")
endif()
if(NOT EXISTS "${SRC_DIR}/node_modules/.batchgen-installed")
  message(FATAL_ERROR "e2e: the npm packages of ${SRC_DIR} are not installed: run scripts/install-npm.sh (the setup "
                      "step; ctest never fetches packages)")
endif()
if(DEFINED REF_MODULES)
  set(ENV{BG_REF_MODULES} "${REF_MODULES}")  # e2e_templates: @huggingface/jinja + tokenizers
endif()
file(MAKE_DIRECTORY "${WORK_DIR}")
set(ENV{BATCHGEN} "${BATCHGEN}")
if(SERVE_ARGS)  # extra `serve` flags, e.g. a rank set (CTest e2e_serve_dp2_ep2)
  set(ENV{BG_E2E_SERVE_ARGS} "${SERVE_ARGS}")
endif()
# The test file stays in SRC_DIR so its imports resolve from SRC_DIR/node_modules.
execute_process(COMMAND "${NODE}" --test --test-concurrency=1 "${SRC_DIR}/${TEST_FILE}" WORKING_DIRECTORY "${WORK_DIR}"
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "e2e: node --test ${TEST_FILE} failed (${rc})")
endif()
