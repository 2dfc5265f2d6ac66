// Reference data for tests/tokenizer (HfReference.*) and tests/chat (TemplateReference.*), run by the CTest fixture
// hf_reference (tests/chat/js/run_reference.cmake) with the node_modules scripts/install-deps.sh installed here:
//   node generate.mjs <out_dir> <corpus.json> <extra_corpus.json> <template_cases.json> <layout>=<checkpoint_dir>...
// For each checkpoint: its chat_template rendered by @huggingface/jinja for every case (the variables batchgen's
// template format passes: messages with text-part arrays joined, tools when not null, add_generation_prompt, thinking,
// enable_thinking, bos/eos/pad token text); when it has a tokenizer.json, @huggingface/tokenizers' ids for every corpus
// text and every rendered prompt. Writes <out_dir>/expected.json.
import { readFileSync, writeFileSync, existsSync } from "node:fs";
import { join } from "node:path";
import { Template } from "@huggingface/jinja";
import { Tokenizer } from "@huggingface/tokenizers";

const [outDir, corpusPath, extraPath, casesPath, ...checkpoints] = process.argv.slice(2);
if (!outDir || !casesPath || checkpoints.length === 0) {
  console.error("usage: node generate.mjs <out_dir> <corpus.json> <extra.json> <cases.json> <layout>=<dir>...");
  process.exit(2);
}
const readJson = (p) => JSON.parse(readFileSync(p, "utf8"));
const corpus = [...readJson(corpusPath), ...readJson(extraPath)];
const cases = readJson(casesPath);

const tokenText = (t) => (t == null ? null : typeof t === "string" ? t : t.content);

function templateVars(c, config) {
  const messages = c.messages.map((m) =>
    Array.isArray(m.content) ? { ...m, content: m.content.map((p) => p.text).join("") } : m,
  );
  const vars = {
    messages,
    add_generation_prompt: c.add_generation_prompt,
    thinking: c.thinking,
    enable_thinking: c.thinking,
  };
  if (c.tools != null) vars.tools = c.tools;
  for (const key of ["bos_token", "eos_token", "pad_token"]) {
    const t = tokenText(config[key]);
    if (t != null) vars[key] = t;
  }
  return vars;
}

const expected = { corpus, layouts: {} };
for (const arg of checkpoints) {
  const [layout, dir] = arg.split("=");
  const config = readJson(join(dir, "tokenizer_config.json"));
  const template = new Template(config.chat_template);
  const hasTokenizer = existsSync(join(dir, "tokenizer.json"));
  const tokenizer = hasTokenizer ? new Tokenizer(readJson(join(dir, "tokenizer.json")), config) : null;
  const out = { chat: [], corpus: [] };
  for (const c of cases) {
    const text = template.render(templateVars(c, config));
    const entry = { name: c.name, text };
    if (tokenizer) entry.ids = tokenizer.encode(text, { add_special_tokens: false }).ids;
    out.chat.push(entry);
  }
  if (tokenizer) {
    for (const text of corpus) {
      const ids = tokenizer.encode(text, { add_special_tokens: false }).ids;
      out.corpus.push({
        ids,
        ids_template: tokenizer.encode(text, { add_special_tokens: true }).ids,
        decoded: ids.length > 0 ? tokenizer.decode(ids, { clean_up_tokenization_spaces: false }) : "",
      });
    }
  }
  expected.layouts[layout] = out;
}
writeFileSync(join(outDir, "expected.json"), JSON.stringify(expected));
console.log(`wrote ${cases.length} chat cases x ${checkpoints.length} layouts and ${corpus.length} texts to ${outDir}`);
