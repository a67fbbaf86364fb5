// ---------------------------------------------------------------------------------------------------------
// safetensors: memory-mapped, validated reading of single and sharded checkpoints.
// ---------------------------------------------------------------------------------------------------------
#pragma once
#include <map>

namespace kvlite {

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  int file_index = 0;   // index into TensorStore::files()
  uint64_t offset = 0;  // absolute byte offset of the first element inside its file
  uint64_t nbytes = 0;  // exact byte span (== numel * element size, validated)
  uint64_t numel() const {  // cannot overflow: the reader rejected shapes whose count does
    uint64_t n = 1;
    for (int64_t d : shape) n *= uint64_t(d);
    return n;
  }
};

// The parsed header of one .safetensors file. Validation matches the reference reader: header length
// <= 100,000,000 bytes and inside the file, valid JSON object, known dtype, non-negative shape, byte span ==
// numel x element size (sub-byte dtypes ending on a whole byte), spans tiling the data buffer exactly (no
// overlap, no hole, nothing after the last tensor), __metadata__ a string-to-string map (or null); stricter
// than the reference, a name twice in the JSON is rejected instead of silently keeping the last. `data`/`size`
// is the whole file. Errors: bad_format (unsupported for an unknown dtype), naming the file (origin) and tensor.
struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;  // in data order
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // 8 + header length
};
Result<SafetensorsHeader> parse_safetensors_header(const uint8_t* data, uint64_t size, const std::string& origin);

// A read-only mmap of a whole file (MAP_PRIVATE). An empty file maps to data() == nullptr, size() == 0; its
// reader judges it (parse_safetensors_header reports it truncated). Errors: io_error naming the path and errno.
class MappedFile {
 public:
  static Result<std::shared_ptr<MappedFile>> open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile() = default;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  std::string path_;
};

// All tensors of a model directory: `model.safetensors`, or the shards named by
// `model.safetensors.index.json` (each listed tensor must be in the shard the index names), or, with neither,
// every `*.safetensors` file in name order. A directory with no weights gives an empty store (planning from
// config alone); a missing directory is an io_error. A tensor in two files is bad_format; an index entry whose
// shard lacks it is missing_tensor. find() is O(log n).
class TensorStore {
 public:
  static Result<TensorStore> open_dir(const std::string& model_dir);
  static Result<TensorStore> open_files(const std::vector<std::string>& paths);
  bool empty() const { return tensors_.empty(); }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(const std::string& name) const;
  const std::vector<std::string>& files() const { return paths_; }
  // Into the mmap; valid while the store lives. Aligned only to what the writer chose: copy with memcpy.
  const uint8_t* data(const TensorInfo& tensor) const;
  uint64_t total_bytes() const;  // sum of all tensors' byte spans
  // Reads the tensor's span once, so that its pages are resident (the CPU engine's load, with progress).
  void page_in(const TensorInfo& tensor) const;
  // missing_tensor error listing every absent name (not just the first).
  Status require(const std::vector<std::string>& names) const;

 private:
  std::vector<std::shared_ptr<MappedFile>> files_;
  std::vector<std::string> paths_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;
};

}  // namespace kvlite
