// Endpoint handlers: parse + tokenize, run a Generation, answer as one JSON body or an SSE stream.
#include "server/frontend/openai_handlers.h"

#include <fmt/format.h>

#include <atomic>
#include <ctime>
#include <random>

#include "core/error.h"
#include "server/frontend/api_error.h"

namespace bg::frontend {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr std::chrono::milliseconds kKeepAlive{1000};  // idle stream -> an SSE comment, which also detects a gone client

std::string new_request_id(const char* prefix) {
  static const uint64_t process_tag = std::random_device{}() ^ (static_cast<uint64_t>(std::random_device{}()) << 32);
  static std::atomic<uint64_t> counter{0};
  return fmt::format("{}-{:016x}{:08x}", prefix, process_tag, counter.fetch_add(1));
}

void check_model(const ServingContext& ctx, const std::string& model) {
  if (!model.empty() && model != ctx.served_model_name) {
    throw ApiError(404, fmt::format("The model '{}' does not exist (this server serves '{}')", model,
                                    ctx.served_model_name), "model", "model_not_found");
  }
}

// The state a streamed response keeps between calls of the chunked content provider.
struct StreamState {
  std::unique_ptr<Generation> gen;
  ResponseMeta meta;
  ApiKind kind = ApiKind::chat;
  bool include_usage = false;
  std::optional<OutputDelta> pending;  // the first delta, read before the response was committed
  bool first_chunk = true;
  int64_t text_offset = 0;             // bytes of completion text sent (legacy logprobs text_offset)

  std::string chunk(const OutputDelta& d, const std::string& finish_reason) {
    const bool with_lp = gen->logprobs();
    json c = kind == ApiKind::chat ? chat_chunk(meta, d, first_chunk, with_lp, finish_reason)
                                   : completion_chunk(meta, d, with_lp, text_offset, finish_reason);
    text_offset += static_cast<int64_t>(d.text.size());
    first_chunk = false;
    if (include_usage) c["usage"] = nullptr;
    return sse_data(c);
  }

  std::string tail() {
    const OutputAssembler& out = gen->output();
    std::string s;
    if (out.finish_reason() == "error") {
      s += sse_data(error_body(out.error_code(), out.error()));
    }
    if (include_usage) s += sse_data(usage_chunk(meta, kind == ApiKind::chat, gen->usage()));
    return s + sse_done();
  }

  // One provider call: send what is ready (or a keep-alive comment); finish the stream when the generation is done.
  bool pump(httplib::DataSink& sink) {
    std::optional<OutputDelta> d = std::exchange(pending, std::nullopt);
    if (!d) d = gen->next(kKeepAlive);
    if (!d && !gen->done()) return sink.write(": keep-alive\n\n", 14);
    std::string out;
    const bool done = gen->done();
    const std::string finish = done && gen->output().finish_reason() != "error" ? gen->output().finish_reason() : "";
    if (d && (!d->empty() || first_chunk || !finish.empty())) out += chunk(*d, finish);
    if (done) out += tail();
    if (!out.empty() && !sink.write(out.data(), out.size())) return false;
    if (done) sink.done();
    return true;
  }
};

void respond_json(httplib::Response& res, const json& body) { res.set_content(dump_json(body), "application/json"); }

// The finished non-streamed body (an error finish is an ApiError for the caller to answer).
json full_body(Generation& gen, const FullOutput& full, const ResponseMeta& meta, ApiKind kind) {
  const OutputAssembler& out = gen.output();
  if (out.finish_reason() == "error") throw ApiError(out.error_code(), out.error());
  return kind == ApiKind::chat ? chat_response(meta, full, gen.logprobs(), out.finish_reason(), gen.usage())
                               : completion_response(meta, full, gen.logprobs(), out.finish_reason(), gen.usage());
}

// A non-streamed response. Short generations answer as one JSON body with the right status. One still running after
// kKeepAlive commits 200 and sends a space each kKeepAlive while it waits (JSON allows leading whitespace): that write
// is how a client that went away is noticed (cpp-httplib 0.11 exposes no socket state), and the generation is then
// cancelled at once, freeing its KV blocks and state slot. A failure after that point arrives as an OpenAI error
// body under the committed 200.
void respond_full(std::unique_ptr<Generation> gen, const ResponseMeta& meta, ApiKind kind, httplib::Response& res) {
  auto full = std::make_shared<FullOutput>();
  const auto deadline = Clock::now() + kKeepAlive;
  while (!gen->done() && Clock::now() < deadline) {
    if (auto d = gen->next(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()))) {
      full->add(*d);
    }
  }
  if (gen->done()) {
    respond_json(res, full_body(*gen, *full, meta, kind));
    return;
  }
  std::shared_ptr<Generation> g(std::move(gen));
  res.set_chunked_content_provider(
      "application/json",
      [g, full, meta, kind](size_t, httplib::DataSink& sink) {
        if (auto d = g->next(kKeepAlive)) full->add(*d);
        if (!g->done()) return sink.write(" ", 1);
        std::string body;
        try {
          body = dump_json(full_body(*g, *full, meta, kind));
        } catch (const ApiError& e) {
          body = dump_json(e.body());
        }
        if (!sink.write(body.data(), body.size())) return false;
        sink.done();
        return true;
      },
      [g](bool success) {
        if (!success) g->cancel_by_client();
      });
}

