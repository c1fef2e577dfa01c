#pragma once

// Reading a file ahead of a consumer that maps it, so that the disk works while the consumer
// converts and uploads what the page cache already holds.
//
// The checkpoint loader maps one shard at a time and walks its tensors in file order; each
// page fault then waits for the disk, and the disk waits while the sink converts and uploads a
// tensor. A file_read_ahead reads the same file with large preads on a thread of its own, into
// one scratch buffer (only to fill the page cache), never more than `lead_bytes` past the
// offset its consumer last reported (consumed()), so the page cache it fills stays bounded on a
// host with little memory. It is best effort: a file it cannot open or a read that fails stops
// it quietly, and the consumer's own page faults read (and report errors) as before.
//
// Not copyable or movable (its thread holds `this`); the destructor stops and joins the thread.

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

namespace mini_engine {

class file_read_ahead {
 public:
  // lead_bytes <= 0: no thread (reads nothing). chunk_bytes: the size of each pread.
  file_read_ahead(const std::string& path, int64_t lead_bytes, int64_t chunk_bytes = 64 << 20);
  ~file_read_ahead();
  file_read_ahead(const file_read_ahead&) = delete;
  file_read_ahead& operator=(const file_read_ahead&) = delete;

  // The consumer has reached byte `offset` of the file: read on up to offset + lead_bytes.
  void consumed(int64_t offset);
  // Bytes read so far (tests; the reads never pass the last consumed offset + lead by more
  // than one chunk).
  int64_t bytes_read() const;
  // Whether the reader has stopped: end of file, a failed read, or no thread at all.
  bool finished() const;

 private:
  void run();

  const int64_t lead_, chunk_;
  int fd_ = -1;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  int64_t consumed_ = 0, read_ = 0;
  bool stop_ = false, finished_ = false;
  std::thread thread_;
};

}  // namespace mini_engine
