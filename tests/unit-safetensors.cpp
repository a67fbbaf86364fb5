// safetensors: real files written into temp directories, read back through MappedFile / TensorStore; every
// malformed input the reference reader (huggingface/safetensors, safetensors/src/tensor.rs) rejects is
// rejected here with the right ErrorCode and a message naming the file and the tensor.
#include <doctest/doctest.h>
#include <random>
#include "kvlite.hpp"
#include "safetensors_writer.hpp"
using namespace kvlite;
namespace st = testing_safetensors;

namespace {

std::vector<uint8_t> random_bytes(size_t count, std::mt19937& rng) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<uint8_t> out(count);
  for (auto& b : out) b = uint8_t(byte(rng));
  return out;
}

template <class T>
Error error_of(const Result<T>& result) {
  REQUIRE_FALSE(result.ok());
  return result.error();
}

// The error has `code` and its message contains every one of `mentions` (file paths, tensor names, numbers).
void check_error(const Error& error, ErrorCode code, const std::vector<std::string>& mentions) {
  INFO("message: " << error.message);
  CHECK(error_code_name(error.code) == std::string(error_code_name(code)));
  for (const auto& text : mentions) CHECK_MESSAGE(error.message.find(text) != std::string::npos, "missing: " << text);
}

// A directory holding one file, `model.safetensors`, with `header` and `data` (header padded, length honest).
std::string model_with_header(const std::string& test, const std::string& header, const std::vector<uint8_t>& data) {
  std::string dir = st::temp_dir(test);
  st::write_with_header(dir + "/model.safetensors", header, data);
  return dir;
}

uint64_t read_le64(const uint8_t* p) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--) n = (n << 8) | p[i];
  return n;
}

}  // namespace

TEST_CASE("a single file round-trips every tensor bit-exactly, with its metadata") {
  std::mt19937 rng(20240611);
  // Odd shapes, a 0-element tensor, a scalar and densely packed F4 (10 elements in 5 bytes).
  std::vector<st::Tensor> tensors = {
      {"model.embed.weight", "BF16", {3, 5}, random_bytes(3 * 5 * 2, rng)},
      {"model.norm.weight", "F32", {7}, random_bytes(7 * 4, rng)},
      {"model.layers.0.q.weight_packed", "I32", {2, 3, 5}, random_bytes(2 * 3 * 5 * 4, rng)},
      {"model.layers.0.k.weight", "F8_E4M3", {5, 3}, random_bytes(5 * 3, rng)},
      {"model.empty", "I32", {4, 0}, {}},
      {"model.bytes", "U8", {11}, random_bytes(11, rng)},
      {"model.scalar", "F32", {}, random_bytes(4, rng)},
      {"model.fp4", "F4", {2, 5}, random_bytes(5, rng)},
  };
  std::map<std::string, std::string> metadata = {{"format", "pt"}, {"producer", "kvlite test"}};
  std::string dir = st::temp_dir("roundtrip");
  std::string path = dir + "/model.safetensors";
  st::write_file(path, tensors, metadata);

  auto store = TensorStore::open_dir(dir);
  REQUIRE_MESSAGE(store.ok(), store.error().message);
  REQUIRE(store->files() == std::vector<std::string>{path});
  REQUIRE(store->tensors().size() == tensors.size());
  auto file = MappedFile::open(path);
  REQUIRE(file.ok());
  const uint64_t data_start = 8 + read_le64((*file)->data());
  uint64_t sum = 0, begin = 0;  // the writer lays tensors out in list order from byte 0 of the data buffer
  for (const auto& expected : tensors) {
    CAPTURE(expected.name);
    const TensorInfo* info = store->find(expected.name);
    REQUIRE(info != nullptr);
    CHECK(dtype_name(info->dtype) == expected.dtype);
    CHECK(info->shape == expected.shape);
    CHECK(info->nbytes == expected.bytes.size());
    CHECK(info->offset == data_start + begin);
    CHECK(info->file_index == 0);
    // (an empty tensor's vector has no data pointer, and memcmp must not be given a null one)
    CHECK((expected.bytes.empty() || memcmp(store->data(*info), expected.bytes.data(), expected.bytes.size()) == 0));
    begin += expected.bytes.size();
    sum += expected.bytes.size();
  }
  CHECK(store->find("model.embed") == nullptr);
  CHECK(store->total_bytes() == sum);
  CHECK(store->require({"model.norm.weight", "model.empty"}).ok());

  auto header = parse_safetensors_header((*file)->data(), (*file)->size(), path);
  REQUIRE_MESSAGE(header.ok(), header.error().message);
  CHECK(header->metadata == metadata);
  CHECK(header->data_start == data_start);
  for (size_t i = 1; i < header->tensors.size(); i++)  // in data order
    CHECK(header->tensors[i - 1].offset <= header->tensors[i].offset);
}

