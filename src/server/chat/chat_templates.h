// Chat templates (Jinja) in the layouts of the published DeepSeek-V3, DeepSeek-V3.1 and Kimi-K2 templates, written
// for this project from their documented structure: `make-random` puts one into tokenizer_config.json so random
// checkpoints render chats exactly as the real ones, and the tests compare the renderer against @huggingface/jinja.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace bg {

// "deepseek_v3", "deepseek_v3.1" or "kimi_k2"; throws bg::Error naming the known layouts otherwise.
std::string_view builtin_chat_template(std::string_view layout);
const std::vector<std::string>& builtin_chat_template_layouts();

}  // namespace bg
