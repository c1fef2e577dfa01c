// mini_engine_load_check: how long a Qwen3-30B-A3B-shaped checkpoint takes to load into the GPU
// runtime, and the host memory it takes, against reading the same bytes from disk.
//
//   mini_engine_load_check --write DIR [--layers L]   writes random bf16 weights with the real
//       names, shapes and ~4 GB shards (model-0000k-of-0000n.safetensors + index + config.json);
//       L < 48 writes the first L layers (the device disk holds ~64 GiB; the full model is 61 GB)
//   mini_engine_load_check --load DIR [--ranks P] [--read-ahead-mib N]
//       evicts DIR's files from the page cache (posix_fadvise DONTNEED), reads every shard
//       once (64 MiB preads: the disk's rate), evicts again, maps every shard and reads a byte a
//       page (the loader's page-fault rate), evicts again, then loads into gpu_runtime (P
//       ranks, virtual on one GPU) printing a line per shard; reports the times, GB/s and the
//       peak resident host memory (ru_maxrss).
//       --read-ahead-mib N: how far the loader reads a shard ahead (hf_checkpoint::set_read_ahead;
//       0: off, the loader's page faults alone).

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint.hpp"
#include "gpu_runtime.hpp"
#include "numerics.hpp"

using namespace mini_engine;
namespace fs = std::filesystem;
using clk = std::chrono::steady_clock;

namespace {

double since(clk::time_point t) { return std::chrono::duration<double>(clk::now() - t).count(); }

void write_checkpoint(const std::string& dir, int64_t layers) {
  model_config c = qwen3_30b_a3b();
  c.num_layers = layers;
  fs::create_directories(dir);
  const int64_t H = c.hidden, I = c.intermediate;
  std::vector<std::pair<std::string, std::vector<int64_t>>> ts = {
      {"model.embed_tokens.weight", {c.vocab, H}}, {"model.norm.weight", {H}},
      {"lm_head.weight", {c.vocab, H}}};
  for (int64_t i = 0; i < layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    for (const char* n : {"input_layernorm.weight", "post_attention_layernorm.weight"})
      ts.push_back({p + n, {H}});
    ts.push_back({p + "self_attn.q_proj.weight", {c.q_dim(), H}});
    ts.push_back({p + "self_attn.k_proj.weight", {c.kv_dim(), H}});
    ts.push_back({p + "self_attn.v_proj.weight", {c.kv_dim(), H}});
    ts.push_back({p + "self_attn.o_proj.weight", {H, c.q_dim()}});
    ts.push_back({p + "self_attn.q_norm.weight", {c.head_dim}});
    ts.push_back({p + "self_attn.k_norm.weight", {c.head_dim}});
    ts.push_back({p + "mlp.gate.weight", {c.num_experts, H}});
    for (int64_t e = 0; e < c.num_experts; ++e) {
      const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
      ts.push_back({q + "gate_proj.weight", {I, H}});
      ts.push_back({q + "up_proj.weight", {I, H}});
      ts.push_back({q + "down_proj.weight", {H, I}});
    }
  }
  // ~4 GB shards, tensors in order, as save_pretrained cuts them.
  std::vector<std::vector<size_t>> shards(1);
  int64_t in_shard = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    int64_t n = 2;
    for (int64_t d : ts[i].second) n *= d;
    if (in_shard > 0 && in_shard + n > 4'000'000'000) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(i);
    in_shard += n;
  }
  nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json::object()}};
  splitmix64 rng(42);
  std::vector<uint16_t> buf;
  for (size_t s = 0; s < shards.size(); ++s) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    nlohmann::json h = {{"__metadata__", {{"format", "pt"}}}};
    int64_t at = 0;
    for (size_t i : shards[s]) {
      int64_t n = 2;
      for (int64_t d : ts[i].second) n *= d;
      h[ts[i].first] = {{"dtype", "BF16"}, {"shape", ts[i].second}, {"data_offsets", {at, at + n}}};
      at += n;
      index["weight_map"][ts[i].first] = name;
    }
    std::string header = h.dump();
    while (header.size() % 8) header += ' ';
    std::ofstream out(dir + "/" + name, std::ios::binary);
    const uint64_t len = header.size();
    for (int b = 0; b < 8; ++b) out.put(static_cast<char>((len >> (8 * b)) & 0xff));
    out << header;
    for (size_t i : shards[s]) {
      int64_t n = 1;
      for (int64_t d : ts[i].second) n *= d;
      const bool norm = ts[i].second.size() == 1;
      const float scale = norm ? 0.1f : std::sqrt(3.0f / static_cast<float>(ts[i].second.back()));
      buf.resize(static_cast<size_t>(n));
      for (auto& u : buf) u = to_bf16((norm ? 1.0f : 0.0f) + scale * rng.symmetric());
      out.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(2 * n));
    }
    std::printf("wrote %s (%.2f GB)\n", name, static_cast<double>(at) / 1e9);
  }
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump(1);
  nlohmann::json cfg = {{"model_type", "qwen3_moe"}, {"num_hidden_layers", layers},
                        {"hidden_size", H}, {"intermediate_size", 6144},
                        {"num_attention_heads", c.num_q_heads}, {"num_key_value_heads", c.num_kv_heads},
                        {"head_dim", c.head_dim}, {"num_experts", c.num_experts},
                        {"num_experts_per_tok", c.top_k}, {"moe_intermediate_size", I},
                        {"vocab_size", c.vocab}, {"rms_norm_eps", 1e-6}, {"rope_theta", 1e6},
                        {"norm_topk_prob", true}, {"tie_word_embeddings", false},
                        {"torch_dtype", "bfloat16"}, {"mlp_only_layers", nlohmann::json::array()},
                        {"decoder_sparse_step", 1}, {"use_sliding_window", false}};
  std::ofstream(dir + "/config.json") << cfg.dump(1);
}