TEST_CASE("bytes written by the reference implementation read as the reference reads them") {
  std::string dir = st::temp_dir("reference-bytes");
  // tensor.rs test_serialization: {"attn.0": F32 [1, 2, 3] = 0..5}, header of 64 bytes, data at 72.
  std::string header = R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})";
  std::vector<uint8_t> bytes = {64, 0, 0, 0, 0, 0, 0, 0};
  bytes.insert(bytes.end(), header.begin(), header.end());
  for (float v : {0.f, 1.f, 2.f, 3.f, 4.f, 5.f}) {
    uint8_t le[4];
    memcpy(le, &v, 4);
    bytes.insert(bytes.end(), le, le + 4);
  }
  REQUIRE(bytes.size() == 72 + 24);
  st::write_bytes(dir + "/attn.safetensors", bytes);
  // tensor.rs test_zero_sized_tensor: header of 60 bytes, no padding, a [2, 0] tensor and no data.
  std::string zero = R"({"test":{"dtype":"I32","shape":[2,0],"data_offsets":[0, 0]}})";
  std::vector<uint8_t> zero_bytes = {'<', 0, 0, 0, 0, 0, 0, 0};
  zero_bytes.insert(zero_bytes.end(), zero.begin(), zero.end());
  st::write_bytes(dir + "/zero.safetensors", zero_bytes);
  // tensor.rs test_empty (with metadata {"framework": "pt"}), padded with trailing spaces to 40 bytes.
  std::string empty = R"({"__metadata__":{"framework":"pt"}}     )";
  std::vector<uint8_t> empty_bytes = {40, 0, 0, 0, 0, 0, 0, 0};
  empty_bytes.insert(empty_bytes.end(), empty.begin(), empty.end());
  st::write_bytes(dir + "/empty.safetensors", empty_bytes);
  // tensor.rs test_whitespace_leading_padded_header: JSON whitespace before and after the object.
  st::write_bytes(dir + "/padded.safetensors", {6, 0, 0, 0, 0, 0, 0, 0, 0x09, 0x0A, '{', '}', 0x0D, 0x20});

  auto store = TensorStore::open_dir(dir);
  REQUIRE_MESSAGE(store.ok(), store.error().message);
  CHECK(store->files().size() == 4);
  const TensorInfo* attn = store->find("attn.0");
  REQUIRE(attn != nullptr);
  CHECK(attn->offset == 72);
  CHECK(attn->shape == std::vector<int64_t>{1, 2, 3});
  float values[6];
  memcpy(values, store->data(*attn), sizeof(values));
  for (int i = 0; i < 6; i++) CHECK(values[i] == float(i));
  const TensorInfo* test = store->find("test");
  REQUIRE(test != nullptr);
  CHECK(test->nbytes == 0);
  CHECK(test->numel() == 0);
  CHECK(store->tensors().size() == 2);

  auto file = MappedFile::open(dir + "/empty.safetensors");
  REQUIRE(file.ok());
  auto header_empty = parse_safetensors_header((*file)->data(), (*file)->size(), (*file)->path());
  REQUIRE(header_empty.ok());
  CHECK(header_empty->tensors.empty());
  CHECK(header_empty->metadata == std::map<std::string, std::string>{{"framework", "pt"}});
}

