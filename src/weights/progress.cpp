// LoadProgress: the reporter thread, the terminal block (redrawn with cursor-up + clear-line) and the log line.
#include "weights/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "core/log.h"

namespace bg::weights {
namespace {

double gbps(uint64_t bytes, double seconds) { return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0; }

}  // namespace

std::string format_bytes(uint64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1e12) return fmt::format("{:.2f} TB", b / 1e12);
  if (b >= 1e9) return fmt::format("{:.2f} GB", b / 1e9);
  if (b >= 1e6) return fmt::format("{:.1f} MB", b / 1e6);
  if (b >= 1e3) return fmt::format("{:.1f} kB", b / 1e3);
  return fmt::format("{} B", bytes);
}

LoadProgress::LoadProgress(std::string title, std::vector<File> files, ProgressOptions options)
    : title_(std::move(title)), files_(std::move(files)), o_(options),
      counters_(std::make_unique<Counter[]>(files_.size())) {
  for (const File& f : files_) total_bytes_ += f.total_bytes;
  tty_ = o_.tty < 0 ? ::isatty(STDERR_FILENO) != 0 : o_.tty == 1;
}

LoadProgress::~LoadProgress() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (reporter_.joinable()) reporter_.join();
}

void LoadProgress::start() {
  start_ = std::chrono::steady_clock::now();
  reporter_ = std::thread([this] { run(); });
}

void LoadProgress::add(size_t file, uint64_t bytes) {
  Counter& c = counters_[file];
  if (c.first_ns.load(std::memory_order_relaxed) < 0) {
    int64_t expected = -1;
    c.first_ns.compare_exchange_strong(expected, static_cast<int64_t>(elapsed_s() * 1e9));
  }
  c.bytes.fetch_add(bytes, std::memory_order_relaxed);
}

uint64_t LoadProgress::done_bytes() const {
  uint64_t done = 0;
  for (size_t i = 0; i < files_.size(); ++i) done += counters_[i].bytes.load(std::memory_order_relaxed);
  return done;
}

double LoadProgress::elapsed_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

std::vector<std::string> LoadProgress::render_lines(double elapsed) const {
  std::vector<std::string> lines;
  size_t n_done = 0, n_waiting = 0, n_shown = 0;
  for (size_t i = 0; i < files_.size(); ++i) {
    const uint64_t bytes = counters_[i].bytes.load(std::memory_order_relaxed);
    const int64_t first_ns = counters_[i].first_ns.load(std::memory_order_relaxed);
    if (bytes >= files_[i].total_bytes && files_[i].total_bytes > 0) {
      ++n_done;
      continue;
    }
    if (first_ns < 0) {
      ++n_waiting;
      continue;
    }
    if (n_shown++ >= o_.max_file_lines) continue;
    const double since = elapsed - static_cast<double>(first_ns) / 1e9;
    lines.push_back(fmt::format("  {:<40} {:>10} / {:<10} {:6.2f} GB/s", files_[i].name, format_bytes(bytes),
                                format_bytes(files_[i].total_bytes), gbps(bytes, since)));
  }
  const uint64_t done = done_bytes();
  const double pct = total_bytes_ > 0 ? 100.0 * static_cast<double>(done) / static_cast<double>(total_bytes_) : 100.0;
  lines.insert(lines.begin(), fmt::format("{}: {} / {} ({:.0f}%), {:.2f} GB/s; {} of {} files done, {} waiting",
                                          title_, format_bytes(done), format_bytes(total_bytes_), pct,
                                          gbps(done, elapsed), n_done, files_.size(), n_waiting));
  return lines;
}

std::string LoadProgress::log_line(double elapsed) const {
  const uint64_t done = done_bytes();
  const double pct = total_bytes_ > 0 ? 100.0 * static_cast<double>(done) / static_cast<double>(total_bytes_) : 100.0;
  std::string files;
  for (size_t i = 0; i < files_.size(); ++i) {
    const uint64_t bytes = counters_[i].bytes.load(std::memory_order_relaxed);
    const int64_t first_ns = counters_[i].first_ns.load(std::memory_order_relaxed);
    if (first_ns < 0 || bytes >= files_[i].total_bytes) continue;
    if (!files.empty()) files += ", ";
    files += fmt::format("{} {:.0f}% {:.2f} GB/s", files_[i].name,
                         100.0 * static_cast<double>(bytes) / static_cast<double>(std::max<uint64_t>(1, files_[i].total_bytes)),
                         gbps(bytes, elapsed - static_cast<double>(first_ns) / 1e9));
  }
  return fmt::format("{}: {} / {} ({:.0f}%), {:.2f} GB/s{}{}", title_, format_bytes(done), format_bytes(total_bytes_),
                     pct, gbps(done, elapsed), files.empty() ? "" : "; reading ", files);
}

void LoadProgress::redraw(bool last) {
  std::string out;
  if (drawn_lines_ > 0) out += fmt::format("\x1b[{}F", drawn_lines_);  // back to the block's first line
  std::vector<std::string> lines = last ? std::vector<std::string>{} : render_lines(elapsed_s());
  for (const std::string& l : lines) out += "\x1b[2K" + l + "\n";
  for (size_t i = lines.size(); i < drawn_lines_; ++i) out += "\x1b[2K\n";  // clear what a longer block left
  if (lines.size() < drawn_lines_) out += fmt::format("\x1b[{}F", drawn_lines_ - lines.size());
  drawn_lines_ = lines.size();
  std::fwrite(out.data(), 1, out.size(), stderr);
  std::fflush(stderr);
}

void LoadProgress::run() {
  const double period = tty_ ? o_.redraw_s : o_.log_interval_s;
  std::unique_lock lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, std::chrono::duration<double>(period), [this] { return stop_; });
    if (stop_) break;
    if (tty_) {
      redraw(false);
    } else {
      log::info("{}", log_line(elapsed_s()));
    }
  }
  if (tty_ && drawn_lines_ > 0) redraw(true);
}

void LoadProgress::finish() {
  if (finished_) return;
  finished_ = true;
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (reporter_.joinable()) reporter_.join();
  const double s = elapsed_s();
  const uint64_t done = done_bytes();
  log::info("{}: {} in {:.2f} s ({:.2f} GB/s)", title_, format_bytes(done), s, gbps(done, s));
}

}  // namespace bg::weights
