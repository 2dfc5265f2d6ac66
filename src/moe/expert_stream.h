// Resident and streamed experts (--resident-experts, docs/WEIGHTS.md "Streamed experts"). A fraction of each MoE
// layer's local experts stays in backend memory for good (ExpertResidency picks them by popularity: a routing trace,
// else expert order); the others stay in host memory (the checkpoint mapping or the weight store, pinned on CUDA) and
// are copied on demand into a pool of expert buffers shared by every layer (ExpertStream). Before a layer's experts
// run, the slots that received rows and hold a streamed expert are staged: a buffer already holding that expert is
// reused, else the least recently used buffer not needed by this layer is rewritten from the host bytes and the slot
// pointed at it. Then the next layer's experts (those its last stage routed to) are prefetched into buffers this
// layer does not use, so their copies overlap this layer's compute. The copies are byte for byte, so the outputs do
// not depend on the fraction or on what was prefetched.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "moe/expert_table.h"

namespace bg::moe {

// Which of this rank's experts stay in backend memory, per layer.
class ExpertResidency {
 public:
  ExpertResidency() = default;  // everything resident
  // round(fraction * n_local) experts per layer stay, the most routed first (trace counts; ties and layers the
  // trace lacks: expert order). fraction in [0, 1]; 1 = every expert resident (no streaming).
  static ExpertResidency plan(const ExpertPlacement& placement, double fraction,
                              const std::filesystem::path& trace = {});

  bool streaming() const { return fraction_ < 1.0; }
  double fraction() const { return fraction_; }
  // Whether this rank keeps `expert` of `layer` in backend memory (experts of other ranks: true, they are skipped
  // by the placement before residency is asked).
  bool resident(int64_t layer, int64_t expert) const;
  int64_t n_resident_per_layer() const { return n_resident_; }
  // Streamed experts per layer on this rank: the pool needs this many buffers for a layer whose rows reach them all.
  int64_t n_streamed_per_layer() const { return n_local_ - n_resident_; }

 private:
  double fraction_ = 1.0;
  int64_t n_local_ = 0, n_resident_ = 0;
  std::vector<uint8_t> default_;                  // [n_experts] resident without a trace entry for the layer
  std::map<int64_t, std::vector<uint8_t>> layer_;  // layer -> [n_experts] from the trace
};

// --resident-experts / --expert-trace for a child process (a worker, a rank) that must stream the same experts;
// nothing at the defaults.
std::vector<std::string> residency_flags(double resident_experts, const std::string& expert_trace);

// The routing counts of a trace file: layer -> routed (token, expert) pairs per expert. Format (JSON):
//   {"format": "batchgen-expert-trace", "version": 1, "n_experts": E,
//    "layers": [{"layer": 3, "counts": [E non-negative integers]}, ...]}
// Throws bg::Error naming the file and the field.
std::map<int64_t, std::vector<uint64_t>> read_expert_trace(const std::filesystem::path& path, int64_t n_experts);
void write_expert_trace(const std::filesystem::path& path, int64_t n_experts,
                        const std::map<int64_t, std::vector<uint64_t>>& counts);

// The ranges grown to whole pages, sorted, and merged where they touch or overlap (a page can be registered with
// the device once); empty ranges are dropped.
std::vector<HostRegion> page_aligned_regions(std::vector<HostRegion> ranges);

// The pool of expert buffers every streamed layer of one model shares, and the routing counters.
class ExpertStream {
 public:
  struct Stats {
    uint64_t copies = 0;         // experts copied into a buffer (prefetches included)
    uint64_t hits = 0;           // streamed experts found already in a buffer (prefetch hits included)
    uint64_t bytes_copied = 0;   // host -> backend bytes
    uint64_t prefetches = 0;     // experts copied ahead for the next layer
    uint64_t prefetch_hits = 0;  // prefetched experts the next layer used
  };
  // Buffers for a model whose layers stream `n_streamed_per_layer` experts each: two layers' worth (the layer that
  // runs, and the next one's prefetches).
  static int64_t pool_buffers(int64_t n_streamed_per_layer) { return 2 * n_streamed_per_layer; }
  // n_buffers expert buffers of `like`'s formats and shapes (every MoE layer's experts are alike). prefetch: copy
  // the next layer's likely experts ahead (BG_EXPERT_PREFETCH=0 in the environment turns it off for measurements).
  ExpertStream(Backend& be, int64_t n_buffers, const ExpertSource& like, int64_t n_experts, bool prefetch = true);

