#include "safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <moebius/error.hpp>
#include <nlohmann/json.hpp>
#include <sstream>

#include "numerics.hpp"

namespace mini_engine {

using moebius::errc;
using nlohmann::json;

namespace {

// The spec's own limit on the header (safetensors refuses larger ones): 100 MB.
constexpr uint64_t k_max_header_bytes = 100'000'000;

struct fd_guard {
  int fd = -1;
  ~fd_guard() {
    if (fd >= 0) ::close(fd);
  }
};

// Reads exactly n bytes at `offset`; false on a short read.
bool pread_all(int fd, void* out, size_t n, int64_t offset) {
  auto* p = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got;
    n -= static_cast<size_t>(got);
    offset += got;
  }
  return true;
}

int64_t to_offset(const json& v, const std::string& path, const std::string& what) {
  MOEBIUS_CHECK(v.is_number_unsigned() && v.get<uint64_t>() <= (uint64_t{1} << 62),
                errc::invalid_argument, "safetensors ", path, ": ", what,
                " must be a non-negative integer (got ", v.dump(), ")");
  return static_cast<int64_t>(v.get<uint64_t>());
}

}  // namespace

int64_t safetensors_entry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t safetensors_dtype_bytes(std::string_view d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL" || d == "F8_E4M3" || d == "F8_E5M2") return 1;
  return 0;
}

