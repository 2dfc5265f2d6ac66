// The OpenAI endpoints: POST /v1/chat/completions and POST /v1/completions (parse, tokenize, submit; the answer is a
// PendingResponse the connection polls: one JSON body, or an SSE stream), and the GET /v1/models body.
#pragma once

#include <memory>

#include <nlohmann/json.hpp>

#include "server/frontend/generation.h"
#include "server/frontend/http_types.h"

namespace bg::frontend {

// Throw ApiError for a bad request (the caller answers it).
std::unique_ptr<PendingResponse> start_chat_completion(ServingContext& ctx, const HttpRequest& req);
std::unique_ptr<PendingResponse> start_completion(ServingContext& ctx, const HttpRequest& req);
nlohmann::json models_body(const ServingContext& ctx);

}  // namespace bg::frontend
