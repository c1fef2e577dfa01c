#pragma once

// A Hugging Face Qwen3-MoE checkpoint directory, streamed into a runtime.
//
//   DIR/config.json                       the model (hf_config.hpp)
//   DIR/model.safetensors.index.json      {"weight_map": {"<tensor>": "<shard file>", ...}}
//   DIR/<shard>.safetensors ...           or one DIR/model.safetensors without an index
//
// Opening reads config.json, the index and every shard's header (not the data) and checks,
// before a byte is loaded, everything a load could trip on: every tensor the model reads is
// present exactly once (in the shard the index names), with the model's shape and a dtype
// the loader converts (F32, BF16, F16; F8_E4M3 with its weight_scale_inv block scales), and
// no tensor of a layer is one the engine would ignore (a bias, a shared expert). So a load
// that starts does not stop half-way on a checkpoint problem, and a runtime built from a
// checkpoint that fails to open never exists.
//
// Loading maps one shard at a time (mmap, read front to back, unmapped before the next), and
// hands each tensor as it lies there to a weight_sink, which converts it once into its place:
// peak host memory is one mapped shard plus the block scales of an FP8 checkpoint (1/16384 of
// its weights' elements, as float), whatever the checkpoint's size.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "hf_config.hpp"
#include "model_config.hpp"
#include "safetensors.hpp"
#include "weight_sink.hpp"
#include "weights.hpp"

namespace mini_engine {

// After each shard: which, its bytes and time, and the whole load's so far.
struct load_progress {
  int64_t shard = 0, num_shards = 0;  // shard index (0-based) of num_shards
  std::string path;
  int64_t shard_bytes = 0;  // bytes of the tensors read from this shard
  int64_t bytes_done = 0, bytes_total = 0;
  double shard_s = 0, elapsed_s = 0;
};
// "shard 3/16 model-00003-of-00016.safetensors: 3.96 GB in 2.10 s (1.89 GB/s); 12.10 GB of
// 60.90 GB, ETA 25.8 s" (units from kB to GB as the sizes need)
std::string progress_line(const load_progress& p);

class hf_checkpoint {
 public:
  // Opens DIR (config.json, then the index or model.safetensors). Throws
  // moebius::error(errc::invalid_argument) naming the file, and the tensor where there is
  // one: no config.json, a config that is not JSON or that the engine cannot run, an index
  // naming a shard that cannot be opened or a tensor its shard does not have, a shard whose
  // header is broken or whose offsets overlap or run past its data (a truncated file), a
  // tensor missing, of the wrong shape or dtype, or one the engine does not run.
  explicit hf_checkpoint(const std::string& dir);
  // The shards given, with `config` for the model (no config.json, no index): every tensor
  // in exactly one of them.
  hf_checkpoint(const hf_config& config, const std::vector<std::string>& shard_paths);
  ~hf_checkpoint();
  hf_checkpoint(hf_checkpoint&&) noexcept;
  hf_checkpoint& operator=(hf_checkpoint&&) noexcept;

  const hf_config& config() const { return config_; }
  // The directory (or the first shard), for messages.
  const std::string& source() const { return source_; }
  int64_t num_shards() const { return static_cast<int64_t>(shards_.size()); }
  // Bytes of the tensors the model reads (what a load reads from disk).
  int64_t bytes() const { return bytes_; }

  // Checks that `model` is this checkpoint's model up to what a caller may choose (expert
  // and KV dtypes, page size): throws errc::invalid_argument naming the field, or the first
  // expert tensor that cannot be stored as model.expert_dtype (fp8_e4m3 experts need F8_E4M3
  // tensors of block model.fp8_block).
  void check(const model_config& model) const;
  // check(model), then every tensor into `sink`, shard by shard (each mapped while it is
  // read), tensors in file order; `progress` after each shard.
  void load(const model_config& model, weight_sink& sink,
            const std::function<void(const load_progress&)>& progress = {}) const;
  // How far a load reads each shard ahead of the tensor it delivers (file_read_ahead: a thread
  // that fills the page cache while the sink works); 0 turns it off. Default 1 GiB.
  void set_read_ahead(int64_t bytes) { read_ahead_bytes_ = bytes; }
  int64_t read_ahead() const { return read_ahead_bytes_; }

  struct tensor_ref;  // a tensor of the model: where it lies (checkpoint.cpp)

 private:
  void resolve(const std::string& index_path,
               const std::vector<std::pair<std::string, std::string>>* weight_map);

  hf_config config_;
  std::string source_;
  std::vector<std::unique_ptr<safetensors_file>> shards_;
  std::vector<tensor_ref> tensors_;  // by shard, then offset
  int64_t bytes_ = 0;
  int64_t read_ahead_bytes_ = int64_t{1} << 30;
};

// The whole model as logical float weights (the reference and tests: every tensor in
// memory; a runtime loads through its own sink instead). Experts are then rounded to
// model.expert_dtype as round_experts does (fp8: requantised with power-of-two scales, so
// load bf16 or fp32 experts from an FP8 checkpoint for its exact values).
model_weights load_weights(const hf_checkpoint& checkpoint, const model_config& model);

// The shards given, for `config` written by hand (no config.json): load_weights over
// hf_checkpoint({config}, paths). Throws errc::invalid_argument naming a missing tensor, or
// the tensor with its expected and found shapes.
model_weights load_qwen3_moe(const model_config& config, const std::vector<std::string>& paths);

}  // namespace mini_engine
