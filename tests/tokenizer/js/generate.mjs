// Reference data for tests/tokenizer (run by the CTest fixture tokenizer_js_reference):
//   node generate.mjs <corpus.json> <out_dir>
// writes <out_dir>/o200k_base/tiktoken.model (js-tiktoken's o200k_base ranks as "base64 rank" lines, tiktoken's
// own file format) and <out_dir>/o200k_expected.json ([{text, ids, ids_special}] from js-tiktoken's encoder, with
// special-token strings as plain text and as specials).
import { readFileSync, writeFileSync, mkdirSync } from "node:fs";
import { join } from "node:path";
import { Tiktoken } from "js-tiktoken/lite";
import o200k_base from "js-tiktoken/ranks/o200k_base";

const [corpusPath, outDir] = process.argv.slice(2);
if (!corpusPath || !outDir) {
  console.error("usage: node generate.mjs <corpus.json> <out_dir>");
  process.exit(2);
}

// js-tiktoken packs the ranks as lines "<prefix> <first rank> <base64> <base64> ...", consecutive ranks per line.
function ranksOf(bpe) {
  const ranks = [];
  for (const line of bpe.bpe_ranks.split("\n")) {
    if (!line) continue;
    const [, offsetText, ...tokens] = line.split(" ");
    const offset = Number.parseInt(offsetText, 10);
    tokens.forEach((token, i) => ranks.push([token, offset + i]));
  }
  return ranks;
}

const ranks = ranksOf(o200k_base);
mkdirSync(join(outDir, "o200k_base"), { recursive: true });
writeFileSync(join(outDir, "o200k_base", "tiktoken.model"), ranks.map(([t, r]) => `${t} ${r}\n`).join(""));

const corpus = JSON.parse(readFileSync(corpusPath, "utf8"));
const enc = new Tiktoken(o200k_base);
const expected = corpus.map((text) => ({
  text,
  ids: enc.encode(text, [], []),
  ids_special: enc.encode(text, "all", []),
}));
writeFileSync(join(outDir, "o200k_expected.json"), JSON.stringify({
  special_tokens: o200k_base.special_tokens,
  n_ranks: ranks.length,
  cases: expected,
}));
console.log(`wrote ${ranks.length} ranks and ${expected.length} cases to ${outDir}`);
