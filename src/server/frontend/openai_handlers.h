// The OpenAI endpoints: POST /v1/chat/completions, POST /v1/completions (streamed as SSE or not), GET /v1/models.
#pragma once

#include <httplib.h>

#include "server/frontend/generation.h"

namespace bg::frontend {

void handle_chat_completions(ServingContext& ctx, const httplib::Request& req, httplib::Response& res);
void handle_completions(ServingContext& ctx, const httplib::Request& req, httplib::Response& res);
void handle_models(ServingContext& ctx, const httplib::Request& req, httplib::Response& res);

}  // namespace bg::frontend
