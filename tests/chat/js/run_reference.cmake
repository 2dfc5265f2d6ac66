# CTest fixture hf_reference (cmake -P): writes random checkpoints of the three chat-template layouts with
# `batchgen make-random` (DeepSeek-V3.1 and DeepSeek-V3: tokenizer.json; Kimi-K2: tiktoken.model) into OUT_DIR, then
# runs generate.mjs with the node_modules that scripts/install-npm.sh installed in SOURCE_DIR (nothing is fetched
# here), so OUT_DIR/expected.json holds @huggingface/tokenizers' ids and @huggingface/jinja's prompts.
foreach(var BATCHGEN SOURCE_DIR OUT_DIR CORPUS EXTRA_CORPUS CASES)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_reference.cmake: pass -D${var}=...")
  endif()
endforeach()
find_program(NODE_EXE node)
if(NOT NODE_EXE)
  message(FATAL_ERROR "hf_reference: node is required (Node.js >= 20; scripts/install-deps.sh installs it)")
endif()
foreach(pkg jinja tokenizers)
  if(NOT EXISTS "${SOURCE_DIR}/node_modules/@huggingface/${pkg}/package.json")
    message(FATAL_ERROR "hf_reference: ${SOURCE_DIR}/node_modules/@huggingface/${pkg} is missing: run "
                        "scripts/install-npm.sh (the setup step, run by scripts/install-deps.sh); tests never fetch packages")
  endif()
endforeach()
if(NOT EXISTS "${BATCHGEN}")
  message(FATAL_ERROR "hf_reference: ${BATCHGEN} does not exist; build the `batchgen` target first")
endif()
file(MAKE_DIRECTORY "${OUT_DIR}")
set(layout_args)
foreach(layout deepseek_v3.1 deepseek_v3 kimi_k2)
  execute_process(COMMAND "${BATCHGEN}" make-random --arch deepseek_v3 --preset tiny --chat-template ${layout}
                          --out "${OUT_DIR}/${layout}" --force RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "hf_reference: make-random --chat-template ${layout} failed (exit ${rc})")
  endif()
  list(APPEND layout_args "${layout}=${OUT_DIR}/${layout}")
endforeach()
execute_process(COMMAND "${NODE_EXE}" "${SOURCE_DIR}/generate.mjs" "${OUT_DIR}" "${CORPUS}" "${EXTRA_CORPUS}" "${CASES}"
                        ${layout_args}
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "hf_reference: generate.mjs failed (exit ${rc})")
endif()
