// libFuzzer target over what a client controls in a request: the body parser (bounded JSON), the request
// validation of both endpoints (normal and --strict-params) and the Kimi-K3 chat renderer with its JSON writers,
// then the chat output parser over the rendered ids. The first byte picks the endpoint and options; the rest is the
// body. An ApiError (a 4xx for the client) or a bg::Error from the renderer (answered as 400) is an accepted
// rejection; any other exception, a sanitizer report or a stack overflow is a bug.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string_view>

#include "core/error.h"
#include "server/frontend/api_error.h"
#include "server/frontend/request_parse.h"
#include "server/frontend/text_model.h"
#include "server/tokenizer/tokenizer_writer.h"

namespace {

std::unique_ptr<bg::frontend::TextModel> g_model;

// The tokenizer files make-random writes (a small Kimi vocabulary) and a K3 config, in a temporary directory.
void load_model() {
  const auto dir = std::filesystem::temp_directory_path() / ("bg_request_fuzz_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  bg::write_tokenizer_files(dir, bg::kimi_tokenizer_layout(1024));
  std::ofstream(dir / "config.json") << R"({"model_type": "kimi_k3"})";
  g_model = bg::frontend::load_text_model(dir.string());
  std::filesystem::remove_all(dir);
}

void run_chat(std::string_view body, const bg::frontend::ParseOptions& opt) {
  bg::frontend::ChatRequest r = bg::frontend::parse_chat_body(body, opt);  // as the server: tools in key order
  std::vector<int32_t> ids;
  try {
    ids = g_model->render_chat(r.messages, r.tools, r.chat);
  } catch (const bg::Error&) {
    return;  // a message the format cannot render: a 400 for the client
  }
  // The output parser must take any id sequence, including the prompt's markers.
  auto parser = g_model->chat_parser(r.chat);
  for (size_t i = 0; i < ids.size() && i < 4096; ++i) parser->push(ids[i]);
  parser->finish();
}

void run_completion(const nlohmann::json& body, const bg::frontend::ParseOptions& opt) {
  bg::frontend::CompletionRequest r = bg::frontend::parse_completion_request(body, opt);
  if (!r.prompt_is_ids) {
    std::vector<int32_t> ids = g_model->encode_prompt(r.prompt_text);
    auto detok = g_model->detokenizer();
    for (int32_t id : ids) detok->push(id);
    detok->flush();
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  load_model();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  bg::frontend::ParseOptions opt;
  opt.strict_params = (mode & 2) != 0;
  try {
    if ((mode & 1) == 0) {
      run_chat(text, opt);
    } else {
      run_completion(bg::frontend::parse_body(text), opt);
    }
  } catch (const bg::frontend::ApiError& e) {
    if (e.status() < 400 || e.status() > 499) {
      std::fprintf(stderr, "request_fuzz: a client error answered with status %d: %s\n", e.status(), e.what());
      std::abort();
    }
  }
  return 0;
}
