// The scheduler over a fake model: chunked prefill within the token budget, decode before prefill, admission by
// blocks and slots, preemption with recompute, cancellation freeing memory, queue bound (503), length limit (400).
#include <gtest/gtest.h>

#include <numeric>

#include "ops/sampling/sampling.h"
#include "sched/fake_model.h"
#include "sched/scheduler.h"

namespace bg::sched {
namespace {

using bg::testing::FakeModel;
using bg::testing::FakeModelOptions;
using bg::testing::FakeSetup;

std::unique_ptr<Request> make_request(const std::string& id, int64_t n_prompt, int64_t max_tokens = 8) {
  auto r = std::make_unique<Request>();
  r->id = id;
  r->tokens.resize(static_cast<size_t>(n_prompt));
  std::iota(r->tokens.begin(), r->tokens.end(), 1);
  r->n_prompt = n_prompt;
  r->params.max_tokens = max_tokens;
  r->params.temperature = 0.0f;
  return r;
}

// What the engine does with a plan, minus events: one forward_batch, then a greedy token for each sampling chunk.
// Finished requests (max_new_tokens) leave the scheduler and are returned.
std::vector<std::unique_ptr<Request>> run_step(Scheduler& s, FakeModel& m, StepPlan* plan_out = nullptr) {
  StepPlan plan = s.schedule();
  std::vector<BatchEntry> batch;
  for (const Chunk& c : plan.chunks) batch.push_back({c.req->seq.get(), c.req->span(c.start, c.n_tokens)});
  std::vector<float> logits(batch.size() * static_cast<size_t>(m.info().vocab_size));
  if (!batch.empty()) m.forward_batch(batch, logits.data());
  std::vector<std::unique_ptr<Request>> done;
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const Chunk& c = plan.chunks[i];
    s.complete(c);
    if (!c.samples) continue;
    c.req->tokens.push_back(ops::argmax(logits.data() + i * static_cast<size_t>(m.info().vocab_size),
                                        m.info().vocab_size));
    if (c.req->n_generated() >= c.req->max_new_tokens) done.push_back(s.finish(c.req));
  }
  if (plan_out != nullptr) *plan_out = plan;
  return done;
}

SchedulerConfig config(int64_t max_num_seqs, int64_t budget, int64_t max_model_len = 256, int64_t max_queue = 64) {
  return {max_num_seqs, max_model_len, budget, max_queue, 0.0};
}

TEST(Scheduler, LongPromptSpansStepsAndSamplesOnlyAtItsEnd) {
  FakeSetup f;
  FakeModel& m = f.model;
  Scheduler s(f.state, config(4, 16));
  ASSERT_FALSE(s.add(make_request("a", 40)));
  StepPlan p;
  run_step(s, m, &p);
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.chunks[0].start, 0);
  EXPECT_EQ(p.chunks[0].n_tokens, 16);
  EXPECT_FALSE(p.chunks[0].samples);
  run_step(s, m, &p);
  EXPECT_EQ(p.chunks[0].start, 16);
  EXPECT_EQ(p.chunks[0].n_tokens, 16);
  EXPECT_FALSE(p.chunks[0].samples);
  run_step(s, m, &p);
  EXPECT_EQ(p.chunks[0].start, 32);
  EXPECT_EQ(p.chunks[0].n_tokens, 8);
  EXPECT_TRUE(p.chunks[0].samples);
  EXPECT_EQ(s.find("a")->n_generated(), 1);
  run_step(s, m, &p);  // now a decode
  EXPECT_EQ(p.chunks[0].n_tokens, 1);
  EXPECT_EQ(p.chunks[0].start, 40);
}

TEST(Scheduler, DecodesComeFirstAndPrefillsShareTheRest) {
  FakeSetup f;
  FakeModel& m = f.model;
  Scheduler s(f.state, config(4, 10));
  ASSERT_FALSE(s.add(make_request("a", 3)));
  run_step(s, m);  // a: whole prompt, one token
  ASSERT_FALSE(s.add(make_request("b", 20)));
  ASSERT_FALSE(s.add(make_request("c", 5)));
  StepPlan p;
  run_step(s, m, &p);
  ASSERT_EQ(p.chunks.size(), 2u);  // c waits: b took the rest of the budget
  EXPECT_EQ(p.chunks[0].req->id, "a");
  EXPECT_EQ(p.chunks[0].n_tokens, 1);
  EXPECT_EQ(p.chunks[1].req->id, "b");
  EXPECT_EQ(p.chunks[1].n_tokens, 9);
  EXPECT_EQ(p.n_tokens, 10);
  EXPECT_EQ(s.n_waiting(), 1);
  run_step(s, m, &p);  // a decode, b continues (9 more), c is admitted with what is left (0) -> next step
  EXPECT_EQ(p.chunks[1].req->id, "b");
  EXPECT_EQ(p.chunks[1].start, 9);
  EXPECT_EQ(p.chunks[1].n_tokens, 9);
  run_step(s, m, &p);  // a decode, b's last 2 tokens (samples), c gets 7 >= 5
  ASSERT_EQ(p.chunks.size(), 3u);
  EXPECT_TRUE(p.chunks[1].samples);
  EXPECT_EQ(p.chunks[2].req->id, "c");
  EXPECT_EQ(p.chunks[2].n_tokens, 5);
}

