#include "safetensors.hpp"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <fstream>
#include <memory>
#include <moebius/error.hpp>
#include <sstream>

#include "numerics.hpp"

namespace mini_engine {

using moebius::errc;

namespace {

// Just enough JSON for a safetensors header: objects, arrays, strings, integers, and the
// literals (kept as text).
struct json {
  enum class kind { object, array, string, number, literal } k = kind::literal;
  std::vector<std::pair<std::string, json>> members;  // object, in file order
  std::vector<json> items;                            // array
  std::string text;                                   // string, number or literal
};

class json_parser {
 public:
  json_parser(std::string_view s, const std::string& file) : s_(s), file_(file) {}

  json parse_document() {
    json v = value();
    skip_ws();
    if (pos_ != s_.size()) fail("trailing characters after the header object");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) {
    moebius::detail::throw_error(errc::invalid_argument, __FILE__, __LINE__, "safetensors ", file_,
                                 ": bad JSON header at byte ", pos_, ": ", what);
  }
  void skip_ws() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\n' || s_[pos_] == '\r' || s_[pos_] == '\t'))
      ++pos_;
  }
  char peek() {
    skip_ws();
    if (pos_ >= s_.size()) fail("unexpected end");
    return s_[pos_];
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++pos_;
  }
  std::string string() {
    expect('"');
    std::string out;
    while (true) {
      if (pos_ >= s_.size()) fail("unterminated string");
      const char c = s_[pos_++];
      if (c == '"') return out;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= s_.size()) fail("unterminated escape");
      const char e = s_[pos_++];
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out += e;
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          if (pos_ + 4 > s_.size()) fail("short \\u escape");
          const unsigned cp =
              static_cast<unsigned>(std::stoul(std::string(s_.substr(pos_, 4)), nullptr, 16));
          pos_ += 4;
          // UTF-8 of a BMP code point (surrogate pairs do not occur in tensor names).
          if (cp < 0x80) {
            out += static_cast<char>(cp);
          } else if (cp < 0x800) {
            out += static_cast<char>(0xc0 | (cp >> 6));
            out += static_cast<char>(0x80 | (cp & 0x3f));
          } else {
            out += static_cast<char>(0xe0 | (cp >> 12));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
            out += static_cast<char>(0x80 | (cp & 0x3f));
          }
          break;
        }
        default:
          fail("bad escape");
      }
    }
  }
  json value() {
    json v;
    const char c = peek();
    if (c == '{') {
      v.k = json::kind::object;
      ++pos_;
      if (peek() == '}') {
        ++pos_;
        return v;
      }
      while (true) {
        std::string key = string();
        expect(':');
        v.members.emplace_back(std::move(key), value());
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        expect('}');
        return v;
      }
    }
    if (c == '[') {
      v.k = json::kind::array;
      ++pos_;
      if (peek() == ']') {
        ++pos_;
        return v;
      }
      while (true) {
        v.items.push_back(value());
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.k = json::kind::string;
      v.text = string();
      return v;
    }
    const size_t start = pos_;
    while (pos_ < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[pos_])) ||
                                s_[pos_] == '-' || s_[pos_] == '+' || s_[pos_] == '.'))
      ++pos_;
    if (pos_ == start) fail("unexpected character");
    v.text = std::string(s_.substr(start, pos_ - start));
    v.k = (v.text == "true" || v.text == "false" || v.text == "null") ? json::kind::literal
                                                                      : json::kind::number;
    return v;
  }

  std::string_view s_;
  const std::string& file_;
  size_t pos_ = 0;
};

int64_t dtype_size(const std::string& d) {
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

int64_t to_int(const json& v, const std::string& file, const std::string& what) {
  MOEBIUS_CHECK(v.k == json::kind::number && !v.text.empty() &&
                    v.text.find_first_not_of("0123456789") == std::string::npos,
                errc::invalid_argument, "safetensors ", file, ": ", what,
                " must be a non-negative integer (got '", v.text, "')");
  return std::stoll(v.text);
}

}  // namespace

