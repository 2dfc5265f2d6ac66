// make-random's tensor writer: seeded values drawn per element (counter-based, so any row range of any tensor can be
// drawn on any thread), encoded in row pieces (dense / FP8 block / MXFP4) and written with pwrite straight to their
// final offsets in pre-sized shard files, with progress on stderr. 13 GB (the K3 ep16-rank preset) runs at the
// speed of the cores and the disk, in a few MB of memory per thread.
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>

#include "core/error.h"
#include "core/log.h"
#include "core/thread_pool.h"
#include "model/random_tensor_plan.h"

namespace bg {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Elements drawn and encoded per piece by default (16 MB of fp32): large enough to amortise the per-piece work, small
// enough that every thread gets many pieces of the big tensors (lm_head and the embedding are 1.2 G elements each).
constexpr int64_t kDefaultPieceElements = int64_t{1} << 22;

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// The inverse normal CDF (Acklam's rational approximation, relative error below 1.2e-9: far below what bf16, FP8 or
// MXFP4 storage keeps).
double normal_quantile(double p) {
  static constexpr double a[] = {-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
                                 1.383577518672690e+02,  -3.066479806614716e+01, 2.506628277459239e+00};
  static constexpr double b[] = {-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
                                 6.680131188771972e+01,  -1.328068155288572e+01};
  static constexpr double c[] = {-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
                                 -2.549732539343734e+00, 4.374664141464968e+00,  2.938163982698783e+00};
  static constexpr double d[] = {7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
                                 3.754408661907416e+00};
  constexpr double kLow = 0.02425;
  auto tail = [&](double q) {
    return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
           ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1.0);
  };
  if (p < kLow) return tail(std::sqrt(-2.0 * std::log(p)));
  if (p > 1.0 - kLow) return -tail(std::sqrt(-2.0 * std::log(1.0 - p)));
  const double q = p - 0.5, r = q * q;
  return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
         (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1.0);
}

// Standard-normal quantiles at p = k / 2^16 (k = 1 .. 2^16 - 1; the two end points at half a bin from 0 and 1): a
// draw is the linear interpolation of this table at a uniform, so one hash and one lookup per element give
// Normal(0, 1) truncated at +-4.33 (Transcendental Box-Muller per element was 10x slower and made 13 GB take minutes).
constexpr int kQuantileBits = 16;
constexpr int64_t kQuantiles = int64_t{1} << kQuantileBits;

const std::vector<float>& quantile_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(static_cast<size_t>(kQuantiles + 1));
    const double n = static_cast<double>(kQuantiles);
    for (int64_t k = 0; k <= kQuantiles; ++k) {
      const double p = k == 0 ? 0.5 / n : k == kQuantiles ? 1.0 - 0.5 / n : static_cast<double>(k) / n;
      t[static_cast<size_t>(k)] = static_cast<float>(normal_quantile(p));
    }
    return t;
  }();
  return table;
}

// Elements [first, first + out.size()) of a tensor whose values are Normal(mean, std): element i is the quantile
// table read at the uniform splitmix64(key + i * gamma) (the top 16 bits pick the bin, the next 24 the position in
// it). Only integer hashing and a table built from fixed formulas: the bytes depend on nothing but (seed, name, i).
void draw_normal(uint64_t key, int64_t first, std::span<float> out, double mean, double std) {
  const float* q = quantile_table().data();
  const auto m = static_cast<float>(mean), s = static_cast<float>(std);
  constexpr float kFraction = 1.0f / 16777216.0f;  // 2^-24
  for (size_t j = 0; j < out.size(); ++j) {
    const uint64_t h = splitmix64(key + static_cast<uint64_t>(first + static_cast<int64_t>(j)) * 0x9e3779b97f4a7c15ull);
    const auto k = static_cast<size_t>(h >> (64 - kQuantileBits));
    const float t = static_cast<float>((h >> (64 - kQuantileBits - 24)) & 0xffffff) * kFraction;
    out[j] = m + s * (q[k] + (q[k + 1] - q[k]) * t);
  }
}