TEST(Scheduler, AdmissionWaitsForAStateSlot) {
  FakeSetup f(FakeModelOptions{.n_slots = 2});
  FakeModel& m = f.model;
  Scheduler s(f.state, config(4, 64));
  for (const char* id : {"a", "b", "c"}) ASSERT_FALSE(s.add(make_request(id, 4, 2)));
  run_step(s, m);
  EXPECT_EQ(s.n_running(), 2);
  EXPECT_EQ(s.n_waiting(), 1);
  EXPECT_EQ(f.state.usage().state_slots_free, 0);
  auto done = run_step(s, m);  // a and b reach max_tokens 2
  ASSERT_EQ(done.size(), 2u);
  StepPlan p;
  run_step(s, m, &p);
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.chunks[0].req->id, "c");
}

TEST(Scheduler, AdmissionNeedsKvBlocksForThePrompt) {
  // 8 blocks of 4 tokens; a's 20-token prompt takes 5; b (16 tokens = 4 blocks) must wait for a to finish.
  FakeSetup f(FakeModelOptions{.block_tokens = 4, .n_blocks = 8});
  FakeModel& m = f.model;
  Scheduler s(f.state, config(4, 64, 32));
  ASSERT_FALSE(s.add(make_request("a", 20, 3)));
  ASSERT_FALSE(s.add(make_request("b", 16, 3)));
  run_step(s, m);
  EXPECT_EQ(s.n_running(), 1);
  EXPECT_EQ(f.state.usage().kv_blocks_free, 3);
  run_step(s, m);
  auto done = run_step(s, m);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0]->id, "a");
  EXPECT_EQ(f.state.usage().kv_blocks_free, 8);
  StepPlan p;
  run_step(s, m, &p);
  EXPECT_EQ(p.chunks[0].req->id, "b");
}

TEST(Scheduler, PreemptsTheNewestWhenDecodeRunsOutOfBlocksAndRecomputesIt) {
  // 6 blocks of 4 tokens. a and b (7-token prompts) take 2 blocks each; growing to 9 tokens each needs a third.
  FakeSetup f(FakeModelOptions{.block_tokens = 4, .n_blocks = 6});
  FakeModel& m = f.model;
  Scheduler s(f.state, config(2, 64, 24));
  ASSERT_FALSE(s.add(make_request("a", 7, 10)));
  ASSERT_FALSE(s.add(make_request("b", 7, 10)));
  run_step(s, m);  // both prefilled (8 tokens each incl. the sampled one), 4 blocks used
  EXPECT_EQ(s.n_running(), 2);
  run_step(s, m);  // decode position 7: still in block 2
  EXPECT_EQ(s.preemptions_total(), 0);
  StepPlan p;
  run_step(s, m, &p);  // position 8 needs a third block each: a gets the 5th, b the 6th
  EXPECT_EQ(s.preemptions_total(), 0);
  EXPECT_EQ(f.state.usage().kv_blocks_free, 0);
  for (int i = 0; i < 3; ++i) run_step(s, m);  // positions 9..11 fit in block 3
  run_step(s, m, &p);  // position 12: a needs a 4th block -> b (newest) is preempted
  EXPECT_EQ(s.preemptions_total(), 1);
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.chunks[0].req->id, "a");
  EXPECT_EQ(s.n_waiting(), 1);
  const Request* b = s.find("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->seq, nullptr);
  EXPECT_EQ(b->n_computed, 0);
  EXPECT_EQ(b->n_tokens(), 13);  // prompt + 6 generated: all recomputed when it is admitted again
  EXPECT_EQ(b->n_preemptions, 1);
}

