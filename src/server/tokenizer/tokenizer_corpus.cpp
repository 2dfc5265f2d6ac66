// The embedded text the random checkpoints' BPE merges are trained on: plain English prose and a little code, written
// for this project (tokenizer_training_corpus in tokenizer_writer.h).
#include "server/tokenizer/tokenizer_writer.h"

namespace bg {

std::string_view tokenizer_training_corpus() {
  static constexpr std::string_view kCorpus = R"CORPUS(
The engine reads a request, turns the messages into tokens, and schedules the work in small steps. Each step runs the
model on a batch of sequences, samples the next token of every sequence, and sends the new text back to the client.
When a sequence reaches its stop token or its length limit, the engine frees its memory and admits the next request.

A tokenizer splits text into pieces with a regular expression, then merges the bytes of each piece into the longest
tokens the vocabulary knows. The merges are learned from text: the pair of tokens that occurs most often becomes a new
token, and the process repeats until the vocabulary is full. Common words such as the, and, of, to, in, is, that, for,
with, on, as, it, this, was, are, be, by, at, from, or, an, not, have, which, one, you, they, we, can, will, all, there,
their, been, has, more, when, would, what, so, if, about, out, up, into, than, them, then, only, other, some, time,
these, two, may, first, new, any, like, our, over, such, after, also, most, made, where, many, before, must, through,
back, years, much, your, way, well, down, should, because, each, just, those, people, how, too, little, state, good,
very, make, world, still, own, see, men, work, long, get, here, between, both, life, being, under, never, day, same,
another, know, while, last, might, us, great, old, year, off, come, since, against, go, came, right, used, take, three.

Questions and answers: What is the capital of France? The capital of France is Paris. How many days are in a week?
There are seven days in a week. Why is the sky blue? Sunlight scatters off the air, and blue light scatters the most.
Can you help me write a function? Yes, I can help. Here is a short example, and I will explain each line below.

def count_words(text):
    counts = {}
    for word in text.split():
        word = word.strip(".,!?").lower()
        counts[word] = counts.get(word, 0) + 1
    return counts

def main():
    text = "the quick brown fox jumps over the lazy dog"
    for word, count in sorted(count_words(text).items()):
        print(f"{word}: {count}")

if __name__ == "__main__":
    main()

#include <string>
#include <vector>

int sum(const std::vector<int>& values) {
  int total = 0;
  for (int value : values) {
    total += value;
  }
  return total;
}

const response = await fetch("/v1/chat/completions", {
  method: "POST",
  headers: { "Content-Type": "application/json" },
  body: JSON.stringify({ model: "default", messages: [{ role: "user", content: "Hello!" }] }),
});

{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3, "detailed": true}}
SELECT name, count(*) FROM users WHERE active = 1 GROUP BY name ORDER BY count(*) DESC LIMIT 10;

Numbers appear everywhere: 1, 2, 3, 10, 42, 100, 256, 1024, 2024, 3.14, 0.5, 99.9 percent, 12:30, 2025-01-31.
The weather today is sunny with a high of 24 degrees and a low of 15. Tomorrow it will rain in the morning.
Thank you for your question. I hope this helps! Let me know if you have any other questions or need more details.
)CORPUS";
  return kCorpus;
}

}  // namespace bg
