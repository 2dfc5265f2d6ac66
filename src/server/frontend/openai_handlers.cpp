// Endpoint handlers: parse + tokenize + submit a Generation, then answer through GenerationResponse, which the
// connection polls whenever the generation has news: one JSON body with the real status, or an SSE stream.
#include "server/frontend/openai_handlers.h"

#include <fmt/format.h>

#include <atomic>
#include <ctime>
#include <mutex>
#include <random>

#include "core/error.h"
#include "core/log.h"
#include "server/frontend/api_error.h"
#include "server/frontend/routes.h"

namespace bg::frontend {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

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

// Unknown request fields are logged, at most a few lines a second (a client could send them on every request).
void log_unknown_fields(const std::string& path, const std::vector<std::string>& fields, bool chat) {
  if (fields.empty()) return;
  static std::mutex mu;
  static Clock::time_point window;
  static int n_in_window = 0;
  static int64_t suppressed = 0;
  std::lock_guard lock(mu);
  const auto now = Clock::now();
  if (now - window >= std::chrono::seconds(1)) {
    if (suppressed > 0) log::warn("frontend: {} more requests with unknown fields were not logged", suppressed);
    window = now;
    n_in_window = 0;
    suppressed = 0;
  }
  if (++n_in_window > 5) {
    ++suppressed;
    return;
  }
  std::string list;
  for (const std::string& f : fields) list += (list.empty() ? "" : ", ") + describe_unknown_field(f, chat);
  log::warn("frontend: POST {}: unknown field(s) ignored: {} (--strict-params rejects them)", path, list);
}

// The answer to one generation request, polled by the connection.
class GenerationResponse : public PendingResponse {
 public:
  GenerationResponse(std::unique_ptr<Generation> gen, ResponseMeta meta, ApiKind kind, bool stream,
                     bool include_usage)
      : gen_(std::move(gen)), meta_(std::move(meta)), kind_(kind), stream_(stream), include_usage_(include_usage) {}

  void set_notify(std::function<void()> notify) override { gen_->set_notify(std::move(notify)); }
  ResponsePart poll() override { return stream_ ? poll_stream() : poll_full(); }
  std::string keep_alive() const override { return stream_ && started_ ? sse_comment("keep-alive") : ""; }
  void cancel() override { gen_->cancel_by_client(); }

 private:
  HttpResponse error_of_output() const {
    const OutputAssembler& out = gen_->output();
    const int status = out.error_code() >= 400 && out.error_code() <= 599 ? out.error_code() : 500;
    return error_response(status, out.error());
  }

  // Non-streamed: collect every delta; answer once with the real status.
  ResponsePart poll_full() {
    while (auto d = gen_->next(std::chrono::milliseconds(0))) full_.add(*d);
    ResponsePart part;
    if (!gen_->done()) return part;
    const OutputAssembler& out = gen_->output();
    if (out.finish_reason() == "error") {
      part.full = error_of_output();
      return part;
    }
    const json body = kind_ == ApiKind::chat
                          ? chat_response(meta_, full_, gen_->logprobs(), out.finish_reason(), gen_->usage())
                          : completion_response(meta_, full_, gen_->logprobs(), out.finish_reason(), gen_->usage());
    HttpResponse r;
    r.body = dump_json(body);
    part.full = std::move(r);
    return part;
  }

  std::string chunk(const OutputDelta& d, const std::string& finish_reason) {
    const bool with_lp = gen_->logprobs();
    json c = kind_ == ApiKind::chat ? chat_chunk(meta_, d, first_chunk_, with_lp, finish_reason)
                                    : completion_chunk(meta_, d, with_lp, text_offset_, finish_reason);
    text_offset_ += static_cast<int64_t>(d.text.size());
    first_chunk_ = false;
    if (include_usage_) c["usage"] = nullptr;
    return sse_data(c);
  }

  std::string tail() {
    const OutputAssembler& out = gen_->output();
    std::string s;
    if (out.finish_reason() == "error") s += sse_data(error_body(out.error_code(), out.error()));
    if (include_usage_) s += sse_data(usage_chunk(meta_, kind_ == ApiKind::chat, gen_->usage()));
    return s + sse_done();
  }

