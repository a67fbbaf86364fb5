// safetensors: implementation.
#include <algorithm>
#include <cerrno>
#include <dirent.h>
#include <fcntl.h>
#include <set>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

namespace kvlite {

namespace detail {
// The reference reader's limit on the JSON header (safetensors/src/tensor.rs, MAX_HEADER_SIZE).
constexpr uint64_t kSafetensorsMaxHeaderBytes = 100000000ull;
// How many offending names a missing-tensor message spells out before it only counts the rest.
constexpr size_t kMaxNamesListed = 10;

inline bool multiply_overflows(uint64_t a, uint64_t b, uint64_t* product) {
  return __builtin_mul_overflow(a, b, product);
}

inline std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); i++) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

inline std::string known_dtype_names() {
  std::string names;
  for (const auto& info : kDTypes) names += (names.empty() ? "" : ", ") + std::string(info.name);
  return names;
}

// Reads a JSON value that must be a non-negative integer fitting in `limit` (serde's usize in the reference
// reader: negative numbers, fractions and strings are all rejected).
inline std::optional<uint64_t> json_to_count(const nlohmann::json& value, uint64_t limit) {
  if (value.is_number_unsigned()) {
    uint64_t n = value.get<uint64_t>();
    if (n <= limit) return n;
    return std::nullopt;
  }
  if (value.is_number_integer() && value.get<int64_t>() >= 0 && uint64_t(value.get<int64_t>()) <= limit)
    return uint64_t(value.get<int64_t>());
  return std::nullopt;
}

// Parses JSON text, failing with bad_format (naming `origin` and the parser's position) on a syntax error or a
// key that appears twice in one object. nlohmann keeps the last of duplicate keys silently, so two entries
// for one tensor would otherwise hide one of them; a callback sees every key and tracks each open object's.
// `what` names the document ("header"), `entry` what its top-level keys are ("tensor").
inline nlohmann::json parse_json_strict(const char* begin, const char* end, const std::string& origin,
                                        const char* what, const char* entry) {
  std::vector<std::set<std::string>> open_objects;  // the keys seen so far in each enclosing object
  std::vector<std::string> key_path;                // the key under which each open object was opened
  std::string last_key, duplicate, duplicate_where;
  auto on_event = [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start) {
      key_path.push_back(open_objects.empty() ? "" : last_key);
      open_objects.emplace_back();
    } else if (event == Event::object_end) {
      open_objects.pop_back();
      key_path.pop_back();
    } else if (event == Event::key) {
      last_key = parsed.get<std::string>();
      if (!open_objects.back().insert(last_key).second && duplicate.empty()) {
        duplicate = last_key;
        for (const auto& key : key_path)
          if (!key.empty()) duplicate_where += (duplicate_where.empty() ? "" : " > ") + key;
      }
    }
    return true;
  };
  check_json_nesting(std::string_view(begin, size_t(end - begin)), origin);
  nlohmann::json value;
  try {
    value = nlohmann::json::parse(begin, end, on_event);
  } catch (const nlohmann::json::parse_error& e) {
    fail(ErrorCode::bad_format, format("%s: the %s is not valid JSON (near byte %zu of it): %s", origin.c_str(),
                                       what, e.byte, e.what()));
  } catch (const nlohmann::json::exception& e) {  // out_of_range: a number like 1E51655
    fail(ErrorCode::bad_format, format("%s: the %s is not valid JSON: %s", origin.c_str(), what, e.what()));
  }
  if (!duplicate.empty()) {
    if (duplicate_where.empty())
      fail(ErrorCode::bad_format,
           format("%s: %s '%s' appears twice in the %s; JSON readers would silently keep only the last entry",
                  origin.c_str(), entry, duplicate.c_str(), what));
    fail(ErrorCode::bad_format, format("%s: key '%s' appears twice inside '%s' in the %s", origin.c_str(),
                                       duplicate.c_str(), duplicate_where.c_str(), what));
  }
  return value;
}