TEST_CASE("a sharded directory is read through its index, and only the shards it names") {
  std::mt19937 rng(7);
  std::string dir = st::temp_dir("sharded");
  std::vector<st::Tensor> shard1 = {{"a.weight", "BF16", {5, 3}, random_bytes(30, rng)},
                                    {"b.weight", "F32", {3}, random_bytes(12, rng)}};
  std::vector<st::Tensor> shard2 = {{"c.weight", "I32", {1, 7}, random_bytes(28, rng)}};
  st::write_file(dir + "/model-00001-of-00002.safetensors", shard1);
  st::write_file(dir + "/model-00002-of-00002.safetensors", shard2);
  // Not in the index: opening it would add a second "a.weight".
  st::write_file(dir + "/consolidated.safetensors", {{"a.weight", "U8", {2}, random_bytes(2, rng)}});
  st::write_text(dir + "/model.safetensors.index.json",
                 R"({"metadata": {"total_size": 70}, "weight_map": {
                       "a.weight": "model-00001-of-00002.safetensors",
                       "b.weight": "model-00001-of-00002.safetensors",
                       "c.weight": "model-00002-of-00002.safetensors"}})");

  auto store = TensorStore::open_dir(dir);
  REQUIRE_MESSAGE(store.ok(), store.error().message);
  REQUIRE(store->files().size() == 2);
  CHECK(store->files()[0] == dir + "/model-00001-of-00002.safetensors");
  CHECK(store->files()[1] == dir + "/model-00002-of-00002.safetensors");
  CHECK(store->total_bytes() == 70);
  for (const auto& [tensors, file_index] : {std::make_pair(shard1, 0), std::make_pair(shard2, 1)}) {
    for (const auto& expected : tensors) {
      CAPTURE(expected.name);
      const TensorInfo* info = store->find(expected.name);
      REQUIRE(info != nullptr);
      CHECK(info->file_index == file_index);
      CHECK(dtype_name(info->dtype) == expected.dtype);
      CHECK(memcmp(store->data(*info), expected.bytes.data(), expected.bytes.size()) == 0);
    }
  }
}

TEST_CASE("without an index or model.safetensors every *.safetensors file is read, in name order") {
  std::mt19937 rng(11);
  std::string dir = st::temp_dir("glob");
  auto second = random_bytes(6, rng), first = random_bytes(8, rng);
  st::write_file(dir + "/part-b.safetensors", {{"second", "BF16", {3}, second}});
  st::write_file(dir + "/part-a.safetensors", {{"first", "F32", {2}, first}});
  st::write_text(dir + "/config.json", "{}");
  st::write_text(dir + "/part-c.safetensors.bak", "not a safetensors file");

  auto store = TensorStore::open_dir(dir);
  REQUIRE_MESSAGE(store.ok(), store.error().message);
  CHECK(store->files() == std::vector<std::string>{dir + "/part-a.safetensors", dir + "/part-b.safetensors"});
  REQUIRE(store->find("first") != nullptr);
  REQUIRE(store->find("second") != nullptr);
  CHECK(store->find("first")->file_index == 0);
  CHECK(store->find("second")->file_index == 1);
  CHECK(memcmp(store->data(*store->find("second")), second.data(), second.size()) == 0);
}

TEST_CASE("model.safetensors is read alone when other safetensors files sit beside it") {
  std::mt19937 rng(13);
  std::string dir = st::temp_dir("single-preferred");
  st::write_file(dir + "/model.safetensors", {{"w", "F32", {3}, random_bytes(12, rng)}});
  st::write_file(dir + "/adapter.safetensors", {{"w", "F32", {3}, random_bytes(12, rng)}});
  auto store = TensorStore::open_dir(dir);
  REQUIRE_MESSAGE(store.ok(), store.error().message);
  CHECK(store->files() == std::vector<std::string>{dir + "/model.safetensors"});
}

TEST_CASE("a directory without weights gives an empty store") {
  std::string dir = st::temp_dir("no-weights");
  st::write_text(dir + "/config.json", "{}");
  auto store = TensorStore::open_dir(dir);
  REQUIRE_MESSAGE(store.ok(), store.error().message);
  CHECK(store->empty());
  CHECK(store->files().empty());
  CHECK(store->total_bytes() == 0);
  check_error(error_of(store->require({"lm_head.weight"})), ErrorCode::missing_tensor,
              {"'lm_head.weight'", "no safetensors files"});
}

