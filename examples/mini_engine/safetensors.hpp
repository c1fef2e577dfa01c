#pragma once

// A reader of the safetensors format: the header read and checked on open, the data
// memory-mapped only while a caller reads it (checkpoint.hpp streams a model from it).
//
// Format (huggingface/safetensors): an unsigned 64-bit little-endian header length N, then N
// bytes of UTF-8 JSON (possibly padded with spaces)
//   {"<name>": {"dtype": "F32", "shape": [rows, cols], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"<key>": "<string>", ...}}
// then the data section: tensors row-major, little-endian, each at [begin, end) relative to
// the section's start. The spec asks the data to be indexed entirely: no two tensors
// overlap, no bytes lie between them, and each holds exactly shape x dtype bytes.

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace mini_engine {

struct safetensors_entry {
  std::string name;
  std::string dtype;  // "F32", "BF16", "F16", "F8_E4M3", ... as written
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;  // byte range within the data section
  int64_t numel() const;
};

// Bytes per element of a safetensors dtype name; 0 when unknown.
int64_t safetensors_dtype_bytes(std::string_view dtype);

class safetensors_file {
 public:
  // Reads and checks the header (not the data): throws moebius::error(errc::invalid_argument)
  // naming the file and the problem: cannot open, shorter than its header, a header that is
  // not a JSON object, an entry lacking or mistyping dtype/shape/data_offsets, an unknown
  // dtype, offsets that run past the data section, overlap or leave a hole, or a byte range
  // that is not shape x dtype.
  explicit safetensors_file(const std::string& path);

  const std::string& path() const { return path_; }
  const std::vector<safetensors_entry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const safetensors_entry* find(std::string_view name) const;
  int64_t file_bytes() const { return file_bytes_; }
  int64_t data_bytes() const { return file_bytes_ - data_offset_; }

  // The file mapped read-only (mmap) for as long as this lives; data() is the data section.
  // The pages are the page cache's: only what is touched is read, and unmapping frees them
  // from the process. Throws naming the file when it cannot be mapped or has changed size
  // since the header was read.
  class mapping {
   public:
    mapping() = default;
    mapping(mapping&&) noexcept;
    mapping& operator=(mapping&&) noexcept;
    mapping(const mapping&) = delete;
    mapping& operator=(const mapping&) = delete;
    ~mapping();
    const std::byte* data() const { return base_ + data_offset_; }
    std::span<const std::byte> bytes(const safetensors_entry& e) const {
      return {data() + e.begin, static_cast<size_t>(e.end - e.begin)};
    }

   private:
    friend class safetensors_file;
    const std::byte* base_ = nullptr;
    size_t length_ = 0;
    int64_t data_offset_ = 0;
  };
  mapping map() const;

  // Tensor `name` as float, checked against `shape` (F32, BF16 and F16; others throw). Maps
  // the file for the call. Throws errc::invalid_argument naming the tensor when it is missing
  // or has another shape.
  std::vector<float> read(std::string_view name, std::span<const int64_t> shape) const;

 private:
  std::string path_;
  int64_t file_bytes_ = 0;
  int64_t data_offset_ = 0;  // 8 + header length
  std::vector<safetensors_entry> entries_;
  std::map<std::string, size_t, std::less<>> by_name_;
  std::map<std::string, std::string> metadata_;
};

std::string shape_text(std::span<const int64_t> shape);

}  // namespace mini_engine