safetensors_file::safetensors_file(const std::string& path) : path_(path) {
  std::ifstream in(path, std::ios::binary);
  MOEBIUS_CHECK(in.good(), errc::invalid_argument, "safetensors ", path, ": cannot open");
  in.seekg(0, std::ios::end);
  const int64_t size = static_cast<int64_t>(in.tellg());
  in.seekg(0);
  MOEBIUS_CHECK(size >= 8, errc::invalid_argument, "safetensors ", path, ": ", size,
                " bytes, shorter than the 8-byte header length");
  unsigned char len_bytes[8];
  in.read(reinterpret_cast<char*>(len_bytes), 8);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  MOEBIUS_CHECK(header_len <= static_cast<uint64_t>(size - 8), errc::invalid_argument,
                "safetensors ", path, ": header length ", header_len, " exceeds the file's ",
                size - 8, " remaining bytes");
  std::string header(static_cast<size_t>(header_len), '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  data_.resize(static_cast<size_t>(size - 8 - static_cast<int64_t>(header_len)));
  in.read(reinterpret_cast<char*>(data_.data()), static_cast<std::streamsize>(data_.size()));
  MOEBIUS_CHECK(in.good(), errc::invalid_argument, "safetensors ", path, ": read failed");

  const json doc = json_parser(header, path_).parse_document();
  MOEBIUS_CHECK(doc.k == json::kind::object, errc::invalid_argument, "safetensors ", path,
                ": the header is not a JSON object");
  for (const auto& [name, v] : doc.members) {
    if (name == "__metadata__") {
      for (const auto& [key, val] : v.members) metadata_[key] = val.text;
      continue;
    }
    MOEBIUS_CHECK(v.k == json::kind::object, errc::invalid_argument, "safetensors ", path,
                  ": entry ", name, " is not an object");
    safetensors_entry e;
    e.name = name;
    bool has_dtype = false, has_shape = false, has_offsets = false;
    for (const auto& [key, val] : v.members) {
      if (key == "dtype") {
        e.dtype = val.text;
        has_dtype = true;
      } else if (key == "shape") {
        for (const json& d : val.items) e.shape.push_back(to_int(d, path, name + " shape"));
        has_shape = val.k == json::kind::array;
      } else if (key == "data_offsets") {
        MOEBIUS_CHECK(val.k == json::kind::array && val.items.size() == 2, errc::invalid_argument,
                      "safetensors ", path, ": ", name, " data_offsets must be [begin, end]");
        e.begin = to_int(val.items[0], path, name + " data_offsets");
        e.end = to_int(val.items[1], path, name + " data_offsets");
        has_offsets = true;
      }
    }
    MOEBIUS_CHECK(has_dtype && has_shape && has_offsets, errc::invalid_argument, "safetensors ",
                  path, ": ", name, " lacks dtype, shape or data_offsets");
    int64_t numel = 1;
    for (int64_t d : e.shape) numel *= d;
    const int64_t elem = dtype_size(e.dtype);
    MOEBIUS_CHECK(elem > 0, errc::invalid_argument, "safetensors ", path, ": ", name,
                  " has unknown dtype ", e.dtype);
    MOEBIUS_CHECK(e.begin <= e.end && e.end <= static_cast<int64_t>(data_.size()),
                  errc::invalid_argument, "safetensors ", path, ": ", name, " data_offsets [",
                  e.begin, ", ", e.end, ") outside the ", data_.size(), "-byte data section");
    MOEBIUS_CHECK(e.end - e.begin == numel * elem, errc::invalid_argument, "safetensors ", path,
                  ": ", name, " holds ", e.end - e.begin, " bytes, ", e.dtype, " ",
                  shape_text(e.shape), " needs ", numel * elem);
    entries_.push_back(std::move(e));
  }
}

const safetensors_entry* safetensors_file::find(std::string_view name) const {
  for (const auto& e : entries_)
    if (e.name == name) return &e;
  return nullptr;
}

std::vector<float> safetensors_file::read(std::string_view name,
                                          std::span<const int64_t> shape) const {
  const safetensors_entry* e = find(name);
  MOEBIUS_CHECK(e != nullptr, errc::invalid_argument, "safetensors ", path_, ": no tensor ", name);
  MOEBIUS_CHECK(std::equal(e->shape.begin(), e->shape.end(), shape.begin(), shape.end()),
                errc::invalid_argument, "safetensors ", path_, ": tensor ", name, " has shape ",
                shape_text(e->shape), ", the model needs ", shape_text(shape));
  const int64_t n = (e->end - e->begin) / dtype_size(e->dtype);
  std::vector<float> out(static_cast<size_t>(n));
  const std::byte* p = data_.data() + e->begin;
  if (e->dtype == "F32") {
    std::memcpy(out.data(), p, static_cast<size_t>(4 * n));  // little-endian hosts
  } else if (e->dtype == "BF16") {
    for (int64_t i = 0; i < n; ++i) {
      uint16_t u;
      std::memcpy(&u, p + 2 * i, 2);
      out[static_cast<size_t>(i)] = from_bf16(u);
    }
  } else {
    MOEBIUS_CHECK(false, errc::invalid_argument, "safetensors ", path_, ": tensor ", name, " is ",
                  e->dtype, "; the loader reads F32 and BF16");
  }
  return out;
}

model_weights load_qwen3_moe(const model_config& c, const std::vector<std::string>& paths) {
  model_weights w = make_empty_weights(c);
  std::vector<std::unique_ptr<safetensors_file>> files;
  for (const auto& p : paths) files.push_back(std::make_unique<safetensors_file>(p));
  auto load = [&](const std::string& name, std::initializer_list<int64_t> shape) {
    for (const auto& f : files)
      if (f->find(name))
        return f->read(name, std::span<const int64_t>(shape.begin(), shape.size()));
    MOEBIUS_CHECK(false, errc::invalid_argument, "load_qwen3_moe: tensor ", name,
                  " is missing from the checkpoint (", paths.size(), " file(s))");
    return std::vector<float>{};
  };
  const int64_t H = c.hidden, V = c.vocab, D = c.head_dim, I = c.intermediate;
  w.embed = load("model.embed_tokens.weight", {V, H});
  w.norm = load("model.norm.weight", {H});
  w.lm_head = load("lm_head.weight", {V, H});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    layer_weights& l = w.layers[static_cast<size_t>(i)];
    l.input_layernorm = load(p + "input_layernorm.weight", {H});
    l.q_proj = load(p + "self_attn.q_proj.weight", {c.q_dim(), H});
    l.k_proj = load(p + "self_attn.k_proj.weight", {c.kv_dim(), H});
    l.v_proj = load(p + "self_attn.v_proj.weight", {c.kv_dim(), H});
    l.o_proj = load(p + "self_attn.o_proj.weight", {H, c.q_dim()});
    l.q_norm = load(p + "self_attn.q_norm.weight", {D});
    l.k_norm = load(p + "self_attn.k_norm.weight", {D});
    l.post_attention_layernorm = load(p + "post_attention_layernorm.weight", {H});
    l.router = load(p + "mlp.gate.weight", {c.num_experts, H});
    for (int64_t e = 0; e < c.num_experts; ++e) {
      const std::string ep = p + "mlp.experts." + std::to_string(e) + ".";
      const auto gate = load(ep + "gate_proj.weight", {I, H});
      const auto up = load(ep + "up_proj.weight", {I, H});
      const auto down = load(ep + "down_proj.weight", {H, I});
      std::copy(gate.begin(), gate.end(), l.w13.begin() + e * 2 * I * H);
      std::copy(up.begin(), up.end(), l.w13.begin() + (e * 2 + 1) * I * H);
      std::copy(down.begin(), down.end(), l.w2.begin() + e * H * I);
    }
  }
  round_experts(w);
  validate(w);
  return w;
}

}  // namespace mini_engine
