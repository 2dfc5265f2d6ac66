// Progress of a load over several files (checkpoint shards, store segments): bytes and GB/s per file and in total.
// On a terminal the lines are redrawn in place a few times a second; otherwise (a log file, a daemon) one log line is
// written every `log_interval_s`. Counters are atomics: any reader thread adds to them.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace bg::weights {

struct ProgressOptions {
  int tty = -1;                  // 1: redraw on stderr, 0: log lines, -1: decide by isatty(stderr)
  double redraw_s = 0.25;        // terminal redraw period
  double log_interval_s = 10.0;  // log line period when not a terminal
  size_t max_file_lines = 8;     // files shown at once on a terminal (the ones being read)
};

class LoadProgress {
 public:
  struct File {
    std::string name;
    uint64_t total_bytes = 0;
  };
  LoadProgress(std::string title, std::vector<File> files, ProgressOptions options = {});
  ~LoadProgress();  // stops the reporter (without the final line if finish() was not called)
  LoadProgress(const LoadProgress&) = delete;
  LoadProgress& operator=(const LoadProgress&) = delete;

  // Starts the reporter thread.
  void start();
  void add(size_t file, uint64_t bytes);
  // Stops the reporter and writes the summary line ("<title>: 12.4 GB in 3.1 s (4.0 GB/s)").
  void finish();

  uint64_t done_bytes() const;
  uint64_t total_bytes() const { return total_bytes_; }
  // What the reporter prints (tests): the terminal block and the log line at `elapsed_s`.
  std::vector<std::string> render_lines(double elapsed_s) const;
  std::string log_line(double elapsed_s) const;

 private:
  struct Counter {
    std::atomic<uint64_t> bytes{0};
    std::atomic<int64_t> first_ns{-1};  // when its first byte arrived, ns since start
  };
  double elapsed_s() const;
  void run();
  void redraw(bool last);

  std::string title_;
  std::vector<File> files_;
  ProgressOptions o_;
  uint64_t total_bytes_ = 0;
  std::unique_ptr<Counter[]> counters_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  bool tty_ = false;
  size_t drawn_lines_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool finished_ = false;
  std::thread reporter_;
};

// "12.4 GB", "512.0 MB" (decimal units, as disks and links are quoted).
std::string format_bytes(uint64_t bytes);

}  // namespace bg::weights