// One header entry turned into a TensorInfo with `offset` relative to the data buffer, every per-entry rule
// checked (the rules between entries are checked after sorting by offset).
inline TensorInfo parse_tensor_entry(const std::string& name, const nlohmann::json& entry, const std::string& origin) {
  const char* file = origin.c_str();
  const char* tensor = name.c_str();
  if (!entry.is_object())
    fail(ErrorCode::bad_format, format("%s: the entry of tensor '%s' is a JSON %s, not an object with dtype, shape "
                                       "and data_offsets", file, tensor, entry.type_name()));
  for (const char* field : {"dtype", "shape", "data_offsets"})
    if (!entry.contains(field))
      fail(ErrorCode::bad_format, format("%s: tensor '%s' has no \"%s\"", file, tensor, field));

  TensorInfo info;
  info.name = name;
  const auto& dtype = entry["dtype"];
  if (!dtype.is_string())
    fail(ErrorCode::bad_format, format("%s: tensor '%s' has dtype %s; it must be a string such as \"BF16\"", file,
                                       tensor, dtype.dump().c_str()));
  auto known = dtype_from_name(dtype.get<std::string>());
  if (!known)
    fail(ErrorCode::unsupported, format("%s: tensor '%s' has dtype '%s', which is not a safetensors dtype (known: %s)",
                                        file, tensor, dtype.get<std::string>().c_str(), known_dtype_names().c_str()));
  info.dtype = *known;

  const auto& shape = entry["shape"];
  if (!shape.is_array())
    fail(ErrorCode::bad_format, format("%s: tensor '%s' has shape %s; it must be an array of non-negative integers",
                                       file, tensor, shape.dump().c_str()));
  uint64_t numel = 1;
  for (const auto& dim : shape) {
    auto extent = json_to_count(dim, uint64_t(INT64_MAX));
    if (!extent) {
      bool too_large = dim.is_number_unsigned();
      fail(ErrorCode::bad_format, format("%s: tensor '%s' has shape %s; %s", file, tensor, shape.dump().c_str(),
                                         too_large ? "a dimension that large overflows 64-bit sizes"
                                                   : "every dimension must be a non-negative integer"));
    }
    info.shape.push_back(int64_t(*extent));
    if (multiply_overflows(numel, *extent, &numel))
      fail(ErrorCode::bad_format, format("%s: tensor '%s' has shape %s, whose element count overflows 64 bits", file,
                                         tensor, shape.dump().c_str()));
  }

  const auto& offsets = entry["data_offsets"];
  std::optional<uint64_t> begin, end;
  if (offsets.is_array() && offsets.size() == 2) {
    begin = json_to_count(offsets[0], UINT64_MAX);
    end = json_to_count(offsets[1], UINT64_MAX);
  }
  if (!begin || !end)
    fail(ErrorCode::bad_format, format("%s: tensor '%s' has data_offsets %s; they must be [begin, end], two "
                                       "non-negative integers", file, tensor, offsets.dump().c_str()));
  if (*begin > *end)
    fail(ErrorCode::bad_format, format("%s: tensor '%s' has data_offsets [%llu, %llu], which end before they begin",
                                       file, tensor, (unsigned long long)*begin, (unsigned long long)*end));

  // Sub-byte dtypes (F4, F6_*) pack densely; the reference reader rejects a tensor that ends mid-byte.
  uint64_t bits = 0;
  if (multiply_overflows(numel, uint64_t(dtype_bits(info.dtype)), &bits))
    fail(ErrorCode::bad_format, format("%s: tensor '%s' (%s %s) has a byte size that overflows 64 bits", file,
                                       tensor, dtype_name(info.dtype), shape_text(info.shape).c_str()));
  if (bits % 8 != 0)
    fail(ErrorCode::bad_format, format("%s: tensor '%s' (%s %s) holds %llu bits, not a whole number of bytes", file,
                                       tensor, dtype_name(info.dtype), shape_text(info.shape).c_str(),
                                       (unsigned long long)bits));
  uint64_t expected_bytes = bits / 8, actual_bytes = *end - *begin;
  if (actual_bytes != expected_bytes)
    fail(ErrorCode::bad_format,
         format("%s: tensor '%s' (%s %s) needs %llu bytes but its data_offsets [%llu, %llu] span %llu bytes", file,
                tensor, dtype_name(info.dtype), shape_text(info.shape).c_str(), (unsigned long long)expected_bytes,
                (unsigned long long)*begin, (unsigned long long)*end, (unsigned long long)actual_bytes));
  info.offset = *begin;
  info.nbytes = actual_bytes;
  return info;
}
}  // namespace detail