  int64_t n_buffers() const { return static_cast<int64_t>(buffers_.size()); }
  int64_t n_experts() const { return n_experts_; }
  // Bytes of a buffer's part in the backend's layout (adopt_layout; 0: none).
  size_t layout_bytes() const { return layout_bytes_; }
  const Stats& stats() const { return stats_; }
  // Routed (token, expert) pairs seen per layer on this rank, resident experts included (a trace for the planner).
  const std::map<int64_t, std::vector<uint64_t>>& routing_counts() const { return counts_; }
  // Buffer 0's handles: a streamed slot's weights until it is first staged (never read: a slot is staged before
  // any row reaches it).
  ExpertHandles placeholder() const;

  // Notes the host bytes of a streamed expert; pin_host_bytes then pins every noted range at once (page-aligned and
  // merged; CUDA: cudaHostRegister, read-only) so that the copies run at the DMA rate instead of through the
  // driver's pageable staging. Memory that is already pinned (a weight store) is left as it is. At load: pinning a
  // real rank's streamed experts takes seconds, which must not land on the first request.
  void add_host_bytes(const ExpertSource& src);
  void pin_host_bytes(Backend& be);
  // A streamed layer's slots were prepared (load time): where the backend keeps the layer's experts in its own layout
  // (Backend::expert_layout_bytes > 0; CUDA: W4A16 blocks), every buffer gets a second part in that layout, which a
  // stage lays the buffer's expert out into (Backend::lay_out_expert, after its copies) before the layer runs. Every
  // streamed layer of the model must agree.
  void adopt_layout(Backend& be, const ExpertSlots& slots);
  // Makes every slot of `table` (MoE layer `layer`) with rows in `rows_per_slot` hold its expert: streamed experts
  // not in a buffer are copied in (ordered before the ops issued after this call) and their slots rewritten; then
  // prefetches the next layer's (the layer staged after this one last time; ops issued after this call never wait
  // for those copies unless that layer uses them).
  void stage(Backend& be, int64_t layer, ExpertTable& table, std::span<const int32_t> rows_per_slot);

 private:
  struct Buffer {
    WritableLinear gate, up, down;
    Tensor laid_out;             // U8 [layout_bytes_]: the expert in the backend's layout (empty without one)
    bool needs_layout = false;   // loaded since it was last laid out
    int64_t layer = -1;
    int32_t expert = -1;
    uint64_t last_use = 0;  // stage() call that last needed it (or prefetched into it)
    CopyFence pending = 0;  // a prefetch whose copies no op has waited for yet (0: none)
  };
  // Appends the copies that write `src` into `b` (a weight store's W4A16 block straight into the laid-out part where
  // the layers take it; else the checkpoint bytes into the linears, unpacked first for an expert bound deferred) and
  // sets b.needs_layout.
  void fill(Buffer& b, const ExpertSource& src, std::vector<HostCopy>& copies);
  // The least recently used buffer this stage() does not use (buffers_.size(): none).
  size_t pick_victim() const;
  // Makes buffer `index` hold (layer, expert): appends its copies, moves the expert -> buffer map.
  void load(Buffer& b, size_t index, int64_t layer, int32_t expert, const ExpertSource& src,
            std::vector<HostCopy>& copies);
  // Points `slot` of `table` at buffer `index` unless this pool already did.
  void point(Backend& be, ExpertTable& table, int64_t layer, int64_t slot, size_t index);
  void prefetch(Backend& be);

  std::vector<Buffer> buffers_;
  size_t layout_bytes_ = 0;       // Backend::expert_layout_bytes of the streamed layers (0: none)
  bool layout_adopted_ = false;
  bool takes_blocks_ = false;     // every streamed layer takes a weight store's W4A16 blocks as they are
  std::vector<HostRegion> host_bytes_;  // noted by add_host_bytes until pinned
  std::shared_ptr<void> pinned_;        // unpins when the pool goes
  std::map<std::pair<int64_t, int32_t>, size_t> where_;  // (layer, expert) -> buffer
  std::map<int64_t, std::vector<uint64_t>> counts_;
  int64_t n_experts_ = 0;
  uint64_t epoch_ = 0;
  Stats stats_;
  bool prefetch_ = true;
  int64_t last_layer_ = -1;                                    // the layer staged last
  std::map<int64_t, int64_t> next_of_;                         // layer -> the layer staged after it
  std::map<int64_t, std::vector<int32_t>> last_routed_;        // layer -> its streamed experts with rows, last stage
  std::map<int64_t, std::map<int32_t, ExpertSource>> sources_; // layer -> its streamed experts' host bytes
  std::map<int64_t, const ExpertSlots*> slots_;                // layer -> its slots (to lay prefetches out)
  std::map<std::pair<int64_t, int64_t>, size_t> pointed_;      // (layer, slot) -> 1 + the buffer it points at
};

}  // namespace bg::moe