TEST_CASE("a nonexistent directory is an io_error naming it") {
  std::string dir = std::string(KVLITE_BINARY_DIR) + "/test-tmp/no-such-model-dir";
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::io_error, {dir, "No such file or directory"});
}

TEST_CASE("a nonexistent file is an io_error naming it and the system's reason") {
  std::string path = std::string(KVLITE_BINARY_DIR) + "/test-tmp/no-such-file.safetensors";
  check_error(error_of(MappedFile::open(path)), ErrorCode::io_error, {path, "No such file or directory"});
  check_error(error_of(TensorStore::open_files({path})), ErrorCode::io_error, {path});
}

TEST_CASE("a file shorter than the 8-byte length prefix is truncated") {
  std::string dir = st::temp_dir("short-file");
  st::write_bytes(dir + "/model.safetensors", {8, 0, 0, 0, 0});
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format,
              {dir + "/model.safetensors", "truncated", "5 bytes"});
  st::write_bytes(dir + "/model.safetensors", {});
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format,
              {dir + "/model.safetensors", "truncated", "0 bytes"});
}

TEST_CASE("a header length beyond the end of the file is truncated") {
  std::string dir = st::temp_dir("header-beyond-file");
  std::string header = R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})";
  std::vector<uint8_t> bytes = st::length_prefix(4096);
  bytes.insert(bytes.end(), header.begin(), header.end());
  st::write_bytes(dir + "/model.safetensors", bytes);
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format,
              {dir + "/model.safetensors", "truncated", "4096", std::to_string(header.size())});
}

TEST_CASE("a header length over 100,000,000 bytes is refused before anything is read") {
  std::string dir = st::temp_dir("header-too-large");
  std::vector<uint8_t> bytes = st::length_prefix(100000001);
  std::string header = R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})";
  bytes.insert(bytes.end(), header.begin(), header.end());
  st::write_bytes(dir + "/model.safetensors", bytes);
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format,
              {dir + "/model.safetensors", "header of 100000001 bytes exceeds the 100000000-byte limit"});
  // tensor.rs test_header_too_large: the length 0xffffff000000003c.
  bytes = {'<', 0, 0, 0, 0, 0xff, 0xff, 0xff};
  bytes.insert(bytes.end(), header.begin(), header.end());
  st::write_bytes(dir + "/model.safetensors", bytes);
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format, {dir + "/model.safetensors", "limit"});
}

TEST_CASE("a header that is not valid JSON is bad_format with the parser's position") {
  std::string dir = model_with_header("malformed-json", R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2])",
                                      {1, 2});
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format,
              {dir + "/model.safetensors", "not valid JSON", "near byte"});
  // tensor.rs test_invalid_header_non_utf8: a 1-byte header 0xff.
  st::write_bytes(dir + "/model.safetensors", {1, 0, 0, 0, 0, 0, 0, 0, 0xff});
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format, {dir + "/model.safetensors", "JSON"});
  // Ill-formed UTF-8 inside a tensor name.
  model_with_header("malformed-json", "{\"w\xc3\x28\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]}}",
                    {1, 2});
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format, {dir + "/model.safetensors", "JSON"});
}

TEST_CASE("a header that is valid JSON but not an object is bad_format") {
  std::string dir = model_with_header("not-an-object", R"([{"dtype":"U8","shape":[2],"data_offsets":[0,2]}])", {1, 2});
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format,
              {dir + "/model.safetensors", "array", "not an object"});
}

TEST_CASE("an unknown dtype is unsupported, naming the tensor and the dtype") {
  std::string dir = model_with_header(
      "unknown-dtype", R"({"blk.0.ffn.weight":{"dtype":"Q4_K","shape":[2],"data_offsets":[0,2]}})", {1, 2});
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::unsupported,
              {dir + "/model.safetensors", "'blk.0.ffn.weight'", "'Q4_K'", "BF16"});
}