void pwrite_all(int fd, const void* data, size_t n, uint64_t offset, const fs::path& path) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(offset));
    if (w < 0 && errno == EINTR) continue;
    BG_CHECK(w > 0, "write to '{}' failed at offset {}: {}", path.string(), offset, std::strerror(errno));
    p += w;
    n -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
}

// One shard file, created at its final size; its parts are filled in place.
class ShardFile {
 public:
  ShardFile(fs::path path, const std::string& header, uint64_t data_bytes) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    BG_CHECK(fd_ >= 0, "cannot create '{}': {}", path_.string(), std::strerror(errno));
    uint8_t len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>((header.size() >> (8 * i)) & 0xff);
    pwrite_all(fd_, len, 8, 0, path_);
    pwrite_all(fd_, header.data(), header.size(), 8, path_);
    data_start_ = 8 + header.size();
    BG_CHECK(::ftruncate(fd_, static_cast<off_t>(data_start_ + data_bytes)) == 0, "cannot size '{}' to {} bytes: {}",
             path_.string(), data_start_ + data_bytes, std::strerror(errno));
  }
  ~ShardFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  ShardFile(const ShardFile&) = delete;
  ShardFile& operator=(const ShardFile&) = delete;

  void write(const void* data, size_t n, uint64_t data_offset) const {
    pwrite_all(fd_, data, n, data_start_ + data_offset, path_);
  }
  void close() {
    const int fd = std::exchange(fd_, -1);
    BG_CHECK(::close(fd) == 0, "closing '{}' failed: {}", path_.string(), std::strerror(errno));
  }

 private:
  fs::path path_;
  int fd_ = -1;
  uint64_t data_start_ = 0;
};

// Where a planned tensor goes: its shard and the data offset of each stored part.
struct Placement {
  int64_t shard = 0;
  std::vector<uint64_t> part_offsets;
};

// A row range of one tensor: the unit of work.
struct Piece {
  size_t tensor = 0;
  int64_t row_begin = 0, row_end = 0;
};

// Rows x columns of a tensor as written (a vector is one row).
std::pair<int64_t, int64_t> rows_cols(const Shape& shape) {
  const int64_t numel = shape_numel(shape);
  const int64_t rows = shape.size() >= 2 ? shape[0] : 1;
  return {rows, rows == 0 ? 0 : numel / rows};
}

std::vector<Piece> split_into_pieces(const std::vector<PlannedTensor>& tensors, int64_t piece_elements) {
  std::vector<Piece> pieces;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto [rows, cols] = rows_cols(tensors[i].shape);
    int64_t step = std::max<int64_t>(1, piece_elements / std::max<int64_t>(cols, 1));
    // FP8 scales cover 128 x 128 blocks: pieces start at multiples of 128 rows.
    if (tensors[i].plan.format == WeightFormat::kFp8Block) step = (step + kFp8BlockSize - 1) / kFp8BlockSize * kFp8BlockSize;
    for (int64_t r = 0; r < rows; r += step) pieces.push_back({i, r, std::min(rows, r + step)});
    if (rows == 0) pieces.push_back({i, 0, 0});
  }
  return pieces;
}

uint64_t tensor_key(uint64_t seed, const std::string& name) { return splitmix64(seed ^ splitmix64(fnv1a(name))); }

