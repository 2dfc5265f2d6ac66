// End-to-end: a DeepSeek-V3-layout checkpoint with a real-format tokenizer.json and chat_template (make-random
// --chat-template deepseek_v3.1) served by `batchgen serve` and driven by the official `openai` client: chat with tools
// and multi-turn, streamed and not. The prompt the server builds is checked against the references: its token count
// (usage.prompt_tokens) equals @huggingface/tokenizers' ids of @huggingface/jinja's rendering of the checkpoint's
// template (node_modules of tests/chat/js, installed by scripts/install-deps.sh).
// Run by CTest e2e_templates (tests/CMakeLists.txt) or: BATCHGEN=<path> node --test templates.test.mjs
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, execFileSync } from 'node:child_process';
import { mkdtempSync, rmSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { createRequire } from 'node:module';
import OpenAI from 'openai';

const BIN = process.env.BATCHGEN ?? path.resolve('../../build/batchgen');
const REF_MODULES = process.env.BG_REF_MODULES ?? path.resolve('../../tests/chat/js/node_modules');
const MODEL = 'ds-v31-tiny';

let dir, modelDir, server, baseURL, client, logs = '';
let Template, Tokenizer;

async function waitFor(what, fn, timeoutMs) {
  const start = Date.now();
  for (;;) {
    const v = await fn().catch(() => undefined);
    if (v) return v;
    if (Date.now() - start > timeoutMs) throw new Error(`timed out waiting for ${what}\n--- server log ---\n${logs}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

before(async () => {
  const require = createRequire(path.join(REF_MODULES, 'x.js'));
  // require.resolve picks the CommonJS builds: their exports sit on `default` when imported.
  const jinja = await import(require.resolve('@huggingface/jinja'));
  const tokenizers = await import(require.resolve('@huggingface/tokenizers'));
  Template = jinja.Template ?? jinja.default.Template;
  Tokenizer = tokenizers.Tokenizer ?? tokenizers.default.Tokenizer;
  dir = mkdtempSync(path.join(tmpdir(), 'bg-e2e-tpl-'));
  modelDir = path.join(dir, MODEL);
  // A larger vocabulary and context than the tiny preset's 512: the tool section of the prompt fits.
  execFileSync(BIN, ['make-random', '--arch', 'deepseek_v3', '--preset', 'tiny', '--chat-template', 'deepseek_v3.1',
    '--config-patch', '{"vocab_size": 2048, "max_position_embeddings": 4096}', '--out', modelDir], { stdio: 'inherit' });
  server = spawn(BIN, ['serve', modelDir, '--port', '0'], { stdio: ['ignore', 'inherit', 'pipe'] });
  server.stderr.on('data', (d) => { logs += d; process.stderr.write(d); });
  const port = await waitFor('the listening line', async () => logs.match(/listening on http:\/\/[\d.]+:(\d+)/)?.[1],
    30_000);
  baseURL = `http://127.0.0.1:${port}`;
  await waitFor('/ready', async () => (await fetch(`${baseURL}/ready`)).status === 200, 120_000);
  client = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60_000 });
});

after(async () => {
  if (server && server.exitCode === null) {
    const exited = new Promise((r) => server.once('exit', r));
    server.kill('SIGTERM');
    await exited;
  }
  if (dir) rmSync(dir, { recursive: true, force: true });
});

// The reference prompt ids: the checkpoint's own template rendered by @huggingface/jinja with the variables batchgen
// passes, tokenized by @huggingface/tokenizers (added tokens matched, no extra BOS: the template writes it).
function referenceIds(messages, tools, thinking) {
  const config = JSON.parse(readFileSync(path.join(modelDir, 'tokenizer_config.json'), 'utf8'));
  const tok = new Tokenizer(JSON.parse(readFileSync(path.join(modelDir, 'tokenizer.json'), 'utf8')), config);
  const vars = { messages, add_generation_prompt: true, thinking, enable_thinking: thinking,
    bos_token: config.bos_token.content, eos_token: config.eos_token.content, pad_token: config.pad_token.content };
  if (tools != null) vars.tools = tools;
  const text = new Template(config.chat_template).render(vars);
  return tok.encode(text, { add_special_tokens: false }).ids;
}

// Key order of tool schemas: sorted, so the reference sees what the server's parsed request holds.
const tools = [{
  function: { description: 'Current weather', name: 'get_weather',
    parameters: { properties: { city: { type: 'string' } }, required: ['city'], type: 'object' } },
  type: 'function',
}];

test('chat with tools: the prompt equals the reference template + tokenizer', async () => {
  const messages = [{ role: 'system', content: 'Be brief.' }, { role: 'user', content: 'Weather in Paris? 天气' }];
  const r = await client.chat.completions.create({ model: MODEL, messages, tools, max_tokens: 8, temperature: 0 });
  assert.equal(r.usage.prompt_tokens, referenceIds(messages, tools, false).length);
  assert.ok(['stop', 'length', 'tool_calls'].includes(r.choices[0].finish_reason));
});

test('multi-turn with a tool call and its result, thinking on, streamed', async () => {
  const messages = [
    { role: 'user', content: 'Weather in Paris?' },
    { role: 'assistant', content: null, tool_calls: [{ id: 'call_0', type: 'function',
      function: { name: 'get_weather', arguments: '{"city": "Paris"}' } }] },
    { role: 'tool', tool_call_id: 'call_0', content: '{"sky": "clear"}' },
    { role: 'assistant', content: 'It is clear.' },
    { role: 'user', content: 'And tomorrow?' },
  ];
  const stream = await client.chat.completions.create({ model: MODEL, messages, tools, max_tokens: 8,
    temperature: 0, stream: true, stream_options: { include_usage: true }, chat_template_kwargs: { thinking: true } });
  let usage;
  let chunks = 0;
  for await (const chunk of stream) {
    chunks += 1;
    if (chunk.usage) usage = chunk.usage;
  }
  assert.ok(chunks > 0);
  assert.equal(usage.prompt_tokens, referenceIds(messages, tools, true).length);
});

test('a bad message is a 400 naming the field', async () => {
  await assert.rejects(client.chat.completions.create({ model: MODEL, max_tokens: 4,
    messages: [{ role: 'robot', content: 'hi' }] }), (e) => e.status === 400 && /messages\[0\]\.role/.test(e.message));
});
