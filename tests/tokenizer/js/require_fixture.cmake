# Included by CTest after the discovered GoogleTest cases (directory property TEST_INCLUDE_FILES, see
# tests/CMakeLists.txt): the js-tiktoken comparisons need the data of the tokenizer_js_reference fixture.
foreach(t JsTiktoken.O200kIdsMatch JsTiktoken.O200kSpecialIdsMatch JsTiktoken.O200kRoundTrip)
  set_tests_properties(${t} PROPERTIES FIXTURES_REQUIRED tokenizer_js)
endforeach()
