// Soak of `batchgen serve` (manual, not a CTest case; scripts/soak-serve.sh runs it): N concurrent clients loop
// over streamed and non-streamed chat and completion requests for M minutes; some clients hang up mid-stream on
// purpose. Every 30 s it samples the RSS of the frontend and the worker and the server's metrics. At the end, with
// the server idle, every KV block and state slot must be free. Prints a Markdown summary; exits 1 on any request
// error, memory growth or leaked blocks/slots.
//   node tests/e2e/soak.mjs <base-url> <serve-pid> <minutes> <streams>
import { readFileSync } from 'node:fs';
import OpenAI from 'openai';

const [baseURL, servePidText, minutesText, streamsText] = process.argv.slice(2);
const servePid = Number(servePidText);
const minutes = Number(minutesText ?? 30);
const nStreams = Number(streamsText ?? 256);
if (!baseURL || !servePid) {
  console.error('usage: node soak.mjs <base-url> <serve-pid> <minutes> <streams>');
  process.exit(2);
}
const client = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 600_000 });
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

const rssMiB = (pid) => {
  const m = readFileSync(`/proc/${pid}/status`, 'utf8').match(/VmRSS:\s+(\d+) kB/);
  return m ? Number(m[1]) / 1024 : NaN;
};
const workerPid = async () => (await (await fetch(`${baseURL}/ready`)).json()).ranks[0].pid;
async function metrics() {
  const text = await (await fetch(`${baseURL}/metrics`)).text();
  const get = (name) => Number(text.split('\n').find((l) => l.startsWith(name + ' '))?.split(' ')[1]);
  return {
    // KV blocks held by sequences: in use minus those only the prefix cache keeps (evictable).
    kvUsed: get('batchgen_kv_blocks_used{rank="0"}') - (get('batchgen_kv_blocks_cached{rank="0"}') || 0),
    kvTotal: get('batchgen_kv_blocks_total{rank="0"}'),
    slotsUsed: get('batchgen_state_slots_used{rank="0"}') - (get('batchgen_state_slots_cached{rank="0"}') || 0), slotsTotal: get('batchgen_state_slots_total{rank="0"}'),
    inFlight: get('batchgen_requests_in_flight'), restarts: get('batchgen_worker_restarts_total'),
    generated: get('batchgen_generation_tokens_total'), running: get('batchgen_num_requests_running{rank="0"}'),
  };
}

const stats = { ok: 0, errors: 0, hungUp: 0, tokens: 0, firstErrors: [] };
const deadline = Date.now() + minutes * 60_000;
let seq = 0;

async function one(i) {
  const n = seq++;
  const maxTokens = 16 + (n * 37) % 113;
  const kind = n % 10;
  if (kind < 6) {  // streamed chat; every 20th client hangs up after a few chunks
    const s = await client.chat.completions.create({ model: 'soak', messages: [{ role: 'user', content: `client ${i} request ${n}` }],
      max_tokens: maxTokens, temperature: 0.7, stream: true, stream_options: { include_usage: true } });
    let chunks = 0;
    let usage = null;
    for await (const c of s) {
      usage = c.usage ?? usage;
      if (++chunks === 4 && n % 20 === 0) { stats.hungUp += 1; return; }
    }
    if (!usage) throw new Error('stream ended without usage');
    stats.tokens += usage.completion_tokens;
  } else if (kind < 8) {  // streamed completion
    const s = await client.completions.create({ model: 'soak', prompt: `Once upon a time ${n}`, max_tokens: maxTokens,
      temperature: 0, ignore_eos: true, stream: true });
    let finish = null;
    for await (const c of s) finish = c.choices[0]?.finish_reason ?? finish;
    if (finish !== 'length') throw new Error(`finish ${finish}`);
    stats.tokens += maxTokens;
  } else {  // non-streamed chat
    const r = await client.chat.completions.create({ model: 'soak', messages: [{ role: 'user', content: `plain ${n}` }],
      max_tokens: maxTokens });
    stats.tokens += r.usage.completion_tokens;
  }
  stats.ok += 1;
}

async function loop(i) {
  while (Date.now() < deadline) {
    try {
      await one(i);
    } catch (e) {
      stats.errors += 1;
      if (stats.firstErrors.length < 5) stats.firstErrors.push(String(e?.message ?? e));
    }
  }
}

const samples = [];
async function sample() {
  const m = await metrics();
  samples.push({ t: (Date.now() - start) / 60_000, serve: rssMiB(servePid), worker: rssMiB(await workerPid()), ...m });
  const s = samples.at(-1);
  console.error(`[${s.t.toFixed(1)} min] ok ${stats.ok} errors ${stats.errors} hung-up ${stats.hungUp} | RSS serve ` +
    `${s.serve.toFixed(1)} MiB worker ${s.worker.toFixed(1)} MiB | running ${s.running} kv ${s.kvUsed}/${s.kvTotal}`);
}

const start = Date.now();
await sample();
const sampler = setInterval(() => { sample().catch(() => {}); }, 30_000);
await Promise.all(Array.from({ length: nStreams }, (_, i) => loop(i)));
clearInterval(sampler);
await sleep(3000);  // idle: the last cancels and finishes reach the worker
await sample();
const idle = samples.at(-1);
// Flat RSS: the second half of the run may not grow beyond the first half's peak by more than 5% (+8 MiB).
const half = samples.filter((s) => s.t >= minutes / 2);
const firstHalf = samples.filter((s) => s.t < minutes / 2 && s.t > 0.4);
const peak = (xs, k) => Math.max(...xs.map((s) => s[k]));
const flat = (k) => firstHalf.length === 0 || peak(half, k) <= peak(firstHalf, k) * 1.05 + 8;
const ok = stats.errors === 0 && idle.kvUsed === 0 && idle.slotsUsed === 0 && idle.inFlight === 0 &&
  idle.restarts === 0 && flat('serve') && flat('worker');
const fmt = (xs, k) => `${Math.min(...xs.map((s) => s[k])).toFixed(1)}–${peak(xs, k).toFixed(1)}`;
console.log(`| measure | value |
|---|---|
| duration, concurrent clients | ${minutes} min, ${nStreams} |
| requests completed / errors / hung up on purpose | ${stats.ok} / ${stats.errors} / ${stats.hungUp} |
| completion tokens received | ${stats.tokens} |
| frontend RSS (MiB), first half / second half | ${fmt(firstHalf.length ? firstHalf : samples, 'serve')} / ${fmt(half, 'serve')} |
| worker RSS (MiB), first half / second half | ${fmt(firstHalf.length ? firstHalf : samples, 'worker')} / ${fmt(half, 'worker')} |
| idle at the end: KV blocks used, state slots used, in flight | ${idle.kvUsed}/${idle.kvTotal}, ${idle.slotsUsed}/${idle.slotsTotal}, ${idle.inFlight} |
| worker restarts | ${idle.restarts} |
| result | ${ok ? 'PASS' : 'FAIL'} |`);
if (stats.firstErrors.length) console.log(`first errors: ${stats.firstErrors.join(' | ')}`);
process.exit(ok ? 0 : 1);