TEST_CASE("a negative or non-integer dimension is bad_format naming the tensor") {
  std::string dir = model_with_header(
      "negative-shape", R"({"proj.weight":{"dtype":"U8","shape":[3,-2],"data_offsets":[0,6]}})", {1, 2, 3, 4, 5, 6});
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format,
              {dir + "/model.safetensors", "'proj.weight'", "[3,-2]", "non-negative"});
  model_with_header("negative-shape", R"({"proj.weight":{"dtype":"U8","shape":[3,2.5],"data_offsets":[0,6]}})",
                    {1, 2, 3, 4, 5, 6});
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format, {"'proj.weight'", "non-negative"});
}

TEST_CASE("an element count that overflows 64 bits is bad_format naming the tensor") {
  std::vector<uint8_t> data(16, 7);
  // tensor.rs test_validation_overflow: shape [2, 2^63 - 1] of I32, and a dimension of 2^64 - 2.
  std::string dir = model_with_header(
      "overflow", R"({"test":{"dtype":"I32","shape":[2,9223372036854775807],"data_offsets":[0,16]}})", data);
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format,
              {dir + "/model.safetensors", "'test'", "overflows"});
  model_with_header("overflow", R"({"test":{"dtype":"I32","shape":[2,18446744073709551614],"data_offsets":[0,16]}})",
                    data);
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format, {"'test'", "overflows"});
  model_with_header("overflow",
                    R"({"test":{"dtype":"I32","shape":[4294967296,4294967296],"data_offsets":[0,16]}})", data);
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format, {"'test'", "overflows"});
}

TEST_CASE("a byte span other than numel x element size is bad_format with both sizes") {
  std::vector<uint8_t> data(56, 3);
  std::string dir = model_with_header(
      "span-mismatch", R"({"mlp.up.weight":{"dtype":"F32","shape":[3,5],"data_offsets":[0,56]}})", data);
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format,
              {dir + "/model.safetensors", "'mlp.up.weight'", "needs 60 bytes", "span 56 bytes"});
  // tensor.rs test_serialization_fp4_misaligned: 3 F4 elements are 12 bits, not whole bytes.
  model_with_header("span-mismatch", R"({"packed":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", {1, 2});
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format, {"'packed'", "12 bits"});
}

TEST_CASE("data_offsets beyond the data buffer are bad_format naming the tensor") {
  std::vector<uint8_t> data(40, 9);
  std::string dir = model_with_header("beyond-buffer", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},
      "b":{"dtype":"F32","shape":[3,3],"data_offsets":[16,52]}})", data);
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format,
              {dir + "/model.safetensors", "'b'", "ends at byte 52", "40 bytes"});
  model_with_header("beyond-buffer", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", data);
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format, {"'a'", "[8, 0]", "end before"});
}

TEST_CASE("overlapping spans are bad_format naming both tensors") {
  std::vector<uint8_t> data(24, 5);
  std::string dir = model_with_header("overlap", R"({"second":{"dtype":"F32","shape":[4],"data_offsets":[8,24]},
      "first":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", data);
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format,
              {dir + "/model.safetensors", "'second'", "overlaps", "'first'"});
  // tensor.rs test_json_attack: many tensors sharing the same span.
  model_with_header("overlap", R"({"w0":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},
      "w1":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})", std::vector<uint8_t>(16, 1));
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format, {"'w1'", "overlaps", "'w0'"});
}

TEST_CASE("a hole between spans is bad_format naming the tensor after it") {
  std::vector<uint8_t> data(36, 5);
  std::string dir = model_with_header("hole", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},
      "b":{"dtype":"F32","shape":[4],"data_offsets":[20,36]}})", data);
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format,
              {dir + "/model.safetensors", "hole", "4 unused bytes", "'a'", "'b'"});
  model_with_header("hole", R"({"late":{"dtype":"F32","shape":[4],"data_offsets":[4,20]}})",
                    std::vector<uint8_t>(20, 1));
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format, {"hole", "'late'", "start"});
}

TEST_CASE("data after the last tensor is bad_format, as in the reference reader") {
  // tensor.rs test_metadata_incomplete_buffer: 16 bytes of data for a [2, 2] I32 tensor, then extra bytes.
  std::vector<uint8_t> data(16 + 10, 2);
  std::string dir = model_with_header("trailing-data",
                                      R"({"test":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}})", data);
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format,
              {dir + "/model.safetensors", "10 bytes of data follow", "'test'"});
  model_with_header("trailing-data", "{}", {1, 2, 3});
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format, {"3 bytes", "no tensors"});
}

