// Test helper: writes .safetensors files (and sharded directories) from in-memory tensors, so tests can
// make good and deliberately broken checkpoints without Python. Not part of the library.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <map>
#include <string>
#include <vector>
#include <unistd.h>
#include <nlohmann/json.hpp>

namespace testing_safetensors {

struct Tensor {
  std::string name;
  std::string dtype;               // "BF16", "F32", "I32", "F8_E4M3", ...
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;      // raw little-endian data
};

inline std::vector<uint8_t> bytes_of_f32(const std::vector<float>& values) {
  std::vector<uint8_t> out(values.size() * 4);
  memcpy(out.data(), values.data(), out.size());
  return out;
}

// Writes the header JSON padded with spaces to a multiple of 8, then the data in order.
// `header_override`, when non-empty, replaces the generated header text (for malformed-header tests).
inline void write_file(const std::string& path, const std::vector<Tensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {},
                       const std::string& header_override = "") {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string text = header_override.empty() ? header.dump() : header_override;
  while (text.size() % 8) text += ' ';
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  uint64_t n = text.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out.write(text.data(), std::streamsize(text.size()));
  for (const auto& t : tensors) out.write(reinterpret_cast<const char*>(t.bytes.data()), std::streamsize(t.bytes.size()));
}

// Writes `bytes` as the whole file: for files whose length prefix does not match what follows.
inline void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

// The 8-byte little-endian length prefix of a safetensors file.
inline std::vector<uint8_t> length_prefix(uint64_t header_bytes) {
  std::vector<uint8_t> out(8);
  for (int i = 0; i < 8; i++) out[size_t(i)] = uint8_t(header_bytes >> (8 * i));
  return out;
}

// Writes `header` (any text, padded with spaces to a multiple of 8 and measured honestly) and then `data`:
// for headers whose offsets, dtypes or structure are deliberately wrong.
inline void write_with_header(const std::string& path, std::string header, const std::vector<uint8_t>& data) {
  while (header.size() % 8) header += ' ';
  std::vector<uint8_t> bytes = length_prefix(header.size());
  bytes.insert(bytes.end(), header.begin(), header.end());
  bytes.insert(bytes.end(), data.begin(), data.end());
  write_bytes(path, bytes);
}

// A fresh empty directory under the build tree's temp area, unique per name and per process: ctest runs test
// cases of one file as separate processes in parallel, and they must not remove each other's files.
inline std::string temp_dir(const std::string& name) {
  std::string dir = std::string(KVLITE_BINARY_DIR) + "/test-tmp/" + std::to_string(getpid()) + "/" + name;
  std::string cmd = "rm -rf '" + dir + "' && mkdir -p '" + dir + "'";
  if (std::system(cmd.c_str()) != 0) throw std::runtime_error("cannot make " + dir);
  return dir;
}

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

}  // namespace testing_safetensors