Result<SafetensorsHeader> parse_safetensors_header(const uint8_t* data, uint64_t size, const std::string& origin) {
  return detail::guard([&]() -> SafetensorsHeader {
    using detail::fail;
    using detail::format;
    using ull = unsigned long long;
    const char* file = origin.c_str();
    if (size < 8)
      fail(ErrorCode::bad_format, format("%s: truncated: %llu bytes, fewer than the 8-byte header length that "
                                         "starts every safetensors file", file, (ull)size));
    uint64_t header_bytes = 0;
    for (int i = 7; i >= 0; i--) header_bytes = (header_bytes << 8) | data[i];  // little-endian u64
    if (header_bytes > detail::kSafetensorsMaxHeaderBytes)
      fail(ErrorCode::bad_format, format("%s: header of %llu bytes exceeds the %llu-byte limit (a corrupt length "
                                         "prefix, or not a safetensors file)", file, (ull)header_bytes,
                                         (ull)detail::kSafetensorsMaxHeaderBytes));
    if (header_bytes > size - 8)
      fail(ErrorCode::bad_format, format("%s: truncated: the header length says %llu bytes but only %llu bytes "
                                         "follow it", file, (ull)header_bytes, (ull)(size - 8)));

    SafetensorsHeader header;
    header.data_start = 8 + header_bytes;
    const uint64_t data_bytes = size - header.data_start;
    // nlohmann's lexer rejects ill-formed UTF-8, so a successful parse also proves the header is UTF-8.
    const char* text = reinterpret_cast<const char*>(data) + 8;
    nlohmann::json root = detail::parse_json_strict(text, text + header_bytes, origin, "header", "tensor");
    if (!root.is_object())
      fail(ErrorCode::bad_format, format("%s: the header is a JSON %s, not an object of tensors", file,
                                         root.type_name()));

    for (const auto& [name, entry] : root.items()) {
      if (name == "__metadata__") {
        if (entry.is_null()) continue;  // the reference reader reads null as "no metadata"
        if (!entry.is_object())
          fail(ErrorCode::bad_format, format("%s: __metadata__ is a JSON %s; it must map strings to strings", file,
                                             entry.type_name()));
        for (const auto& [key, value] : entry.items()) {
          if (!value.is_string())
            fail(ErrorCode::bad_format, format("%s: __metadata__ must map strings to strings, but '%s' holds the %s "
                                               "%s", file, key.c_str(), value.type_name(), value.dump().c_str()));
          header.metadata[key] = value.get<std::string>();
        }
        continue;
      }
      header.tensors.push_back(detail::parse_tensor_entry(name, entry, origin));
    }

    // As the reference reader does: order by (begin, end), then the spans must tile the data buffer exactly,
    // from 0 to its last byte, with no overlap, no hole and nothing after the last tensor.
    std::sort(header.tensors.begin(), header.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
      if (a.offset != b.offset) return a.offset < b.offset;
      if (a.nbytes != b.nbytes) return a.nbytes < b.nbytes;
      return a.name < b.name;
    });
    uint64_t covered = 0;  // bytes [0, covered) of the data buffer belong to the tensors seen so far
    const TensorInfo* previous = nullptr;
    for (const TensorInfo& t : header.tensors) {
      const uint64_t begin = t.offset, end = t.offset + t.nbytes;
      if (begin < covered)
        fail(ErrorCode::bad_format, format("%s: tensor '%s' (bytes [%llu, %llu) of the data buffer) overlaps tensor "
                                           "'%s' (bytes [%llu, %llu))", file, t.name.c_str(), (ull)begin, (ull)end,
                                           previous->name.c_str(), (ull)previous->offset,
                                           (ull)(previous->offset + previous->nbytes)));
      if (begin > covered) {
        std::string after = previous ? format("tensor '%s' (ends at byte %llu)", previous->name.c_str(), (ull)covered)
                                     : std::string("the start of the data buffer");
        fail(ErrorCode::bad_format, format("%s: the data buffer has a hole: %llu unused bytes between %s and tensor "
                                           "'%s' (begins at byte %llu)", file, (ull)(begin - covered), after.c_str(),
                                           t.name.c_str(), (ull)begin));
      }
      if (end > data_bytes)
        fail(ErrorCode::bad_format, format("%s: tensor '%s' ends at byte %llu of the data buffer, beyond its %llu "
                                           "bytes (the file is truncated or the offsets are wrong)", file,
                                           t.name.c_str(), (ull)end, (ull)data_bytes));
      covered = end;
      previous = &t;
    }
    if (covered != data_bytes) {
      std::string last = previous ? format("the last tensor '%s' ends at byte %llu", previous->name.c_str(),
                                           (ull)covered)
                                  : std::string("the header lists no tensors");
      fail(ErrorCode::bad_format, format("%s: %llu bytes of data follow the tensors (%s; the data buffer has %llu "
                                         "bytes)", file, (ull)(data_bytes - covered), last.c_str(), (ull)data_bytes));
    }
    for (TensorInfo& t : header.tensors) t.offset += header.data_start;
    return header;
  });
}