TEST(Scheduler, PreemptsItselfWhenItIsTheNewest) {
  // 4 blocks of 4 tokens: a (4-token prompt) takes 1, b (7 tokens) 2; a's decode takes the last free block, then b,
  // the newest, needs one and gives up its own.
  FakeSetup f(FakeModelOptions{.block_tokens = 4, .n_blocks = 4});
  FakeModel& m = f.model;
  Scheduler s(f.state, config(2, 64, 12));
  ASSERT_FALSE(s.add(make_request("a", 4, 8)));
  ASSERT_FALSE(s.add(make_request("b", 7, 8)));
  run_step(s, m);  // both prefilled
  EXPECT_EQ(s.n_running(), 2);
  run_step(s, m);  // a position 4 takes block 2 (the last free one); b position 7 is in its block 2
  EXPECT_EQ(f.state.usage().kv_blocks_free, 0);
  StepPlan p;
  run_step(s, m, &p);  // b position 8 needs a third block: b is the newest -> b is preempted, a continues
  EXPECT_EQ(s.preemptions_total(), 1);
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.chunks[0].req->id, "a");
  EXPECT_EQ(s.find("b")->n_tokens(), 9);
}

TEST(Scheduler, CancelFreesBlocksAndSlotAtOnce) {
  FakeSetup f;
  FakeModel& m = f.model;
  const kv::StateUsage before = f.state.usage();
  Scheduler s(f.state, config(4, 64));
  ASSERT_FALSE(s.add(make_request("a", 30)));
  ASSERT_FALSE(s.add(make_request("b", 5)));
  run_step(s, m);
  EXPECT_LT(f.state.usage().kv_blocks_free, before.kv_blocks_free);
  EXPECT_EQ(f.state.usage().state_slots_free, before.state_slots_free - 2);
  auto a = s.cancel("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->seq, nullptr);
  auto b = s.cancel("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(f.state.usage().kv_blocks_free, before.kv_blocks_free);
  EXPECT_EQ(f.state.usage().state_slots_free, before.state_slots_free);
  EXPECT_EQ(s.cancel("a"), nullptr);
  EXPECT_FALSE(s.has_work());
}

TEST(Scheduler, CancelRemovesAWaitingRequest) {
  FakeSetup f;
  FakeModel& m = f.model;
  Scheduler s(f.state, config(1, 64));
  ASSERT_FALSE(s.add(make_request("a", 4)));
  ASSERT_FALSE(s.add(make_request("b", 4)));
  run_step(s, m);
  EXPECT_EQ(s.n_waiting(), 1);
  EXPECT_NE(s.cancel("b"), nullptr);
  EXPECT_EQ(s.n_waiting(), 0);
}

TEST(Scheduler, FullQueueRejectsWith503) {
  FakeSetup f;
  FakeModel& m = f.model;
  Scheduler s(f.state, config(1, 64, 256, /*max_queue=*/2));
  // One running place + 2 queued.
  ASSERT_FALSE(s.add(make_request("a", 4)));
  ASSERT_FALSE(s.add(make_request("b", 4)));
  ASSERT_FALSE(s.add(make_request("c", 4)));
  auto r = s.add(make_request("d", 4));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->code, 503);
  EXPECT_NE(r->message.find("--max-queue 2"), std::string::npos) << r->message;
  run_step(s, m);  // a starts; b and c still fill the queue
  EXPECT_TRUE(s.add(make_request("d", 4)));
  EXPECT_NE(s.cancel("b"), nullptr);
  EXPECT_FALSE(s.add(make_request("d", 4)));
}

TEST(Scheduler, ZeroQueueAcceptsOnlyWhatCanRunNow) {
  FakeSetup f;
  Scheduler s(f.state, config(2, 64, 256, /*max_queue=*/0));
  ASSERT_FALSE(s.add(make_request("a", 4)));
  ASSERT_FALSE(s.add(make_request("b", 4)));
  EXPECT_TRUE(s.add(make_request("c", 4)));
}

TEST(Scheduler, TooLongPromptRejectedWith400AndMaxTokensCapped) {
  FakeSetup f;
  Scheduler s(f.state, config(4, 64, /*max_model_len=*/32));
  auto r = s.add(make_request("long", 32));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->code, 400);
  EXPECT_NE(r->message.find("maximum context length is 32"), std::string::npos) << r->message;
  ASSERT_FALSE(s.add(make_request("capped", 30, 100)));
  EXPECT_EQ(s.find("capped")->max_new_tokens, 2);
}

