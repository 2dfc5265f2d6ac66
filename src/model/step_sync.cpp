// Step agreement and the StepLayout wire form.
#include "model/step_sync.h"

#include <cstring>

#include "core/error.h"

namespace bg {
namespace {

class Writer {
 public:
  template <typename T>
  void vec(const std::vector<T>& v) {
    scalar(static_cast<int64_t>(v.size()));
    const auto* p = reinterpret_cast<const std::byte*>(v.data());
    out_.insert(out_.end(), p, p + v.size() * sizeof(T));
  }
  void scalar(int64_t v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    out_.insert(out_.end(), p, p + sizeof(v));
  }
  std::vector<std::byte> take() { return std::move(out_); }

 private:
  std::vector<std::byte> out_;
};

class Reader {
 public:
  explicit Reader(std::span<const std::byte> in) : in_(in) {}
  int64_t scalar() {
    int64_t v = 0;
    take(&v, sizeof(v));
    return v;
  }
  template <typename T>
  std::vector<T> vec() {
    const int64_t n = scalar();
    BG_CHECK(n >= 0 && static_cast<size_t>(n) <= (in_.size() - pos_) / sizeof(T), "step layout: {} elements do not "
             "fit the {} bytes left", n, in_.size() - pos_);
    std::vector<T> v(static_cast<size_t>(n));
    take(v.data(), v.size() * sizeof(T));
    return v;
  }
  bool done() const { return pos_ == in_.size(); }

 private:
  void take(void* dst, size_t n) {
    BG_CHECK(n <= in_.size() - pos_, "step layout: truncated at byte {}", pos_);
    if (n == 0) return;  // an empty vector's data() may be null, which memcpy must not see
    std::memcpy(dst, in_.data() + pos_, n);
    pos_ += n;
  }
  std::span<const std::byte> in_;
  size_t pos_ = 0;
};

}  // namespace

StepAgreement agree_step(dist::Comm& world, const StepVote& mine) {
  int64_t v[5] = {mine.stop ? 1 : 0, mine.n_seqs > 0 ? 1 : 0, mine.n_seqs, mine.moe_tokens, mine.prefill ? 1 : 0};
  world.all_reduce_max(v);
  return {v[0] != 0, v[1] != 0, v[2], v[3], v[4] != 0};
}

std::vector<std::byte> encode_step(const StepLayout& s, bool all_rows) {
  Writer w;
  w.scalar(all_rows ? 1 : 0);
  w.scalar(s.max_blocks);
  w.vec(s.token_ids);
  w.vec(s.positions);
  w.vec(s.token_seq);
  w.vec(s.seq_begin);
  w.vec(s.block_tables);
  w.vec(s.state_slots);
  w.vec(s.last_rows);
  return w.take();
}

StepLayout decode_step(std::span<const std::byte> bytes, bool* all_rows) {
  Reader r(bytes);
  StepLayout s;
  *all_rows = r.scalar() != 0;
  s.max_blocks = r.scalar();
  s.token_ids = r.vec<int32_t>();
  s.positions = r.vec<int64_t>();
  s.token_seq = r.vec<int32_t>();
  s.seq_begin = r.vec<int64_t>();
  s.block_tables = r.vec<int32_t>();
  s.state_slots = r.vec<int32_t>();
  s.last_rows = r.vec<int32_t>();
  BG_CHECK(r.done(), "step layout: trailing bytes");
  const size_t n = s.token_ids.size();
  const int64_t seqs = static_cast<int64_t>(s.seq_begin.size()) - 1;
  BG_CHECK(s.positions.size() == n && s.token_seq.size() == n && seqs >= 0 &&
               static_cast<int64_t>(s.last_rows.size()) == seqs &&
               static_cast<int64_t>(s.block_tables.size()) == seqs * s.max_blocks &&
               (s.state_slots.empty() || static_cast<int64_t>(s.state_slots.size()) == seqs),
           "step layout: inconsistent sizes ({} tokens, {} sequences)", n, seqs);
  return s;
}

}  // namespace bg
