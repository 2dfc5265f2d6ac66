// The caching allocator's bookkeeping over a host-memory driver (the CUDA backend runs it over cudaMalloc/cudaFree):
// caching by size, the budget, and graph capture — no driver free while capturing (deferred to the end), memory
// freed during a capture reused inside it, a captured graph's memory kept from everyone else while the graph lives.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "backend/caching_allocator.h"
#include "core/error.h"

namespace bg {
namespace {

// Host memory standing in for the device. `capturing` mirrors a stream under capture: a free then is the bug.
// `device_bytes` stands for the device's free memory: a malloc past it returns nullptr (cudaErrorMemoryAllocation).
struct FakeDriver final : BlockDriver {
  void* malloc(size_t bytes) override {
    ++n_malloc;
    if (live_bytes + bytes > device_bytes) return nullptr;
    void* p = std::malloc(bytes);
    live.insert(p);
    sizes[p] = bytes;
    live_bytes += bytes;
    return p;
  }
  void free(void* ptr) noexcept override {
    ++n_free;
    if (capturing) ++n_free_while_capturing;
    live.erase(ptr);
    live_bytes -= sizes[ptr];
    sizes.erase(ptr);
    std::free(ptr);
  }
  bool capturing = false;
  int n_malloc = 0, n_free = 0, n_free_while_capturing = 0;
  std::set<void*> live;
  std::map<void*, size_t> sizes;
  size_t live_bytes = 0;
  size_t device_bytes = SIZE_MAX;
};

struct Fixture {
  explicit Fixture(size_t budget) : driver(std::make_shared<FakeDriver>()),
                                    alloc(std::make_shared<CachingAllocator>(driver, budget)) {}
  // What run_graph does around the captured body.
  std::shared_ptr<CapturePool> begin() {
    auto pool = alloc->begin_capture();
    driver->capturing = true;
    return pool;
  }
  void end() {
    driver->capturing = false;  // cudaStreamEndCapture comes first
    alloc->end_capture();
  }
  std::shared_ptr<FakeDriver> driver;
  std::shared_ptr<CachingAllocator> alloc;
};

TEST(CachingAllocator, ReusesAFreedBlockOfTheSameSizeWithoutDriverCalls) {
  Fixture f(1 << 20);
  void* first = f.alloc->allocate(1000).get();  // rounded to 1024, dropped at once
  EXPECT_EQ(f.alloc->bytes_cached(), 1024u);
  auto again = f.alloc->allocate(600);  // also 1024
  EXPECT_EQ(again.get(), first);
  EXPECT_EQ(f.driver->n_malloc, 1);
  EXPECT_EQ(f.alloc->bytes_in_use(), 1024u);
  EXPECT_EQ(f.alloc->bytes_cached(), 0u);
}

TEST(CachingAllocator, ThePeakCountsWhatWasHeldAtOnceUntilReset) {
  Fixture f(1 << 20);
  {
    auto a = f.alloc->allocate(1024);
    auto b = f.alloc->allocate(2048);
    EXPECT_EQ(f.alloc->peak_bytes_held(), 3072u);
  }
  EXPECT_EQ(f.alloc->peak_bytes_held(), 3072u);  // both cached now: still held
  auto c = f.alloc->allocate(1024);              // from the cache: nothing new held
  EXPECT_EQ(f.alloc->peak_bytes_held(), 3072u);
  f.alloc->release_cache();  // 2048 back to the driver
  f.alloc->reset_peak();
  EXPECT_EQ(f.alloc->peak_bytes_held(), 1024u);
  auto d = f.alloc->allocate(4096);
  EXPECT_EQ(f.alloc->peak_bytes_held(), 5120u);
}

// The device holds more than this allocator (weights, libraries): when it is out of memory below the budget, the
// cached blocks go back and the request is tried again; with nothing left to give back the error says so.
TEST(CachingAllocator, OutOfDeviceMemoryGivesTheCacheBackAndAsksAgain) {
  Fixture f(1 << 20);
  f.driver->device_bytes = 5120;
  f.alloc->allocate(2048).reset();  // cached
  EXPECT_EQ(f.alloc->bytes_cached(), 2048u);
  auto big = f.alloc->allocate(4096);  // 2048 + 4096 > 5120: fails, the cache goes back, then fits
  ASSERT_NE(big, nullptr);
  EXPECT_EQ(f.driver->n_free, 1);
  EXPECT_EQ(f.alloc->bytes_cached(), 0u);
  EXPECT_EQ(f.alloc->peak_bytes_in_use(), 4096u);
  std::string message;
  try {
    f.alloc->allocate(2048);
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("CUDA out of memory"), std::string::npos) << message;
  EXPECT_EQ(f.alloc->bytes_in_use(), 4096u);  // the failed request left nothing behind
}

// During a capture nothing can be freed: out of device memory, a larger cached block serves instead.
TEST(CachingAllocator, OutOfDeviceMemoryDuringACaptureTakesALargerFreeBlock) {
  Fixture f(1 << 20);
  f.driver->device_bytes = 4096;
  f.alloc->allocate(4096).reset();  // cached; the device is full
  auto pool = f.begin();
  auto small = f.alloc->allocate(1024);
  f.end();
  ASSERT_NE(small, nullptr);
  EXPECT_EQ(f.driver->n_free_while_capturing, 0);
  EXPECT_EQ(pool->bytes(), 4096u);
}

TEST(CachingAllocator, OutsideACaptureTheCacheGoesBackToTheDriverAtTheBudget) {
  Fixture f(4096);
  f.alloc->allocate(2048).reset();
  auto big = f.alloc->allocate(4096);  // 2048 cached + 4096 > budget: the cache is released first
  EXPECT_EQ(f.driver->n_free, 1);
  EXPECT_THROW(f.alloc->allocate(512), Error);  // nothing left to release
}

TEST(CachingAllocator, ReleasesDuringACaptureAreDeferredToItsEnd) {
  Fixture f(1 << 20);
  f.alloc->allocate(4096).reset();
  f.alloc->allocate(8192).reset();
  auto pool = f.begin();
  f.alloc->release_cache();
  EXPECT_EQ(f.driver->n_free, 0) << "cudaFree during capture";
  EXPECT_EQ(f.alloc->bytes_cached(), 4096u + 8192u);
  f.end();
  EXPECT_EQ(f.driver->n_free, 2) << "the deferred release runs when the capture ends";
  EXPECT_EQ(f.alloc->bytes_cached(), 0u);
  EXPECT_EQ(f.driver->n_free_while_capturing, 0);
}

TEST(CachingAllocator, AtTheBudgetACaptureTakesALargerFreeBlockInsteadOfFreeing) {
  Fixture f(8192);
  auto held = f.alloc->allocate(4096);
  void* cached = f.alloc->allocate(4096).get();  // freed: 4096 cached, the budget is full
  auto pool = f.begin();
  auto small = f.alloc->allocate(1024);  // would need a release outside a capture
  EXPECT_EQ(small.get(), cached);
  EXPECT_EQ(f.driver->n_free_while_capturing, 0);
  try {
    f.alloc->allocate(1024);  // nothing free is large enough and nothing may be freed
    ADD_FAILURE() << "expected a budget error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("during CUDA graph capture"), std::string::npos) << e.what();
  }
  EXPECT_EQ(f.driver->n_free_while_capturing, 0);
  small.reset();
  f.end();
}

TEST(CachingAllocator, MemoryFreedDuringACaptureIsReusedInsideIt) {
  Fixture f(1 << 20);
  auto pool = f.begin();
  auto out = f.alloc->allocate(2048);  // the graph's output: outlives the capture
  void* scratch = nullptr;
  for (int op = 0; op < 8; ++op) {  // eight ops, each with its own short-lived scratch
    auto s = f.alloc->allocate(4096);
    if (scratch == nullptr) scratch = s.get();
    EXPECT_EQ(s.get(), scratch) << "op " << op << " did not reuse the scratch freed earlier in the capture";
  }
  f.end();
  EXPECT_EQ(f.driver->n_malloc, 2);  // out + one scratch: the graph holds its peak, not the sum
  EXPECT_EQ(pool->n_blocks(), 2u);
  EXPECT_EQ(pool->bytes(), 2048u + 4096u);
  EXPECT_EQ(f.driver->n_free_while_capturing, 0);
}

TEST(CachingAllocator, AGraphsMemoryIsNotHandedOutWhileTheGraphLives) {
  Fixture f(1 << 20);
  auto pool = f.begin();
  void* scratch = f.alloc->allocate(4096).get();  // freed inside the capture: back to the pool
  auto out = f.alloc->allocate(2048);
  void* out_ptr = out.get();
  f.end();
  auto eager = f.alloc->allocate(4096);
  EXPECT_NE(eager.get(), scratch) << "the graph writes this block at every replay";
  out.reset();  // the graph's output tensor dropped while the graph lives: still the graph's
  auto eager_out = f.alloc->allocate(2048);
  EXPECT_NE(eager_out.get(), out_ptr);
  eager.reset();
  eager_out.reset();
  const size_t in_use_with_graph = f.alloc->bytes_in_use();
  EXPECT_EQ(in_use_with_graph, 4096u + 2048u);  // the pool's two blocks
  pool.reset();  // the graph is destroyed: its blocks return to the cache
  EXPECT_EQ(f.alloc->bytes_in_use(), 0u);
  EXPECT_EQ(f.alloc->bytes_cached(), 2 * (4096u + 2048u));
  EXPECT_EQ(f.driver->n_free, 0);
}

TEST(CachingAllocator, BlocksTakenFromTheCacheDuringACaptureBecomeTheGraphs) {
  Fixture f(1 << 20);
  void* cached = f.alloc->allocate(4096).get();
  auto pool = f.begin();
  auto s = f.alloc->allocate(4096);
  EXPECT_EQ(s.get(), cached);
  s.reset();
  f.end();
  EXPECT_EQ(f.alloc->bytes_cached(), 0u);
  auto eager = f.alloc->allocate(4096);
  EXPECT_NE(eager.get(), cached);
  pool.reset();
  EXPECT_EQ(f.alloc->allocate(4096).get(), cached);
}

TEST(CachingAllocator, AFailedCaptureReturnsItsBlocks) {
  Fixture f(1 << 20);
  {
    auto pool = f.begin();
    auto partial = f.alloc->allocate(4096);
    f.driver->capturing = false;
    pool.reset();          // run_graph's Graph goes out of scope on the exception...
    f.alloc->end_capture();  // ...after end_capture
  }
  EXPECT_EQ(f.alloc->bytes_in_use(), 0u);
  EXPECT_EQ(f.alloc->bytes_cached(), 4096u);
  EXPECT_FALSE(f.alloc->capturing());
  EXPECT_THROW({ auto p = f.alloc->begin_capture(); f.alloc->begin_capture(); }, Error);  // one capture at a time
  f.alloc->end_capture();
}

TEST(CachingAllocator, BlocksAndPoolsThatOutliveTheAllocatorGoToTheDriver) {
  Fixture f(1 << 20);
  auto pool = f.begin();
  auto in_graph = f.alloc->allocate(4096);
  f.alloc->allocate(1024).reset();
  f.end();
  auto plain = f.alloc->allocate(512);
  f.alloc.reset();
  EXPECT_EQ(f.driver->live.size(), 3u);
  plain.reset();
  in_graph.reset();
  pool.reset();
  EXPECT_TRUE(f.driver->live.empty());
}

// An arena shared by several captures (decode graphs that never run at once): a later capture reuses what an earlier
// one freed instead of growing, while a block an earlier graph still holds (its output) is never handed out.
TEST(CachingAllocator, AnArenaIsReusedByLaterCaptures) {
  Fixture f(1 << 20);
  std::shared_ptr<CapturePool> arena = f.begin();
  std::shared_ptr<void> out1;
  void* scratch1 = nullptr;
  {
    auto scratch = f.alloc->allocate(4096);
    scratch1 = scratch.get();
    out1 = f.alloc->allocate(1024);
  }  // scratch freed inside the capture
  f.end();
  EXPECT_EQ(arena->bytes(), 4096u + 1024u);
  const int mallocs = f.driver->n_malloc;

  // A second graph in the same arena: its scratch is the first graph's, its output a new block.
  f.alloc->begin_capture(arena);
  f.driver->capturing = true;
  std::shared_ptr<void> out2;
  {
    auto scratch = f.alloc->allocate(3000);  // 4096 after rounding
    EXPECT_EQ(scratch.get(), scratch1);
    out2 = f.alloc->allocate(1024);
    EXPECT_NE(out2.get(), out1.get()) << "the first graph's output is still held";
  }
  f.driver->capturing = false;
  EXPECT_TRUE(f.alloc->end_capture().empty()) << "every reused block was freed inside the capture";
  EXPECT_EQ(f.driver->n_malloc, mallocs + 1);  // only the second output
  EXPECT_EQ(arena->bytes(), 4096u + 2 * 1024u);
  EXPECT_EQ(f.driver->n_free_while_capturing, 0);
}

// A block reused from the arena that outlives the capture is named by end_capture (other graphs write it at their
// replays); a persistent allocation during a capture never comes from the arena and is not the graph's memory.
TEST(CachingAllocator, EndCaptureNamesReusedBlocksThatOutliveIt) {
  Fixture f(1 << 20);
  std::shared_ptr<CapturePool> arena = f.begin();
  void* scratch1 = f.alloc->allocate(4096).get();  // freed at once: the arena's
  f.end();

  f.alloc->begin_capture(arena);
  std::shared_ptr<void> kept = f.alloc->allocate(4096);  // the freed block, kept past the capture
  EXPECT_EQ(kept.get(), scratch1);
  std::shared_ptr<void> persistent = f.alloc->allocate_persistent(4096);
  EXPECT_NE(persistent.get(), scratch1) << "a persistent buffer must not be another graph's scratch";
  const std::vector<void*> outlived = f.alloc->end_capture();
  ASSERT_EQ(outlived.size(), 1u);
  EXPECT_EQ(outlived[0], scratch1);
  EXPECT_EQ(arena->bytes(), 4096u) << "the persistent block is not the arena's";
  const size_t cached = f.alloc->bytes_cached();
  persistent.reset();
  EXPECT_EQ(f.alloc->bytes_cached(), cached + 4096) << "a persistent block goes back to the shared cache";

  // Outside a capture, allocate_persistent is allocate.
  auto plain = f.alloc->allocate_persistent(4096);
  EXPECT_NE(plain.get(), nullptr);

  // An arena belongs to its allocator.
  Fixture other(1 << 20);
  EXPECT_THROW(other.alloc->begin_capture(arena), Error);
}

}  // namespace
}  // namespace bg