void respond_stream(std::unique_ptr<Generation> gen, const ResponseMeta& meta, ApiKind kind, bool include_usage,
                    httplib::Response& res) {
  // Wait for the first event before answering 200, so that a rejection (queue full, too long) is an HTTP error.
  std::optional<OutputDelta> first;
  while (!first && !gen->done()) first = gen->next(kKeepAlive);
  const OutputAssembler& out = gen->output();
  if (out.finish_reason() == "error" && out.completion_tokens() == 0) throw ApiError(out.error_code(), out.error());
  auto st = std::make_shared<StreamState>();
  st->gen = std::move(gen);
  st->meta = meta;
  st->kind = kind;
  st->include_usage = include_usage;
  st->pending = first ? std::move(first) : std::optional<OutputDelta>(OutputDelta{});
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream", [st](size_t, httplib::DataSink& sink) { return st->pump(sink); },
      [st](bool success) {
        if (!success) st->gen->cancel_by_client();
      });
}

void run(ServingContext& ctx, GenerationInput in, const char* id_prefix, Clock::time_point arrival,
         httplib::Response& res) {
  const ApiKind kind = in.kind;
  const bool stream = in.common.stream;
  const bool include_usage = in.common.include_usage;
  ResponseMeta meta{new_request_id(id_prefix), ctx.served_model_name, static_cast<int64_t>(std::time(nullptr))};
  auto gen = std::make_unique<Generation>(ctx, std::move(in), meta.id, arrival);
  if (stream) {
    respond_stream(std::move(gen), meta, kind, include_usage, res);
  } else {
    respond_full(std::move(gen), meta, kind, res);
  }
}

}  // namespace

void handle_chat_completions(ServingContext& ctx, const httplib::Request& req, httplib::Response& res) {
  const auto arrival = Clock::now();
  ChatRequest r = parse_chat_request(parse_body(req.body));
  check_model(ctx, r.common.model);
  GenerationInput in;
  in.kind = ApiKind::chat;
  try {
    in.prompt = ctx.model.render_chat(r.messages, r.tools, r.chat);
  } catch (const bg::Error& e) {
    throw ApiError(400, fmt::format("cannot render the messages: {}", e.what()), "messages");
  }
  in.extra_stop_ids = ctx.model.chat_stop_ids();
  in.common = std::move(r.common);
  in.chat = r.chat;
  run(ctx, std::move(in), "chatcmpl", arrival, res);
}

void handle_completions(ServingContext& ctx, const httplib::Request& req, httplib::Response& res) {
  const auto arrival = Clock::now();
  CompletionRequest r = parse_completion_request(parse_body(req.body));
  check_model(ctx, r.common.model);
  GenerationInput in;
  in.kind = ApiKind::completion;
  in.prompt = r.prompt_is_ids ? std::move(r.prompt_ids) : ctx.model.encode(r.prompt_text);
  in.common = std::move(r.common);
  in.default_max_tokens = 16;  // OpenAI's default for /v1/completions
  run(ctx, std::move(in), "cmpl", arrival, res);
}

void handle_models(ServingContext& ctx, const httplib::Request&, httplib::Response& res) {
  static const int64_t created = static_cast<int64_t>(std::time(nullptr));
  json model = {{"id", ctx.served_model_name}, {"object", "model"}, {"created", created}, {"owned_by", "batchgen"}};
  if (const int64_t len = ctx.link.max_model_len(); len > 0) model["max_model_len"] = len;
  respond_json(res, json{{"object", "list"}, {"data", json::array({model})}});
}

}  // namespace bg::frontend