  // Streamed: the 200 is committed only once the worker has produced something, so a rejection (queue full,
  // too long) is still an HTTP error status.
  ResponsePart poll_stream() {
    ResponsePart part;
    if (!started_) {
      first_ = gen_->next(std::chrono::milliseconds(0));
      if (!first_ && !gen_->done()) return part;
      const OutputAssembler& out = gen_->output();
      if (out.finish_reason() == "error" && out.completion_tokens() == 0) {
        part.full = error_of_output();
        return part;
      }
      started_ = true;
      if (!first_) first_ = OutputDelta{};
      HttpResponse head;
      head.content_type = "text/event-stream";
      head.headers.emplace_back("Cache-Control", "no-cache");
      part.stream_head = std::move(head);
    }
    while (!ended_) {
      std::optional<OutputDelta> d = std::exchange(first_, std::nullopt);
      if (!d) d = gen_->next(std::chrono::milliseconds(0));
      const bool done = gen_->done();
      if (!d && !done) break;
      const std::string& reason = gen_->output().finish_reason();
      const std::string finish = done && reason != "error" ? reason : "";
      if (d && (!d->empty() || first_chunk_ || !finish.empty())) part.data += chunk(*d, finish);
      if (done) {
        part.data += tail();
        part.end = ended_ = true;
      }
    }
    return part;
  }

  std::unique_ptr<Generation> gen_;
  ResponseMeta meta_;
  ApiKind kind_;
  bool stream_;
  bool include_usage_;
  FullOutput full_;
  bool started_ = false;
  bool ended_ = false;
  std::optional<OutputDelta> first_;  // the first delta, read before the stream was committed
  bool first_chunk_ = true;
  int64_t text_offset_ = 0;           // bytes of completion text sent (legacy logprobs text_offset)
};

std::unique_ptr<PendingResponse> run(ServingContext& ctx, GenerationInput in, const char* id_prefix,
                                     Clock::time_point arrival) {
  const ApiKind kind = in.kind;
  const bool stream = in.common.stream;
  const bool include_usage = in.common.include_usage;
  ResponseMeta meta{new_request_id(id_prefix), ctx.served_model_name, static_cast<int64_t>(std::time(nullptr))};
  auto gen = std::make_unique<Generation>(ctx, std::move(in), meta.id, arrival);
  return std::make_unique<GenerationResponse>(std::move(gen), std::move(meta), kind, stream, include_usage);
}

}  // namespace

std::unique_ptr<PendingResponse> start_chat_completion(ServingContext& ctx, const HttpRequest& req) {
  ChatRequest r = parse_chat_body(req.body, ctx.parse);
  log_unknown_fields(req.path, r.common.unknown_fields, /*chat=*/true);
  check_model(ctx, r.common.model);
  GenerationInput in;
  in.kind = ApiKind::chat;
  try {
    in.prompt = ctx.model.render_chat(r.messages, r.tools, r.chat);
  } catch (const bg::Error& e) {
    throw ApiError(400, fmt::format("cannot render the messages: {}", e.what()), "messages");
  }
  r.chat.starts_in_reasoning = ctx.model.reasoning_open_after(in.prompt);
  in.extra_stop_ids = ctx.model.chat_stop_ids();
  in.common = std::move(r.common);
  in.chat = r.chat;
  return run(ctx, std::move(in), "chatcmpl", req.arrival);
}

std::unique_ptr<PendingResponse> start_completion(ServingContext& ctx, const HttpRequest& req) {
  CompletionRequest r = parse_completion_request(parse_body(req.body), ctx.parse);
  log_unknown_fields(req.path, r.common.unknown_fields, /*chat=*/false);
  check_model(ctx, r.common.model);
  GenerationInput in;
  in.kind = ApiKind::completion;
  // Token ids are taken as given; text gets the tokenizer's BOS where its files say (as vLLM and SGLang do).
  in.prompt = r.prompt_is_ids ? std::move(r.prompt_ids) : ctx.model.encode_prompt(r.prompt_text);
  in.common = std::move(r.common);
  in.default_max_tokens = 16;  // OpenAI's default for /v1/completions
  return run(ctx, std::move(in), "cmpl", req.arrival);
}

json models_body(const ServingContext& ctx) {
  static const int64_t created = static_cast<int64_t>(std::time(nullptr));
  json model = {{"id", ctx.served_model_name}, {"object", "model"}, {"created", created}, {"owned_by", "batchgen"}};
  if (const int64_t len = ctx.link.max_model_len(); len > 0) model["max_model_len"] = len;
  return json{{"object", "list"}, {"data", json::array({model})}};
}

}  // namespace bg::frontend
