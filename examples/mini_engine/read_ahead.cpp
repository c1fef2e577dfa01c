#include "read_ahead.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

namespace mini_engine {

file_read_ahead::file_read_ahead(const std::string& path, int64_t lead_bytes, int64_t chunk_bytes)
    : lead_(lead_bytes), chunk_(std::max<int64_t>(4096, chunk_bytes)) {
  if (lead_ > 0) fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) {
    finished_ = true;
    return;
  }
  thread_ = std::thread([this] { run(); });
}

file_read_ahead::~file_read_ahead() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (fd_ >= 0) ::close(fd_);
}

void file_read_ahead::consumed(int64_t offset) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (offset <= consumed_) return;
    consumed_ = offset;
  }
  wake_.notify_all();
}

int64_t file_read_ahead::bytes_read() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return read_;
}

bool file_read_ahead::finished() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return finished_;
}

void file_read_ahead::run() {
  std::vector<char> scratch(static_cast<size_t>(chunk_));
  int64_t at = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || at < consumed_ + lead_; });
      if (stop_) break;
    }
    // Outside the lock: the consumer reports progress while the disk reads.
    const ssize_t n = ::pread(fd_, scratch.data(), scratch.size(), at);
    if (n <= 0) break;  // end of file, or an error the consumer's faults will report
    at += n;
    std::lock_guard<std::mutex> lock(mutex_);
    read_ = at;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  finished_ = true;
}

}  // namespace mini_engine