// ---- MappedFile -----------------------------------------------------------------------------------------
Result<std::shared_ptr<MappedFile>> MappedFile::open(const std::string& path) {
  return detail::guard([&]() -> std::shared_ptr<MappedFile> {
    using detail::fail;
    using detail::format;
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail(ErrorCode::io_error, format("cannot open %s: %s", path.c_str(), strerror(errno)));
    struct stat st;
    if (fstat(fd, &st) != 0) {
      int error = errno;
      ::close(fd);
      fail(ErrorCode::io_error, format("cannot stat %s: %s", path.c_str(), strerror(error)));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      fail(ErrorCode::io_error, format("cannot map %s: not a regular file", path.c_str()));
    }
    std::shared_ptr<MappedFile> file(new MappedFile());
    file->path_ = path;
    file->size_ = uint64_t(st.st_size);
    // mmap rejects a zero length; an empty file is a valid (empty) mapping and its readers judge it.
    if (file->size_ > 0) {
      void* map = mmap(nullptr, size_t(file->size_), PROT_READ, MAP_PRIVATE, fd, 0);
      if (map == MAP_FAILED) {
        int error = errno;
        ::close(fd);
        fail(ErrorCode::io_error, format("cannot mmap %s (%llu bytes): %s", path.c_str(),
                                         (unsigned long long)file->size_, strerror(error)));
      }
      file->data_ = static_cast<const uint8_t*>(map);
    }
    ::close(fd);  // the mapping keeps the file alive
    return file;
  });
}

MappedFile::~MappedFile() {
  if (data_) munmap(const_cast<uint8_t*>(data_), size_t(size_));
}

// ---- TensorStore ----------------------------------------------------------------------------------------
Result<TensorStore> TensorStore::open_files(const std::vector<std::string>& paths) {
  return detail::guard([&]() -> TensorStore {
    TensorStore store;
    for (const std::string& path : paths) {
      std::shared_ptr<MappedFile> file = MappedFile::open(path).value();
      SafetensorsHeader header = parse_safetensors_header(file->data(), file->size(), path).value();
      const int file_index = int(store.files_.size());
      store.files_.push_back(file);
      store.paths_.push_back(path);
      for (TensorInfo& t : header.tensors) {
        auto [it, inserted] = store.index_.emplace(t.name, store.tensors_.size());
        if (!inserted) {
          const std::string& first_path = store.paths_[size_t(store.tensors_[it->second].file_index)];
          detail::fail(ErrorCode::bad_format,
                       detail::format("tensor '%s' is in both %s and %s; a checkpoint must hold each tensor once",
                                      t.name.c_str(), first_path.c_str(), path.c_str()));
        }
        t.file_index = file_index;
        store.tensors_.push_back(std::move(t));
      }
    }
    return store;
  });
}

