// The chat templates of chat_templates.h. Layout facts (markers, where system prompts, tool calls, tool outputs and
// reasoning go) follow the published templates; the tool-declaration text of the DeepSeek-V3 layout is this
// project's, since that template renders no `tools`.
#include "server/chat/chat_templates.h"

#include "core/error.h"

namespace bg {
namespace {

// DeepSeek-V3 (0324): system prompts joined by blank lines after BOS; tool calls as
// `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>`, outputs wrapped in
// <｜tool▁outputs▁begin｜> ... <｜tool▁outputs▁end｜>; reasoning before </think> is dropped from history.
constexpr std::string_view kDeepSeekV3 = R"TPL({%- if not add_generation_prompt is defined -%}
  {%- set add_generation_prompt = false -%}
{%- endif -%}
{%- set ns = namespace(system_prompt='', is_first_sp=true, is_tool=false, is_output_first=true, is_first=false) -%}
{%- for message in messages -%}
  {%- if message['role'] == 'system' -%}
    {%- if ns.is_first_sp -%}
      {%- set ns.system_prompt = ns.system_prompt + message['content'] -%}
      {%- set ns.is_first_sp = false -%}
    {%- else -%}
      {%- set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] -%}
    {%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if tools is defined and tools is not none and tools | length > 0 -%}
  {%- set ns.system_prompt = ns.system_prompt + ('\n\n' if ns.system_prompt else '') + '## Tools\n\nYou have the following functions available:\n' -%}
  {%- for tool in tools -%}
    {%- set ns.system_prompt = ns.system_prompt + '\n- `' + tool['function']['name'] + '`:\n```json\n' + (tool['function'] | tojson) + '\n```' -%}
  {%- endfor -%}
{%- endif -%}
{{- bos_token + ns.system_prompt -}}
{%- for message in messages -%}
  {%- if message['role'] == 'user' -%}
    {%- set ns.is_tool = false -%}
    {{- '<｜User｜>' + message['content'] -}}
  {%- elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] is not none -%}
    {%- set ns.is_tool = false -%}
    {%- set ns.is_first = false -%}
    {%- for tool in message['tool_calls'] -%}
      {%- set call = '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n```json\n' + tool['function']['arguments'] + '\n```<｜tool▁call▁end｜>' -%}
      {%- if not ns.is_first -%}
        {{- '<｜Assistant｜>' + (message['content'] if message['content'] is string else '') + '<｜tool▁calls▁begin｜>' + call -}}
        {%- set ns.is_first = true -%}
      {%- else -%}
        {{- '\n' + call -}}
      {%- endif -%}
    {%- endfor -%}
    {{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' -}}
  {%- elif message['role'] == 'assistant' -%}
    {%- if ns.is_tool -%}
      {{- '<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>' -}}
      {%- set ns.is_tool = false -%}
    {%- else -%}
      {%- set content = message['content'] -%}
      {%- if '</think>' in content -%}
        {%- set content = content.split('</think>')[-1] -%}
      {%- endif -%}
      {{- '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' -}}
    {%- endif -%}
  {%- elif message['role'] == 'tool' -%}
    {%- set ns.is_tool = true -%}
    {%- if ns.is_output_first -%}
      {{- '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' -}}
      {%- set ns.is_output_first = false -%}
    {%- else -%}
      {{- '\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' -}}
    {%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if ns.is_tool -%}
  {{- '<｜tool▁outputs▁end｜>' -}}
{%- endif -%}
{%- if add_generation_prompt and not ns.is_tool -%}
  {{- '<｜Assistant｜>' -}}
{%- endif -%}
)TPL";

// DeepSeek-V3.1: thinking / non-thinking by `thinking` (default off): an assistant turn after a user turn opens with
// <｜Assistant｜></think>; the generation prompt ends with <think> when thinking; tool calls as
// `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`, outputs as <｜tool▁output▁begin｜>...; tools are
// declared in the system prompt.
constexpr std::string_view kDeepSeekV31 = R"TPL({%- if not add_generation_prompt is defined -%}
  {%- set add_generation_prompt = false -%}
{%- endif -%}
{%- if not thinking is defined -%}
  {%- set thinking = false -%}
{%- endif -%}
{%- set ns = namespace(is_first=false, is_tool=false, system_prompt='', is_first_sp=true, is_last_user=false) -%}
{%- for message in messages -%}
  {%- if message['role'] == 'system' -%}
    {%- if ns.is_first_sp -%}
      {%- set ns.system_prompt = ns.system_prompt + message['content'] -%}
      {%- set ns.is_first_sp = false -%}
    {%- else -%}
      {%- set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] -%}
    {%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if tools is defined and tools is not none -%}
  {%- set tool_ns = namespace(text='## Tools\nYou have access to the following tools:\n') -%}
  {%- for tool in tools -%}
    {%- set tool_ns.text = tool_ns.text + '\n### ' + tool['function']['name'] + '\nDescription: ' + tool['function'].get('description', '') + '\n\nParameters: ' + (tool['function']['parameters'] | tojson) + '\n' -%}
  {%- endfor -%}
  {%- set tool_ns.text = tool_ns.text + '\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>{{additional_tool_calls}}<｜tool▁calls▁end｜>\n\nWhere:\n\n- `tool_call_name` must be an exact match to one of the available tools\n- `tool_call_arguments` must be valid JSON that strictly follows the tool\'s Parameters Schema\n- For multiple tool calls, chain them directly without separators or spaces\n' -%}
  {%- set ns.system_prompt = ns.system_prompt + ('\n\n' if ns.system_prompt else '') + tool_ns.text -%}
{%- endif -%}
{{- bos_token -}}
{{- ns.system_prompt -}}
{%- for message in messages -%}
  {%- if message['role'] == 'user' -%}
    {%- set ns.is_tool = false -%}
    {%- set ns.is_first = false -%}
    {%- set ns.is_last_user = true -%}
    {{- '<｜User｜>' + message['content'] -}}
  {%- endif -%}
  {%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] is not none -%}
    {%- if ns.is_last_user -%}
      {{- '<｜Assistant｜></think>' -}}
    {%- endif -%}
    {%- set ns.is_last_user = false -%}
    {%- set ns.is_first = false -%}
    {%- set ns.is_tool = false -%}
    {%- for tool in message['tool_calls'] -%}
      {%- if not ns.is_first -%}
        {%- if message['content'] is none -%}
          {{- '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>' -}}
        {%- else -%}
          {{- message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>' -}}
        {%- endif -%}
        {%- set ns.is_first = true -%}
      {%- else -%}
        {{- '<｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>' -}}
      {%- endif -%}
    {%- endfor -%}
    {{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' -}}
  {%- endif -%}
  {%- if message['role'] == 'assistant' and (message['tool_calls'] is not defined or message['tool_calls'] is none) -%}
    {%- if ns.is_last_user -%}
      {{- '<｜Assistant｜>' -}}
      {%- if message['prefix'] is defined and message['prefix'] and thinking -%}
        {{- '<think>' -}}
      {%- else -%}
        {{- '</think>' -}}
      {%- endif -%}
    {%- endif -%}
    {%- set ns.is_last_user = false -%}
    {%- if ns.is_tool -%}
      {{- message['content'] + '<｜end▁of▁sentence｜>' -}}
      {%- set ns.is_tool = false -%}
    {%- else -%}
      {%- set content = message['content'] -%}
      {%- if '</think>' in content -%}
        {%- set content = content.split('</think>', 1)[1] -%}
      {%- endif -%}
      {{- content + '<｜end▁of▁sentence｜>' -}}
    {%- endif -%}
  {%- endif -%}
  {%- if message['role'] == 'tool' -%}
    {%- set ns.is_last_user = false -%}
    {%- set ns.is_tool = true -%}
    {{- '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and ns.is_last_user and not ns.is_tool -%}
  {{- '<｜Assistant｜>' -}}
  {%- if not thinking -%}
    {{- '</think>' -}}
  {%- else -%}
    {{- '<think>' -}}
  {%- endif -%}
{%- endif -%}
)TPL";

// Kimi-K2 (the thinking variant's layout): <|im_system|>/<|im_user|>/<|im_assistant|>NAME<|im_middle|>...<|im_end|>,
// tools declared as compact JSON, a default system prompt, tool calls as
// <|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS<|tool_call_end|> in a section, tool results as
// "## Return of ID\n..."; assistant turns after the last plain answer keep their reasoning in <think>...</think>,
// earlier ones an empty <think></think>.
constexpr std::string_view kKimiK2 = R"TPL({%- macro render_content(msg) -%}
  {%- set c = msg.get('content') -%}
  {%- if c is string -%}
    {{- c -}}
  {%- elif c is not none -%}
    {%- for part in c -%}
      {%- if part['type'] == 'text' -%}
        {{- part['text'] -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- macro open_role(message) -%}
  {%- set role_name = message.get('name') or message['role'] -%}
  {%- if message['role'] == 'user' -%}
    {{- '<|im_user|>' + role_name + '<|im_middle|>' -}}
  {%- elif message['role'] == 'assistant' -%}
    {{- '<|im_assistant|>' + role_name + '<|im_middle|>' -}}
  {%- else -%}
    {{- '<|im_system|>' + role_name + '<|im_middle|>' -}}
  {%- endif -%}
{%- endmacro -%}
{%- macro render_tool_calls(message) -%}
  {{- '<|tool_calls_section_begin|>' -}}
  {%- for tool_call in message['tool_calls'] -%}
    {%- set arguments = tool_call['function']['arguments'] -%}
    {{- '<|tool_call_begin|>' + tool_call['id'] + '<|tool_call_argument_begin|>' -}}
    {%- if arguments is string -%}
      {{- arguments -}}
    {%- else -%}
      {{- arguments | tojson -}}
    {%- endif -%}
    {{- '<|tool_call_end|>' -}}
  {%- endfor -%}
  {{- '<|tool_calls_section_end|>' -}}
{%- endmacro -%}
{%- macro render_message(message, keep_reasoning) -%}
  {{- open_role(message) -}}
  {%- if message['role'] == 'assistant' -%}
    {%- if keep_reasoning -%}
      {{- '<think>' + (message.get('reasoning_content') or '') + '</think>' -}}
    {%- else -%}
      {{- '<think></think>' -}}
    {%- endif -%}
    {{- render_content(message) -}}
    {%- if message.get('tool_calls') -%}
      {{- render_tool_calls(message) -}}
    {%- endif -%}
  {%- elif message['role'] == 'tool' -%}
    {{- '## Return of ' + message['tool_call_id'] + '\n' + render_content(message) -}}
  {%- else -%}
    {{- render_content(message) -}}
  {%- endif -%}
  {{- '<|im_end|>' -}}
{%- endmacro -%}
{%- set ns = namespace(last_answer=-1) -%}
{%- for idx in range(messages | length - 1, -1, -1) -%}
  {%- if messages[idx]['role'] == 'assistant' and not messages[idx].get('tool_calls') -%}
    {%- set ns.last_answer = idx -%}
    {%- break -%}
  {%- endif -%}
{%- endfor -%}
{%- if tools -%}
  {{- '<|im_system|>tool_declare<|im_middle|>' + (tools | tojson(separators=(',', ':'))) + '<|im_end|>' -}}
{%- endif -%}
{%- if messages | length == 0 or messages[0]['role'] != 'system' -%}
  {{- '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>' -}}
{%- endif -%}
{%- for message in messages[:ns.last_answer + 1] -%}
  {{- render_message(message, false) -}}
{%- endfor -%}
{%- for message in messages[ns.last_answer + 1:] -%}
  {{- render_message(message, true) -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_assistant|>assistant<|im_middle|>' -}}
{%- endif -%}
)TPL";

}  // namespace

const std::vector<std::string>& builtin_chat_template_layouts() {
  static const std::vector<std::string> names = {"deepseek_v3", "deepseek_v3.1", "kimi_k2"};
  return names;
}

std::string_view builtin_chat_template(std::string_view layout) {
  if (layout == "deepseek_v3") return kDeepSeekV3;
  if (layout == "deepseek_v3.1") return kDeepSeekV31;
  if (layout == "kimi_k2") return kKimiK2;
  fail("unknown chat template layout '{}' (deepseek_v3, deepseek_v3.1, kimi_k2)", layout);
}

}  // namespace bg
