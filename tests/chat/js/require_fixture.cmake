# Included by CTest after the discovered GoogleTest cases (TEST_INCLUDE_FILES, tests/CMakeLists.txt): the comparisons
# with @huggingface/tokenizers and @huggingface/jinja need the data of the hf_reference fixture.
foreach(t HfReference.IdsMatchTokenizersJs HfReference.DecodeMatchesTokenizersJs TemplateReference.PromptsMatchJinjaJs
          TemplateReference.IdsMatchTokenizersJs)
  set_tests_properties(${t} PROPERTIES FIXTURES_REQUIRED hf_reference)
endforeach()
