// StateManager, host tier: page accounting, the copies between the GPU pools and host pages (compressed state goes
// through a staging buffer and the codec), and offloading / restoring whole sequences.
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "core/error.h"
#include "kv/state_manager.h"

namespace bg::kv {

std::vector<int32_t> StateManager::host_alloc(int64_t n_pages, bool state) {
  std::vector<int32_t> pages = host_.alloc(n_pages);
  BG_CHECK(static_cast<int64_t>(pages.size()) == n_pages, "host tier is full: {} pages of {} bytes needed, {} free",
           n_pages, host_.page_bytes(), host_.n_free_pages());
  (state ? host_state_pages_ : host_kv_pages_) += n_pages;
  return pages;
}

void StateManager::host_free(std::vector<int32_t>& pages, bool state) {
  host_.free(pages);
  (state ? host_state_pages_ : host_kv_pages_) -= static_cast<int64_t>(pages.size());
  pages.clear();
}

namespace {

// A compressed slot, layer by layer: the recurrent state through the codec (rows of head_dim values), then the three
// conv states as they are (past conv inputs, already in the activation dtype: kept exact). `words` of a layer.
struct SlotCodec {
  StateCodec codec;
  int64_t rec_floats, layer_words, n_layers, row;

  int64_t rec_bytes() const { return encoded_bytes(codec, rec_floats, row); }
  int64_t conv_bytes() const { return (layer_words - rec_floats) * 4; }
  int64_t bytes() const { return n_layers * (rec_bytes() + conv_bytes()); }
  void encode(const std::byte* slot, std::span<std::byte> out) const {
    BG_CHECK(static_cast<int64_t>(out.size()) == bytes(), "state codec: {} bytes for a slot of {}", out.size(),
             bytes());
    std::byte* o = out.data();
    for (int64_t l = 0; l < n_layers; ++l) {
      const auto* layer = reinterpret_cast<const float*>(slot) + l * layer_words;
      encode_state(codec, {layer, static_cast<size_t>(rec_floats)}, row, {o, static_cast<size_t>(rec_bytes())});
      o += rec_bytes();
      std::memcpy(o, layer + rec_floats, static_cast<size_t>(conv_bytes()));
      o += conv_bytes();
    }
  }
  void decode(std::span<const std::byte> in, std::byte* slot) const {
    BG_CHECK(static_cast<int64_t>(in.size()) == bytes(), "state codec: {} bytes for a slot of {}", in.size(), bytes());
    const std::byte* i = in.data();
    for (int64_t l = 0; l < n_layers; ++l) {
      auto* layer = reinterpret_cast<float*>(slot) + l * layer_words;
      decode_state(codec, {i, static_cast<size_t>(rec_bytes())}, row, {layer, static_cast<size_t>(rec_floats)});
      i += rec_bytes();
      std::memcpy(layer + rec_floats, i, static_cast<size_t>(conv_bytes()));
      i += conv_bytes();
    }
  }
};

SlotCodec slot_codec(StateCodec codec, const KdaStateGeometry& g, const KdaStatePool& pool) {
  return {codec, g.recurrent_floats(), g.layer_words(pool.act_bytes()), g.n_kda_layers,
          std::max<int64_t>(g.head_dim, 1)};
}

}  // namespace

int64_t StateManager::slot_pages() const {
  if (plan_.state_codec == StateCodec::kF32) return host_.pages_for(state_.slot_bytes());
  return host_.pages_for(slot_codec(plan_.state_codec, geometry_.kda, state_).bytes());
}

CopyFence StateManager::blocks_to_host(std::span<const int32_t> blocks, std::span<const int32_t> pages) {
  std::vector<HostCopy> copies;
  const auto bytes = static_cast<size_t>(kv_.block_bytes());
  for (size_t i = 0; i < blocks.size(); ++i) {
    for (const HostCopy& c : host_.copies(kv_.storage(), static_cast<size_t>(blocks[i]) * bytes, bytes,
                                          pages.subspan(i, 1))) {
      copies.push_back(c);
    }
  }
  return last_fence_ = backend_.copy_to_host(copies);
}

void StateManager::blocks_from_host(std::span<const int32_t> pages, std::span<const int32_t> blocks) {
  std::vector<HostCopy> copies;
  const auto bytes = static_cast<size_t>(kv_.block_bytes());
  for (size_t i = 0; i < blocks.size(); ++i) {
    for (const HostCopy& c : host_.copies(kv_.storage(), static_cast<size_t>(blocks[i]) * bytes, bytes,
                                          pages.subspan(i, 1))) {
      copies.push_back(c);
    }
  }
  last_fence_ = backend_.copy_from_host(copies);
}

CopyFence StateManager::slot_to_host(int32_t slot, std::span<const int32_t> pages) {
  const auto bytes = static_cast<size_t>(state_.slot_bytes());
  const size_t offset = static_cast<size_t>(slot) * bytes;
  if (plan_.state_codec == StateCodec::kF32) {
    return last_fence_ = backend_.copy_to_host(host_.copies(state_.storage(), offset, bytes, pages));
  }
  // Compressed: the slot comes to the staging buffer first (the host waits), then is encoded into the pages.
  const HostCopy whole{state_.storage(), offset, staging_.get(), bytes};
  const CopyFence fence = backend_.copy_to_host(std::span<const HostCopy>(&whole, 1));
  backend_.wait_fence(fence);
  const SlotCodec c = slot_codec(plan_.state_codec, geometry_.kda, state_);
  std::vector<std::byte> encoded(static_cast<size_t>(c.bytes()));
  c.encode(staging_.get(), encoded);
  host_.write(encoded, pages);
  return fence;
}

void StateManager::slot_from_host(std::span<const int32_t> pages, int32_t slot) {
  const auto bytes = static_cast<size_t>(state_.slot_bytes());
  const size_t offset = static_cast<size_t>(slot) * bytes;
  if (plan_.state_codec == StateCodec::kF32) {
    last_fence_ = backend_.copy_from_host(host_.copies(state_.storage(), offset, bytes, pages));
    return;
  }
  const SlotCodec c = slot_codec(plan_.state_codec, geometry_.kda, state_);
  std::vector<std::byte> encoded(static_cast<size_t>(c.bytes()));
  host_.read(pages, encoded);
  c.decode(encoded, staging_.get());
  const HostCopy whole{state_.storage(), offset, staging_.get(), bytes};
  backend_.wait_fence(backend_.copy_from_host(std::span<const HostCopy>(&whole, 1)));  // staging is reused next time
}

bool StateManager::offload(Sequence& seq) {
  BG_CHECK(seq.manager_ == this && seq.residency_ == Residency::kGpu, "offload: the sequence is not on the GPU");
  // Blocks past the sequence's position hold nothing yet: they are released, not copied (restore reserves again).
  const int64_t n_blocks = (seq.n_past_ + kv_.block_size() - 1) / kv_.block_size();
  const int64_t n_pages = n_blocks + (seq.kda_slot_ >= 0 ? slot_pages() : 0);
  if (!host_room_for(n_pages, std::numeric_limits<uint64_t>::max())) return false;
  while (static_cast<int64_t>(seq.kv_blocks_.size()) > n_blocks) {
    kv_.unref(seq.kv_blocks_.back());
    seq.kv_blocks_.pop_back();
  }
  seq.host_block_pages_ = host_alloc(n_blocks, false);
  const CopyFence fence = blocks_to_host(seq.kv_blocks_, seq.host_block_pages_);
  for (int32_t b : seq.kv_blocks_) kv_.unref(b, fence);
  seq.kv_blocks_.clear();
  if (seq.kda_slot_ >= 0) {
    seq.host_slot_pages_ = host_alloc(slot_pages(), true);
    state_.free_slot(seq.kda_slot_, slot_to_host(seq.kda_slot_, seq.host_slot_pages_));
    seq.kda_slot_ = -1;
  }
  seq.residency_ = Residency::kHost;
  ++seqs_offloaded_;
  ++counters_.offloads;
  return true;
}

int64_t StateManager::restore_blocks(const Sequence& seq) const {
  return seq.residency_ == Residency::kHost ? static_cast<int64_t>(seq.host_block_pages_.size()) : 0;
}

void StateManager::restore(Sequence& seq) {
  BG_CHECK(seq.manager_ == this && seq.residency_ == Residency::kHost, "restore: the sequence is not offloaded");
  const int64_t n_blocks = static_cast<int64_t>(seq.host_block_pages_.size());
  BG_CHECK(available_blocks() >= n_blocks && (!geometry_.has_state() || available_slots() >= 1), "restore: {} KV "
           "blocks and a state slot are needed, {} blocks and {} slots can be had", n_blocks, available_blocks(),
           available_slots());
  std::vector<int32_t> blocks;
  if (kv_.n_free_blocks() < n_blocks) evict_blocks(n_blocks);
  for (int64_t i = 0; i < n_blocks; ++i) blocks.push_back(kv_.alloc_block());
  blocks_from_host(seq.host_block_pages_, blocks);
  seq.kv_blocks_ = std::move(blocks);
  host_free(seq.host_block_pages_, false);
  if (!seq.host_slot_pages_.empty()) {
    seq.kda_slot_ = alloc_slot(false);
    slot_from_host(seq.host_slot_pages_, seq.kda_slot_);
    host_free(seq.host_slot_pages_, true);
  }
  seq.residency_ = Residency::kGpu;
  --seqs_offloaded_;
  ++counters_.restores;
}

}  // namespace bg::kv