std::string shape_text(std::span<const int64_t> shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

safetensors_file::safetensors_file(const std::string& path) : path_(path) {
  fd_guard f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  MOEBIUS_CHECK(f.fd >= 0, errc::invalid_argument, "safetensors ", path,
                ": cannot open (", std::strerror(errno), ")");
  struct stat st {};
  MOEBIUS_CHECK(::fstat(f.fd, &st) == 0 && S_ISREG(st.st_mode), errc::invalid_argument,
                "safetensors ", path, ": not a regular file");
  file_bytes_ = static_cast<int64_t>(st.st_size);
  MOEBIUS_CHECK(file_bytes_ >= 8, errc::invalid_argument, "safetensors ", path, ": ", file_bytes_,
                " bytes, shorter than the 8-byte header length");
  unsigned char len_bytes[8];
  MOEBIUS_CHECK(pread_all(f.fd, len_bytes, 8, 0), errc::invalid_argument, "safetensors ", path,
                ": read failed");
  uint64_t header_len = 0;  // little-endian, whatever the host's byte order
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  MOEBIUS_CHECK(header_len <= static_cast<uint64_t>(file_bytes_ - 8), errc::invalid_argument,
                "safetensors ", path, ": header length ", header_len, " exceeds the file's ",
                file_bytes_ - 8, " remaining bytes (truncated?)");
  MOEBIUS_CHECK(header_len <= k_max_header_bytes, errc::invalid_argument, "safetensors ", path,
                ": header length ", header_len, " exceeds the format's limit of ",
                k_max_header_bytes);
  std::string header(static_cast<size_t>(header_len), '\0');
  MOEBIUS_CHECK(pread_all(f.fd, header.data(), header.size(), 8), errc::invalid_argument,
                "safetensors ", path, ": read failed");
  data_offset_ = 8 + static_cast<int64_t>(header_len);
  const int64_t data_size = file_bytes_ - data_offset_;

  json doc;
  try {
    doc = json::parse(header);
  } catch (const json::parse_error& e) {
    MOEBIUS_FAIL(errc::invalid_argument, "safetensors ", path, ": bad JSON header (", e.what(),
                 ")");
  }
  MOEBIUS_CHECK(doc.is_object(), errc::invalid_argument, "safetensors ", path,
                ": the header is not a JSON object");
  for (const auto& [name, v] : doc.items()) {
    if (name == "__metadata__") {
      MOEBIUS_CHECK(v.is_object(), errc::invalid_argument, "safetensors ", path,
                    ": __metadata__ is not an object");
      for (const auto& [key, val] : v.items()) {
        MOEBIUS_CHECK(val.is_string(), errc::invalid_argument, "safetensors ", path,
                      ": __metadata__ value of ", key, " is not a string");
        metadata_[key] = val.get<std::string>();
      }
      continue;
    }
    MOEBIUS_CHECK(v.is_object() && v.contains("dtype") && v.contains("shape") &&
                      v.contains("data_offsets"),
                  errc::invalid_argument, "safetensors ", path, ": tensor ", name,
                  " is not an object with dtype, shape and data_offsets");
    safetensors_entry e;
    e.name = name;
    MOEBIUS_CHECK(v["dtype"].is_string(), errc::invalid_argument, "safetensors ", path,
                  ": tensor ", name, " dtype is not a string");
    e.dtype = v["dtype"].get<std::string>();
    const int64_t elem = safetensors_dtype_bytes(e.dtype);
    MOEBIUS_CHECK(elem > 0, errc::invalid_argument, "safetensors ", path, ": tensor ", name,
                  " has unknown dtype ", e.dtype);
    MOEBIUS_CHECK(v["shape"].is_array(), errc::invalid_argument, "safetensors ", path,
                  ": tensor ", name, " shape is not an array");
    int64_t numel = 1;
    for (const json& d : v["shape"]) {
      const int64_t n = to_offset(d, path, "tensor " + name + " shape");
      MOEBIUS_CHECK(n == 0 || numel <= (int64_t{1} << 62) / n, errc::invalid_argument,
                    "safetensors ", path, ": tensor ", name, " shape overflows");
      numel *= n;
      e.shape.push_back(n);
    }
    const json& off = v["data_offsets"];
    MOEBIUS_CHECK(off.is_array() && off.size() == 2, errc::invalid_argument, "safetensors ", path,
                  ": tensor ", name, " data_offsets must be [begin, end]");
    e.begin = to_offset(off[0], path, "tensor " + name + " data_offsets");
    e.end = to_offset(off[1], path, "tensor " + name + " data_offsets");
    MOEBIUS_CHECK(e.begin <= e.end && e.end <= data_size, errc::invalid_argument, "safetensors ",
                  path, ": tensor ", name, " data_offsets [", e.begin, ", ", e.end,
                  ") run past the end of the ", data_size, "-byte data section (truncated?)");
    MOEBIUS_CHECK(numel <= (int64_t{1} << 62) / elem && e.end - e.begin == numel * elem,
                  errc::invalid_argument, "safetensors ", path, ": tensor ", name, " holds ",
                  e.end - e.begin, " bytes, ", e.dtype, " ", shape_text(e.shape), " needs ",
                  numel * elem);
    entries_.push_back(std::move(e));
  }
  // The data section indexed entirely: tensors in offset order, each starting where the
  // previous one ended (no overlap, no hole), the last ending at the section's end.
  std::vector<const safetensors_entry*> order;
  for (const auto& e : entries_) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const auto* a, const auto* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  int64_t at = 0;
  const safetensors_entry* prev = nullptr;
  for (const safetensors_entry* e : order) {
    MOEBIUS_CHECK(e->begin >= at, errc::invalid_argument, "safetensors ", path, ": tensor ",
                  e->name, " [", e->begin, ", ", e->end, ") overlaps tensor ", prev->name, " [",
                  prev->begin, ", ", prev->end, ")");
    MOEBIUS_CHECK(e->begin == at, errc::invalid_argument, "safetensors ", path, ": ",
                  e->begin - at, " bytes before tensor ", e->name, " at ", e->begin,
                  " belong to no tensor (the format allows no holes)");
    at = e->end;
    prev = e;
  }
  MOEBIUS_CHECK(at == data_size, errc::invalid_argument, "safetensors ", path, ": ",
                data_size - at, " bytes after the last tensor belong to no tensor");
  for (size_t i = 0; i < entries_.size(); ++i) by_name_.emplace(entries_[i].name, i);
}

const safetensors_entry* safetensors_file::find(std::string_view name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &entries_[it->second];
}

safetensors_file::mapping::mapping(mapping&& o) noexcept
    : base_(o.base_), length_(o.length_), data_offset_(o.data_offset_) {
  o.base_ = nullptr;
  o.length_ = 0;
}

safetensors_file::mapping& safetensors_file::mapping::operator=(mapping&& o) noexcept {
  if (this != &o) {
    if (base_) ::munmap(const_cast<std::byte*>(base_), length_);
    base_ = o.base_;
    length_ = o.length_;
    data_offset_ = o.data_offset_;
    o.base_ = nullptr;
    o.length_ = 0;
  }
  return *this;
}

safetensors_file::mapping::~mapping() {
  if (base_) ::munmap(const_cast<std::byte*>(base_), length_);
}

safetensors_file::mapping safetensors_file::map() const {
  fd_guard f{::open(path_.c_str(), O_RDONLY | O_CLOEXEC)};
  MOEBIUS_CHECK(f.fd >= 0, errc::invalid_argument, "safetensors ", path_, ": cannot open (",
                std::strerror(errno), ")");
  struct stat st {};
  MOEBIUS_CHECK(::fstat(f.fd, &st) == 0 && static_cast<int64_t>(st.st_size) == file_bytes_,
                errc::invalid_argument, "safetensors ", path_, ": changed size since its header "
                "was read (", file_bytes_, " bytes then)");
  mapping m;
  m.data_offset_ = data_offset_;
  m.length_ = static_cast<size_t>(file_bytes_);
  void* p = ::mmap(nullptr, m.length_, PROT_READ, MAP_PRIVATE, f.fd, 0);
  MOEBIUS_CHECK(p != MAP_FAILED, errc::invalid_argument, "safetensors ", path_,
                ": cannot map (", std::strerror(errno), ")");
  // One pass front to back: read ahead, and drop pages behind.
  ::madvise(p, m.length_, MADV_SEQUENTIAL);
  m.base_ = static_cast<const std::byte*>(p);
  return m;
}

std::vector<float> safetensors_file::read(std::string_view name,
                                          std::span<const int64_t> shape) const {
  const safetensors_entry* e = find(name);
  MOEBIUS_CHECK(e != nullptr, errc::invalid_argument, "safetensors ", path_, ": no tensor ", name);
  MOEBIUS_CHECK(std::equal(e->shape.begin(), e->shape.end(), shape.begin(), shape.end()),
                errc::invalid_argument, "safetensors ", path_, ": tensor ", name, " has shape ",
                shape_text(e->shape), ", the model needs ", shape_text(shape));
  MOEBIUS_CHECK(e->dtype == "F32" || e->dtype == "BF16" || e->dtype == "F16",
                errc::invalid_argument, "safetensors ", path_, ": tensor ", name, " is ",
                e->dtype, "; read() converts F32, BF16 and F16");
  const mapping m = map();
  const std::byte* p = m.data() + e->begin;
  const int64_t n = e->numel();
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    if (e->dtype == "F32") {
      std::memcpy(&out[static_cast<size_t>(i)], p + 4 * i, 4);
    } else {
      uint16_t u;
      std::memcpy(&u, p + 2 * i, 2);
      out[static_cast<size_t>(i)] = e->dtype == "BF16" ? from_bf16(u) : from_fp16(u);
    }
  }
  return out;
}

}  // namespace mini_engine