TEST(Scheduler, PrefillPiecesEndAtSnapshotsAndChunkBoundaries) {
  // KDA-like: pieces end at multiples of 4 (the chunk) unless they end the input, and on the last multiple of 12 (the
  // snapshot interval) they reach; a budget of 14 reaches one at most.
  FakeSetup f(FakeModelOptions{.prefill_align = 4, .snapshot_interval = 12});
  FakeModel& m = f.model;
  Scheduler s(f.state, config(2, 14));
  ASSERT_FALSE(s.add(make_request("a", 30, 2)));
  std::vector<std::pair<int64_t, int64_t>> pieces;
  for (int i = 0; i < 6 && s.n_running() + s.n_waiting() > 0; ++i) {
    StepPlan p;
    run_step(s, m, &p);
    if (!p.chunks.empty() && p.chunks[0].start < 30) pieces.emplace_back(p.chunks[0].start, p.chunks[0].n_tokens);
  }
  // [0, 12) stops at the interval; [12, 24) likewise; [24, 30) ends the input.
  EXPECT_EQ(pieces, (std::vector<std::pair<int64_t, int64_t>>{{0, 12}, {12, 12}, {24, 6}}));
  // A budget cut lands on a chunk boundary: with 2 decodes running, 14 - 2 = 12 tokens are left -> pieces of 12 are
  // fine, but 10 would be cut to 8.
  ASSERT_FALSE(s.add(make_request("b", 20, 2)));
  Request probe;
  probe.tokens.assign(20, 1);
  probe.n_computed = 0;
  EXPECT_EQ(s.piece_tokens(probe, 10), 8);
  EXPECT_EQ(s.piece_tokens(probe, 14), 12);
  probe.n_computed = 12;
  EXPECT_EQ(s.piece_tokens(probe, 7), 4);   // 16 is a chunk boundary
  EXPECT_EQ(s.piece_tokens(probe, 8), 8);   // the input ends at 20
  EXPECT_EQ(s.piece_tokens(probe, 3), 0);   // not even one chunk: wait for the next step
}

TEST(Scheduler, LargeBudgetPrefillsManySnapshotIntervalsInOneStep) {
  // A budget of 40 reaches three multiples of 12 in a 30-token prompt: the first piece ends on the last of them (24),
  // so the prefix cache gets the state at 24, and the rest ends the input in the next step.
  FakeSetup f(FakeModelOptions{.prefill_align = 4, .snapshot_interval = 12});
  Scheduler s(f.state, config(2, 40));
  ASSERT_FALSE(s.add(make_request("a", 30, 2)));
  std::vector<std::pair<int64_t, int64_t>> pieces;
  for (int i = 0; i < 6 && s.n_running() + s.n_waiting() > 0; ++i) {
    StepPlan p;
    run_step(s, f.model, &p);
    if (!p.chunks.empty() && p.chunks[0].start < 30) pieces.emplace_back(p.chunks[0].start, p.chunks[0].n_tokens);
  }
  EXPECT_EQ(pieces, (std::vector<std::pair<int64_t, int64_t>>{{0, 24}, {24, 6}}));
  Request probe;
  probe.tokens.assign(50, 1);
  EXPECT_EQ(s.piece_tokens(probe, 40), 36);  // reaches 40: the last multiple is 36
  EXPECT_EQ(s.piece_tokens(probe, 11), 8);   // reaches none: the budget cut on a chunk boundary
  probe.n_computed = 36;
  EXPECT_EQ(s.piece_tokens(probe, 40), 12);  // the input ends at 50, past the multiple 48: the piece ends there
}

// --deterministic: a prompt's pieces are the same whatever runs beside it (grid (14 - 2) / 4 * 4 = 12 and the
// snapshot interval 12 here); a piece the budget cannot hold waits instead of being cut shorter.
TEST(Scheduler, DeterministicPiecesDoNotDependOnOtherRequests) {
  auto pieces_of = [](bool with_neighbour) {
    FakeSetup f(FakeModelOptions{.prefill_align = 4, .snapshot_interval = 12});
    SchedulerConfig c = config(2, 14);
    c.deterministic = true;
    Scheduler s(f.state, c);
    EXPECT_EQ(s.piece_grid(), 12);
    if (with_neighbour) {
      EXPECT_FALSE(s.add(make_request("x", 9, 6)));  // takes part of the budget first
    }
    EXPECT_FALSE(s.add(make_request("a", 30, 2)));
    std::vector<std::pair<int64_t, int64_t>> pieces;
    for (int i = 0; i < 12 && s.n_running() + s.n_waiting() > 0; ++i) {
      StepPlan p;
      const auto done = run_step(s, f.model, &p);  // keeps the step's finished requests alive while p is read
      for (const Chunk& ch : p.chunks) {
        if (ch.req->id == "a" && ch.start < 30) pieces.emplace_back(ch.start, ch.n_tokens);
      }
    }
    return pieces;
  };
  const auto alone = pieces_of(false);
  EXPECT_EQ(alone, (std::vector<std::pair<int64_t, int64_t>>{{0, 12}, {12, 12}, {24, 6}}));
  EXPECT_EQ(pieces_of(true), alone);

  FakeSetup f(FakeModelOptions{.prefill_align = 4, .snapshot_interval = 12});
  SchedulerConfig c = config(2, 14);
  c.deterministic = true;
  Scheduler s(f.state, c);
  Request probe;
  probe.tokens.assign(20, 1);
  EXPECT_EQ(s.piece_tokens(probe, 14), 12);
  EXPECT_EQ(s.piece_tokens(probe, 10), 0);  // the non-deterministic scheduler would cut 8
  probe.n_computed = 12;
  EXPECT_EQ(s.piece_tokens(probe, 8), 8);   // the input ends at 20
  EXPECT_EQ(s.piece_tokens(probe, 7), 0);
  c.chunked_prefill_size = 2;  // == max_num_seqs: no room for a piece
  EXPECT_THROW(Scheduler(f.state, c), Error);
}