// Draws, adjusts, encodes and writes one piece. `values` is the calling thread's scratch.
void write_piece(const PlannedTensor& t, const Placement& at, const ShardFile& file, const Piece& piece, uint64_t seed,
                 std::vector<float>& values) {
  const int64_t cols = rows_cols(t.shape).second;
  const int64_t n_rows = piece.row_end - piece.row_begin, first = piece.row_begin * cols;
  values.resize(static_cast<size_t>(n_rows * cols));
  draw_normal(tensor_key(seed, t.name), first, values, t.plan.mean, t.plan.std);
  if (t.plan.adjust) t.plan.adjust(std::span<float>(values), first);
  switch (t.plan.format) {
    case WeightFormat::kDense:
      if (t.plan.dtype == DType::kF32) {
        file.write(values.data(), values.size() * 4, at.part_offsets[0] + static_cast<uint64_t>(first) * 4);
      } else {
        std::vector<uint16_t> bits(values.size());
        for (size_t i = 0; i < values.size(); ++i) bits[i] = f32_to_bf16(values[i]);
        file.write(bits.data(), bits.size() * 2, at.part_offsets[0] + static_cast<uint64_t>(first) * 2);
      }
      return;
    case WeightFormat::kFp8Block: {
      HostTensor codes, scales;
      quantize_fp8_block(values.data(), n_rows, cols, &codes, &scales);
      const uint64_t scale_row_bytes = static_cast<uint64_t>((cols + kFp8BlockSize - 1) / kFp8BlockSize) * 4;
      file.write(codes.data(), codes.nbytes(), at.part_offsets[0] + static_cast<uint64_t>(first));
      file.write(scales.data(), scales.nbytes(),
                 at.part_offsets[1] + static_cast<uint64_t>(piece.row_begin / kFp8BlockSize) * scale_row_bytes);
      return;
    }
    case WeightFormat::kMxfp4: {
      HostTensor codes, scales;
      quantize_mxfp4(values.data(), n_rows, cols, &codes, &scales);
      file.write(codes.data(), codes.nbytes(), at.part_offsets[0] + static_cast<uint64_t>(first / 2));
      file.write(scales.data(), scales.nbytes(),
                 at.part_offsets[1] + static_cast<uint64_t>(first / kMxfp4GroupSize));
      return;
    }
  }
}

// Progress of a long write on stderr: a live line on a terminal, a log line every 5 s otherwise, and a summary.
class Progress {
 public:
  Progress(uint64_t total_bytes, bool enabled) : total_(total_bytes), enabled_(enabled) {
    start_ = std::chrono::steady_clock::now();
    if (!enabled_) return;
    tty_ = ::isatty(STDERR_FILENO) == 1;
    thread_ = std::thread([this] { loop(); });
  }
  ~Progress() { stop(); }
  void add(uint64_t bytes) { done_.fetch_add(bytes, std::memory_order_relaxed); }
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  void stop() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
    if (tty_) std::fprintf(stderr, "\n");
  }

 private:
  void loop() {
    std::unique_lock lock(mutex_);
    const auto period = tty_ ? std::chrono::milliseconds(250) : std::chrono::milliseconds(5000);
    while (!cv_.wait_for(lock, period, [this] { return stopping_; })) report();
    report();
  }
  void report() const {
    const double gb = static_cast<double>(done_.load(std::memory_order_relaxed)) / 1e9, s = seconds();
    const double total_gb = static_cast<double>(total_) / 1e9, rate = s > 0 ? gb / s : 0.0;
    if (tty_) {
      std::fprintf(stderr, "\rmake-random: %.2f / %.2f GB (%.2f GB/s)   ", gb, total_gb, rate);
      std::fflush(stderr);
    } else {
      log::info("make-random: {:.2f} / {:.2f} GB written ({:.2f} GB/s)", gb, total_gb, rate);
    }
  }

  uint64_t total_;
  bool enabled_, tty_ = false, stopping_ = false;
  std::atomic<uint64_t> done_{0};
  std::chrono::steady_clock::time_point start_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::thread thread_;
};