void evict(const std::string& dir) {
  for (const auto& f : fs::directory_iterator(dir)) {
    const int fd = ::open(f.path().c_str(), O_RDONLY);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

// fn(path) for each .safetensors shard of dir.
template <class Fn>
void for_each_shard(const std::string& dir, Fn fn) {
  for (const auto& f : fs::directory_iterator(dir)) {
    if (f.path().extension() == ".safetensors") fn(f.path());
  }
}

double read_all(const std::string& dir, int64_t* bytes) {
  std::vector<char> buf(64 << 20);
  const auto t0 = clk::now();
  *bytes = 0;
  for_each_shard(dir, [&](const fs::path& path) {
    const int fd = ::open(path.c_str(), O_RDONLY);
    for (ssize_t n; (n = ::read(fd, buf.data(), buf.size())) > 0;) *bytes += n;
    ::close(fd);
  });
  return since(t0);
}

// The same shards through mmap (MADV_SEQUENTIAL, as safetensors_file maps them), one byte read
// a page: the rate the loader's page faults can reach, against read_all's.
double map_all(const std::string& dir, int64_t* bytes) {
  const auto t0 = clk::now();
  *bytes = 0;
  uint64_t sum = 0;
  const long page = ::sysconf(_SC_PAGESIZE);
  for_each_shard(dir, [&](const fs::path& path) {
    const int fd = ::open(path.c_str(), O_RDONLY);
    const auto n = static_cast<size_t>(fs::file_size(path));
    void* p = ::mmap(nullptr, n, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) return;
    ::madvise(p, n, MADV_SEQUENTIAL);
    const auto* b = static_cast<const volatile unsigned char*>(p);
    for (size_t i = 0; i < n; i += static_cast<size_t>(page)) sum += b[i];
    ::munmap(p, n);
    *bytes += static_cast<int64_t>(n);
  });
  if (sum == 1) std::printf(" ");  // keeps the reads
  return since(t0);
}

}  // namespace

int main(int argc, char** argv) {
  std::string write_dir, load_dir;
  int64_t layers = 48;
  int ranks = 1;
  int64_t read_ahead_mib = -1;  // < 0: the loader's default
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--write") write_dir = argv[i + 1];
    else if (a == "--load") load_dir = argv[i + 1];
    else if (a == "--layers") layers = std::stoll(argv[i + 1]);
    else if (a == "--ranks") ranks = std::stoi(argv[i + 1]);
    else if (a == "--read-ahead-mib")
      read_ahead_mib = std::stoll(argv[i + 1]);
  }
  if (!write_dir.empty()) write_checkpoint(write_dir, layers);
  if (load_dir.empty()) return 0;
  evict(load_dir);
  int64_t bytes = 0;
  const double read_s = read_all(load_dir, &bytes);
  std::printf("read  %.2f GB of shards in %.2f s: %.2f GB/s (page cache evicted first)\n",
              static_cast<double>(bytes) / 1e9, read_s, static_cast<double>(bytes) / 1e9 / read_s);
  evict(load_dir);
  int64_t mapped = 0;
  const double map_s = map_all(load_dir, &mapped);
  std::printf(
      "map   %.2f GB of shards in %.2f s: %.2f GB/s (mmap, MADV_SEQUENTIAL, a byte a page; "
      "page cache evicted first)\n",
      static_cast<double>(mapped) / 1e9, map_s, static_cast<double>(mapped) / 1e9 / map_s);
  evict(load_dir);
  const auto t0 = clk::now();
  hf_checkpoint ck(load_dir);
  if (read_ahead_mib >= 0) ck.set_read_ahead(read_ahead_mib << 20);
  model_config m = ck.config().model;
  m.kv_dtype = moebius::dtype::bf16;
  gpu::gpu_runtime_options o = gpu::options_from_env();
  o.num_ranks = ranks;
  o.dense_dtype = moebius::dtype::bf16;
  o.num_ep_pages = 64;
  o.capture_graphs = false;  // the load, not the capture
  gpu::gpu_runtime rt(m, o, [&](weight_sink& s) {
    ck.load(m, s, [](const load_progress& p) {
      std::printf("  %s\n", progress_line(p).c_str());
      std::fflush(stdout);
    });
  });
  const double load_s = since(t0);
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  std::printf(
      "load  %.2f GB into gpu_runtime (P=%d, read-ahead %lld MiB) in %.2f s: %.2f GB/s, "
      "%.2fx the read; peak resident host memory %.2f GB (largest shard mapped + "
      "staging + slot images)\n",
      static_cast<double>(ck.bytes()) / 1e9, ranks, static_cast<long long>(ck.read_ahead() >> 20),
      load_s, static_cast<double>(ck.bytes()) / 1e9 / load_s, load_s / read_s,
      static_cast<double>(ru.ru_maxrss) * 1024 / 1e9);
  return 0;
}