Result<TensorStore> TensorStore::open_dir(const std::string& model_dir) {
  return detail::guard([&]() -> TensorStore {
    using detail::fail;
    using detail::format;
    struct stat st;
    if (stat(model_dir.c_str(), &st) != 0)
      fail(ErrorCode::io_error, format("cannot open model directory %s: %s", model_dir.c_str(), strerror(errno)));
    if (!S_ISDIR(st.st_mode))
      fail(ErrorCode::io_error, format("model directory %s is not a directory", model_dir.c_str()));

    const std::string index_path = detail::path_join(model_dir, "model.safetensors.index.json");
    if (detail::file_exists(index_path)) {
      const std::string text = detail::read_text_file(index_path);
      nlohmann::json index =
          detail::parse_json_strict(text.data(), text.data() + text.size(), index_path, "index", "key");
      if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
        fail(ErrorCode::bad_format, format("%s: expected an object with a \"weight_map\" object (tensor name -> shard "
                                           "file)", index_path.c_str()));
      const auto& weight_map = index["weight_map"];
      if (weight_map.empty())
        fail(ErrorCode::bad_format, format("%s: the weight_map names no tensors", index_path.c_str()));
      std::vector<std::pair<std::string, std::string>> expected;  // (tensor, shard file name as the index has it)
      std::set<std::string> shard_names;
      for (const auto& [name, shard] : weight_map.items()) {
        if (!shard.is_string() || shard.get<std::string>().empty())
          fail(ErrorCode::bad_format, format("%s: weight_map entry '%s' is %s; it must name a shard file",
                                             index_path.c_str(), name.c_str(), shard.dump().c_str()));
        shard_names.insert(shard.get<std::string>());
        expected.emplace_back(name, shard.get<std::string>());
      }
      std::vector<std::string> shard_paths;
      for (const std::string& shard : shard_names) shard_paths.push_back(detail::path_join(model_dir, shard));
      TensorStore store = open_files(shard_paths).value();

      std::vector<std::string> missing;  // "'name' (not in shard)" for each index entry its shard lacks
      for (const auto& [name, shard] : expected) {
        const TensorInfo* found = store.find(name);
        const std::string shard_path = detail::path_join(model_dir, shard);
        if (!found)
          missing.push_back(format("'%s' (not in %s)", name.c_str(), shard.c_str()));
        else if (store.paths_[size_t(found->file_index)] != shard_path)
          missing.push_back(format("'%s' (not in %s but in %s)", name.c_str(), shard.c_str(),
                                   store.paths_[size_t(found->file_index)].c_str()));
      }
      if (!missing.empty()) {
        std::string listed;
        for (size_t i = 0; i < missing.size() && i < detail::kMaxNamesListed; i++)
          listed += (i ? ", " : "") + missing[i];
        if (missing.size() > detail::kMaxNamesListed)
          listed += format(" and %zu more", missing.size() - detail::kMaxNamesListed);
        fail(ErrorCode::missing_tensor, format("%s names %zu tensor(s) that are not in the shard it names: %s",
                                               index_path.c_str(), missing.size(), listed.c_str()));
      }
      return store;
    }

    const std::string single_path = detail::path_join(model_dir, "model.safetensors");
    if (detail::file_exists(single_path)) return open_files({single_path}).value();

    // Neither: every *.safetensors file, in name order (a directory without weights gives an empty store).
    std::vector<std::string> found;
    DIR* dir = opendir(model_dir.c_str());
    if (!dir)
      fail(ErrorCode::io_error, format("cannot list model directory %s: %s", model_dir.c_str(), strerror(errno)));
    const std::string suffix = ".safetensors";
    while (const dirent* item = readdir(dir)) {
      std::string name = item->d_name;
      if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
          detail::file_exists(detail::path_join(model_dir, name)))
        found.push_back(detail::path_join(model_dir, name));
    }
    closedir(dir);
    std::sort(found.begin(), found.end());
    return open_files(found).value();
  });
}

const TensorInfo* TensorStore::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const uint8_t* TensorStore::data(const TensorInfo& tensor) const {
  return files_[size_t(tensor.file_index)]->data() + tensor.offset;
}

void TensorStore::page_in(const TensorInfo& tensor) const {
  // One read per 4 KiB (the smallest page size) makes every page of the span resident; the sum keeps the
  // compiler from dropping the reads.
  const uint8_t* bytes = data(tensor);
  uint8_t sum = 0;
  for (uint64_t at = 0; at < tensor.nbytes; at += 4096) sum = uint8_t(sum + bytes[at]);
  if (tensor.nbytes > 0) sum = uint8_t(sum + bytes[tensor.nbytes - 1]);
  volatile uint8_t sink = sum;
  (void)sink;
}

uint64_t TensorStore::total_bytes() const {
  uint64_t total = 0;
  for (const TensorInfo& t : tensors_) total += t.nbytes;
  return total;
}

Status TensorStore::require(const std::vector<std::string>& names) const {
  return detail::guard([&] {
    std::vector<std::string> missing;
    for (const std::string& name : names)
      if (!find(name) && std::find(missing.begin(), missing.end(), name) == missing.end()) missing.push_back(name);
    if (missing.empty()) return;
    std::string listed;
    for (const std::string& name : missing) listed += (listed.empty() ? "'" : ", '") + name + "'";
    std::string where = paths_.empty() ? std::string("the model has no safetensors files")
                        : paths_.size() == 1
                            ? detail::format("not in %s", paths_[0].c_str())
                            : detail::format("in none of the %zu safetensors files (%s ... %s)", paths_.size(),
                                             paths_.front().c_str(), paths_.back().c_str());
    detail::fail(ErrorCode::missing_tensor,
                 detail::format("%zu of %zu required tensors are missing (%s): %s", missing.size(), names.size(),
                                where.c_str(), listed.c_str()));
  });
}

}  // namespace kvlite