TEST_CASE("a tensor named twice in one header is bad_format naming it") {
  std::vector<uint8_t> data(8, 4);
  std::string dir = model_with_header("duplicate-name",
                                      R"({"dup.weight":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},
      "dup.weight":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", data);
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format,
              {dir + "/model.safetensors", "tensor 'dup.weight' appears twice"});
  model_with_header("duplicate-name", R"({"w":{"dtype":"F32","dtype":"U8","shape":[2],"data_offsets":[0,8]}})",
                    data);
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format, {"'dtype' appears twice", "'w'"});
}

TEST_CASE("__metadata__ that is not a string-to-string map is bad_format naming the key") {
  std::string dir = model_with_header("bad-metadata", R"({"__metadata__":{"format":"pt","epoch":3},
      "w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", {1, 2});
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format,
              {dir + "/model.safetensors", "__metadata__", "'epoch'", "3"});
  model_with_header("bad-metadata", R"({"__metadata__":["pt"],"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})",
                    {1, 2});
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format, {"__metadata__", "array"});
}

TEST_CASE("an index naming tensors its shard lacks is missing_tensor, listing ten and counting the rest") {
  std::mt19937 rng(3);
  std::string dir = st::temp_dir("index-missing");
  std::string shard = "model-00001-of-00001.safetensors";
  st::write_file(dir + "/" + shard, {{"present", "U8", {3}, random_bytes(3, rng)}});
  std::string weight_map = "\"present\": \"" + shard + "\"";
  for (int i = 0; i < 12; i++) weight_map += ",\"layers." + std::to_string(i) + ".gone\": \"" + shard + "\"";
  st::write_text(dir + "/model.safetensors.index.json", "{\"weight_map\": {" + weight_map + "}}");
  Error error = error_of(TensorStore::open_dir(dir));
  check_error(error, ErrorCode::missing_tensor,
              {dir + "/model.safetensors.index.json", "12 tensor(s)", "'layers.0.gone' (not in " + shard + ")",
               "and 2 more"});
  CHECK(error.message.find("'present'") == std::string::npos);
}

TEST_CASE("a tensor in two shards is bad_format naming both") {
  std::mt19937 rng(5);
  std::string dir = st::temp_dir("two-shards");
  st::write_file(dir + "/model-00001-of-00002.safetensors", {{"shared.weight", "U8", {3}, random_bytes(3, rng)}});
  st::write_file(dir + "/model-00002-of-00002.safetensors", {{"shared.weight", "U8", {3}, random_bytes(3, rng)},
                                                             {"own.weight", "U8", {2}, random_bytes(2, rng)}});
  st::write_text(dir + "/model.safetensors.index.json", R"({"weight_map": {
      "shared.weight": "model-00001-of-00002.safetensors", "own.weight": "model-00002-of-00002.safetensors"}})");
  check_error(error_of(TensorStore::open_dir(dir)), ErrorCode::bad_format,
              {"'shared.weight'", dir + "/model-00001-of-00002.safetensors",
               dir + "/model-00002-of-00002.safetensors"});
}

TEST_CASE("require lists every missing tensor and how many") {
  std::mt19937 rng(17);
  std::string dir = st::temp_dir("require");
  st::write_file(dir + "/model.safetensors",
                 {{"a", "U8", {3}, random_bytes(3, rng)}, {"b", "BF16", {2}, random_bytes(4, rng)}});
  auto store = TensorStore::open_dir(dir);
  REQUIRE_MESSAGE(store.ok(), store.error().message);
  CHECK(store->require({"b", "a"}).ok());
  Error error = error_of(store->require({"a", "lm_head.weight", "b", "model.norm.weight", "visual.merger.weight"}));
  check_error(error, ErrorCode::missing_tensor,
              {"3 of 5", dir + "/model.safetensors", "'lm_head.weight'", "'model.norm.weight'",
               "'visual.merger.weight'"});
  CHECK(error.message.find("'a'") == std::string::npos);
}