// The safetensors header of one shard (the format write_safetensors writes: offsets relative to the data start,
// padded with spaces to 8 bytes) and each part's data offset.
std::string shard_header(const std::vector<PlannedTensor>& tensors, int64_t shard, std::vector<Placement>& placements,
                         uint64_t& data_bytes, json& weight_map, const std::string& file) {
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].shard != shard) continue;
    placements[i].shard = shard;
    for (const StoredPart& part : stored_parts(tensors[i])) {
      BG_CHECK(!header.contains(part.name), "make-random: duplicate tensor name '{}'", part.name);
      header[part.name] = {{"dtype", std::string(dtype_name(part.dtype))},
                           {"shape", part.shape},
                           {"data_offsets", {offset, offset + part.nbytes}}};
      placements[i].part_offsets.push_back(offset);
      weight_map[part.name] = file;
      offset += part.nbytes;
    }
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text.push_back(' ');
  data_bytes = offset;
  return text;
}

}  // namespace

void draw_random_normal(uint64_t seed, const std::string& name, int64_t first, std::span<float> out, double mean,
                        double std) {
  draw_normal(tensor_key(seed, name), first, out, mean, std);
}

void write_random_tensors(const ArchTable& table, const RandomTensorPolicy& policy, const RandomTensorOptions& options,
                          const fs::path& dir) {
  BG_CHECK(options.n_shards >= 1 && options.n_shards <= 99999, "make-random: shard count {} must be in [1, 99999]",
           options.n_shards);
  BG_CHECK(options.n_threads >= 0, "make-random: thread count {} must be >= 0", options.n_threads);
  std::vector<PlannedTensor> tensors = plan_tensors(table, policy, options.format);
  assign_shards(tensors, options.n_shards);
  std::vector<Placement> placements(tensors.size());
  std::vector<std::unique_ptr<ShardFile>> files;
  json weight_map = json::object();
  uint64_t total_bytes = 0;
  for (int64_t k = 0; k < options.n_shards; ++k) {
    const std::string name = shard_file_name(k, options.n_shards);
    uint64_t data_bytes = 0;
    const std::string header = shard_header(tensors, k, placements, data_bytes, weight_map, name);
    files.push_back(std::make_unique<ShardFile>(dir / name, header, data_bytes));
    total_bytes += data_bytes;
  }
  BG_CHECK(options.piece_elements >= 0, "make-random: piece size {} must be >= 0", options.piece_elements);
  const std::vector<Piece> pieces =
      split_into_pieces(tensors, options.piece_elements > 0 ? options.piece_elements : kDefaultPieceElements);
  std::optional<ThreadPool> own_pool;
  if (options.n_threads > 0) own_pool.emplace(options.n_threads);
  ThreadPool& pool = own_pool ? *own_pool : default_pool();
  Progress progress(total_bytes, options.show_progress);
  // Workers must not throw through the pool: the first error is kept and rethrown here.
  std::mutex error_mutex;
  std::string error;
  pool.parallel_for(static_cast<int64_t>(pieces.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> values;
    for (int64_t i = begin; i < end; ++i) {
      const Piece& p = pieces[static_cast<size_t>(i)];
      const PlannedTensor& t = tensors[p.tensor];
      try {
        {
          std::lock_guard lock(error_mutex);
          if (!error.empty()) return;
        }
        write_piece(t, placements[p.tensor], *files[static_cast<size_t>(t.shard)], p, options.seed, values);
        const uint64_t rows = static_cast<uint64_t>(std::max<int64_t>(rows_cols(t.shape).first, 1));
        progress.add(t.nbytes * static_cast<uint64_t>(std::max<int64_t>(p.row_end - p.row_begin, 1)) / rows);
      } catch (const std::exception& e) {
        std::lock_guard lock(error_mutex);
        if (error.empty()) error = e.what();
      }
    }
  });
  progress.stop();
  BG_CHECK(error.empty(), "{}", error);
  for (auto& f : files) f->close();
  json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
  write_text_file(dir / kIndexName, index.dump(2) + "\n");
  const double s = progress.seconds();
  log::info("make-random: {:.2f} GB in {} shards, {:.1f} s ({:.2f} GB/s, {} threads)", static_cast<double>(total_bytes) / 1e9,
            options.n_shards, s, s > 0 ? static_cast<double>(total_bytes) / 1e9 / s : 0.0, pool.n_threads());
}

}  // namespace bg