TEST(Scheduler, StepsWithoutDecodesTakeTheIdlePrefillSize) {
  FakeSetup f;
  FakeModel& m = f.model;
  SchedulerConfig c = config(4, 8);
  c.idle_prefill_size = 32;
  Scheduler s(f.state, c);
  ASSERT_FALSE(s.add(make_request("a", 40)));
  StepPlan p;
  run_step(s, m, &p);  // nothing decodes: the lone prompt takes 32 tokens, not 8
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.chunks[0].n_tokens, 32);
  ASSERT_FALSE(s.add(make_request("b", 3)));
  run_step(s, m, &p);  // still no decode: a's last 8 and all of b in one step
  ASSERT_EQ(p.chunks.size(), 2u);
  EXPECT_EQ(p.chunks[0].start, 32);
  EXPECT_EQ(p.chunks[0].n_tokens, 8);
  EXPECT_TRUE(p.chunks[0].samples);
  EXPECT_EQ(p.chunks[1].req->id, "b");
  EXPECT_EQ(p.chunks[1].n_tokens, 3);
  ASSERT_FALSE(s.add(make_request("c", 30)));
  run_step(s, m, &p);  // a and b decode: the step is back to 8 tokens, c's first piece gets the 6 left
  ASSERT_EQ(p.chunks.size(), 3u);
  EXPECT_EQ(p.chunks[0].n_tokens, 1);
  EXPECT_EQ(p.chunks[1].n_tokens, 1);
  EXPECT_EQ(p.chunks[2].req->id, "c");
  EXPECT_EQ(p.chunks[2].n_tokens, 6);
  EXPECT_EQ(p.n_tokens, 8);
}

TEST(Scheduler, IdlePrefillSizeIsValidatedAndIgnoredWhenDeterministic) {
  FakeSetup f;
  SchedulerConfig c = config(4, 16);
  c.idle_prefill_size = 8;  // below the step budget
  EXPECT_THROW(Scheduler(f.state, c), Error);
  c.idle_prefill_size = 0;  // off
  EXPECT_NO_THROW(Scheduler(f.state, c));

  FakeSetup g(FakeModelOptions{.prefill_align = 4, .snapshot_interval = 12});
  SchedulerConfig d = config(2, 14);
  d.deterministic = true;
  d.idle_prefill_size = 64;
  Scheduler s(g.state, d);
  ASSERT_FALSE(s.add(make_request("a", 40)));
  StepPlan p;
  run_step(s, g.model, &p);  // the fixed grid of 12-token pieces, as without the idle size
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.chunks[0].n_tokens, 12);
}

TEST(Scheduler, BudgetMustLeaveRoomForOneChunk) {
  FakeSetup f(FakeModelOptions{.prefill_align = 8});
  EXPECT_THROW(Scheduler(f.state, config(4, 11)), Error);  // 4 decodes + one 8-token chunk > 11
  EXPECT_NO_THROW(Scheduler(f.state, config(4, 12)));
}

TEST(Scheduler, ConfigIsValidated) {
  FakeSetup f;
  EXPECT_THROW(Scheduler(f.state, config(16, 8)), Error);  // budget below max_num_seqs
  EXPECT_THROW(Scheduler(f.state, config(0, 8)), Error);
  EXPECT_THROW(Scheduler(f.state, config(4, 8, 256, -1)), Error);
}

}  // namespace
}  // namespace bg::sched
