// safetensors: good files read back exactly; every malformed header is a bg::Error naming the file and the fault.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "core/tensor.h"
#include "formats/formats_testing.h"
#include "formats/safetensors.h"

namespace bg {
namespace {

using testing::error_of;
using testing::expect_error;
using testing::raw_safetensors;
using testing::TempDir;
using testing::u64_le;
using testing::write_bytes;

HostTensor iota_tensor(DType dtype, Shape shape) {
  HostTensor t(dtype, std::move(shape));
  for (size_t i = 0; i < t.nbytes(); ++i) t.data()[i] = static_cast<std::byte>((i * 37 + 11) & 0xff);
  return t;
}

std::string bytes_of(const TensorView& v) { return std::string(reinterpret_cast<const char*>(v.data), v.nbytes); }

// Writes header + data as a file and expects SafetensorsFile::open to fail naming the file and every part.
void expect_open_error(std::string_view header, std::string_view data, std::initializer_list<std::string_view> parts,
                       std::source_location loc = std::source_location::current()) {
  TempDir dir;
  auto path = dir / "bad.safetensors";
  write_bytes(path, raw_safetensors(header, data));
  std::string msg = error_of([&] { SafetensorsFile::open(path); }, loc);
  ::testing::ScopedTrace trace(loc.file_name(), static_cast<int>(loc.line()), "expect_open_error");
  EXPECT_NE(msg.find(path.string()), std::string::npos) << "message \"" << msg << "\" does not name the file";
  for (auto part : parts) {
    EXPECT_NE(msg.find(part), std::string::npos) << "message \"" << msg << "\" lacks \"" << part << "\"";
  }
}

TEST(Safetensors, WritesAndReadsBackExactly) {
  TempDir dir;
  HostTensor a = iota_tensor(DType::kF32, {2, 3});
  HostTensor b = iota_tensor(DType::kBF16, {5});
  HostTensor scalar = iota_tensor(DType::kI64, {});    // 0-rank: one element
  HostTensor empty = iota_tensor(DType::kU8, {0, 4});  // no bytes
  HostTensor fp8 = iota_tensor(DType::kF8E4M3, {3});   // odd size: later tensors are unaligned
  HostTensor c = iota_tensor(DType::kI32, {2, 2});
  std::vector<NamedTensor> tensors = {{"a", a.view()},         {"b", b.view()},     {"scalar", scalar.view()},
                                      {"empty", empty.view()}, {"fp8", fp8.view()}, {"c", c.view()}};
  auto path = dir / "model.safetensors";
  write_safetensors(path, tensors, {{"format", "pt"}});

  auto f = SafetensorsFile::open(path);
  EXPECT_EQ(f->header().metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
  EXPECT_EQ(f->header().data_start % 8, 0u);  // the writer pads the header to 8 bytes
  EXPECT_EQ(f->header().entries.size(), tensors.size());
  for (const auto& t : tensors) {
    SCOPED_TRACE(t.name);
    ASSERT_TRUE(f->contains(t.name));
    TensorView v = f->view(t.name);
    EXPECT_EQ(v.dtype, t.view.dtype);
    EXPECT_EQ(v.shape, t.view.shape);
    EXPECT_EQ(v.nbytes, t.view.nbytes);
    EXPECT_EQ(v.name, t.name);
    EXPECT_EQ(bytes_of(v), bytes_of(t.view));
  }
  EXPECT_EQ(f->view("scalar").rank(), 0);
  EXPECT_EQ(f->view("scalar").numel(), 1);
  EXPECT_EQ(f->view("empty").numel(), 0);
  float a0 = 0;
  std::memcpy(&a0, a.data(), 4);
  EXPECT_EQ(f->view("a").get_f32(0), a0);
  expect_error([&] { f->view("nope"); }, {"no tensor named 'nope'", path.string()});
}

TEST(Safetensors, HandWrittenHeadersAreAccepted) {
  // Not from our writer: unpadded, unsorted offsets, spaces around the JSON, empty tensors sharing an offset.
  std::string header = R"(  {"z":{"dtype":"U8","shape":[2],"data_offsets":[4,6]},)"
                       R"("e1":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
                       R"("e2":{"dtype":"I64","shape":[3,0],"data_offsets":[4,4]},)"
                       R"("s":{"dtype":"F32","shape":[],"data_offsets":[0,4]},"__metadata__":null}   )";
  std::string data("\x00\x00\x80\x3f\x07\x09", 6);
  std::string file = raw_safetensors(header, data);
  auto h = parse_safetensors_header(std::as_bytes(std::span(file.data(), file.size())), file.size(), "mem");
  EXPECT_EQ(h.data_start, 8 + header.size());
  ASSERT_EQ(h.entries.size(), 4u);
  EXPECT_TRUE(h.metadata.empty());
  for (const auto& e : h.entries) {
    if (e.name == "s") {
      EXPECT_EQ(e.shape, Shape{});
      EXPECT_EQ(e.file_offset, h.data_start);
      EXPECT_EQ(e.nbytes, 4u);
    } else if (e.name == "z") {
      EXPECT_EQ(e.file_offset, h.data_start + 4);
    } else {
      EXPECT_EQ(e.nbytes, 0u);
    }
  }
  // An empty file body: header "{}" and no tensors.
  std::string empty = raw_safetensors("{}", "");
  EXPECT_TRUE(parse_safetensors_header(std::as_bytes(std::span(empty.data(), empty.size())), empty.size(), "mem")
                  .entries.empty());
}

TEST(Safetensors, TruncatedShardIsAnError) {
  TempDir dir;
  HostTensor a = iota_tensor(DType::kF32, {16});
  HostTensor b = iota_tensor(DType::kF32, {16});
  auto path = dir / "cut.safetensors";
  write_safetensors(path, {{"first", a.view()}, {"second", b.view()}});
  std::string whole = testing::read_bytes(path);
  write_bytes(path, whole.substr(0, whole.size() - 30));  // cut inside 'second'
  expect_error([&] { SafetensorsFile::open(path); },
               {path.string(), "tensor 'second'", "run past the data buffer"});
  write_bytes(path, whole.substr(0, 5));  // cut inside the length prefix
  expect_error([&] { SafetensorsFile::open(path); }, {path.string(), "too short"});
}

TEST(Safetensors, HeaderLengthChecks) {
  TempDir dir;
  auto path = dir / "len.safetensors";
  write_bytes(path, u64_le(1000) + "{}");
  expect_error([&] { SafetensorsFile::open(path); }, {path.string(), "header length 1000 runs past the end"});
  write_bytes(path, u64_le(100'000'001) + "{}");
  expect_error([&] { SafetensorsFile::open(path); }, {path.string(), "exceeds the 100000000 byte limit"});
  write_bytes(path, u64_le(~uint64_t{0}) + "{}");
  expect_error([&] { SafetensorsFile::open(path); }, {path.string(), "exceeds"});
  // The span may hold less than the header (a caller that read only a prefix).
  std::string file = raw_safetensors("{}    ", "");
  expect_error([&] { parse_safetensors_header(std::as_bytes(std::span(file.data(), 10)), file.size(), "mem"); },
               {"mem", "header truncated"});
}

TEST(Safetensors, InvalidJson) {
  expect_open_error(R"({"a": )", "", {"not valid JSON"});
  expect_open_error(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}} trailing)", "x", {"not valid JSON"});
  expect_open_error("", "", {"not valid JSON"});
  expect_open_error(std::string(16, '\0'), "", {"not valid JSON"});
}

TEST(Safetensors, GarbageBytesGiveAPrintableError) {
  // Invalid UTF-8 in a key, a raw control character in a string, and every byte value in a row.
  std::string bad_utf8 = "{\"\xff\xfe\":{}}";
  std::string control = "{\"a\x01\":{}}";
  std::string all_bytes;
  for (int c = 0; c < 256; ++c) all_bytes.push_back(static_cast<char>(c));
  for (const std::string& header : {bad_utf8, control, all_bytes, std::string("{\"\xc3\x28\": 1}")}) {
    TempDir dir;
    auto path = dir / "garbage.safetensors";
    write_bytes(path, raw_safetensors(header, ""));
    std::string msg = error_of([&] { SafetensorsFile::open(path); });
    EXPECT_NE(msg.find("not valid JSON"), std::string::npos) << msg;
    EXPECT_NE(msg.find(path.string()), std::string::npos) << msg;
    for (char ch : msg) {
      auto c = static_cast<unsigned char>(ch);
      EXPECT_TRUE(c >= 0x20 && c < 0x7f) << "unprintable byte " << int(c) << " in message";
    }
  }
}

TEST(Safetensors, DeepNestingIsAnErrorNotACrash) {
  std::string deep_array = std::string(100000, '[') + std::string(100000, ']');
  expect_open_error(deep_array, "", {"not an object"});
  std::string deep_shape = R"({"t":{"dtype":"U8","shape":)" + deep_array + R"(,"data_offsets":[0,0]}})";
  expect_open_error(deep_shape, "", {"tensor 't' shape", "expected a non-negative integer", "an array of 1 elements"});
  std::string deep_obj;
  for (int i = 0; i < 50000; ++i) deep_obj += "{\"k\":";
  deep_obj += '1';
  deep_obj.append(50000, '}');
  expect_open_error(deep_obj, "", {"tensor 'k'", "missing or non-string 'dtype'"});
}

TEST(Safetensors, HeaderNotAnObject) {
  expect_open_error("[1, 2]", "", {"header JSON is not an object", "an array of 2 elements"});
  expect_open_error("\"str\"", "", {"not an object"});
  expect_open_error("42", "", {"not an object", "42"});
  expect_open_error("null", "", {"not an object"});
  expect_open_error(R"({"t": [1]})", "", {"tensor 't'", "entry is not a JSON object"});
}

TEST(Safetensors, UnknownDtype) {
  expect_open_error(R"({"t":{"dtype":"Q4_K","shape":[1],"data_offsets":[0,1]}})", "x",
                    {"tensor 't'", "unknown or unsupported dtype 'Q4_K'"});
  expect_open_error(R"({"t":{"dtype":7,"shape":[1],"data_offsets":[0,1]}})", "x", {"tensor 't'", "'dtype'"});
  expect_open_error(R"({"t":{"shape":[1],"data_offsets":[0,1]}})", "x", {"tensor 't'", "missing or non-string"});
  expect_open_error(R"({"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":1}})", "x",
                    {"tensor 't'", "unknown field 'extra'"});
}

TEST(Safetensors, BadShapes) {
  expect_open_error(R"({"t":{"dtype":"U8","shape":[-1,2],"data_offsets":[0,0]}})", "",
                    {"tensor 't' shape", "non-negative integer", "-1"});
  expect_open_error(R"({"t":{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}})", "x",
                    {"tensor 't' shape", "non-negative integer", "1.5"});
  expect_open_error(R"({"t":{"dtype":"U8","shape":["3"],"data_offsets":[0,3]}})", "xyz",
                    {"tensor 't' shape", "\"3\""});
  expect_open_error(R"({"t":{"dtype":"U8","shape":3,"data_offsets":[0,3]}})", "xyz", {"tensor 't'", "'shape'"});
  expect_open_error(R"({"t":{"dtype":"U8","shape":[4611686018427387904],"data_offsets":[0,0]}})", "",
                    {"tensor 't'", "too large"});
  expect_open_error(R"({"t":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", "",
                    {"too large"});
}

TEST(Safetensors, BadDataOffsets) {
  const std::string data(16, 'x');
  expect_open_error(R"({"t":{"dtype":"U8","shape":[1000],"data_offsets":[0,1000]}})", data,
                    {"tensor 't'", "data_offsets [0, 1000) run past the data buffer of 16 bytes"});
  expect_open_error(R"({"t":{"dtype":"U8","shape":[0],"data_offsets":[8,0]}})", data,
                    {"tensor 't'", "data_offsets [8, 0) are reversed"});
  expect_open_error(R"({"t":{"dtype":"U8","shape":[16],"data_offsets":[0]}})", data,
                    {"tensor 't'", "array of two integers"});
  expect_open_error(R"({"t":{"dtype":"U8","shape":[16],"data_offsets":[0,8,16]}})", data,
                    {"tensor 't'", "array of two integers"});
  expect_open_error(R"({"t":{"dtype":"U8","shape":[16],"data_offsets":"0,16"}})", data, {"tensor 't'"});
  expect_open_error(R"({"t":{"dtype":"U8","shape":[16],"data_offsets":[-1,16]}})", data,
                    {"tensor 't' data_offsets[0]", "non-negative integer"});
  expect_open_error(R"({"t":{"dtype":"U8","shape":[16],"data_offsets":[0,16.0]}})", data,
                    {"tensor 't' data_offsets[1]", "non-negative integer"});
  expect_open_error(R"({"t":{"dtype":"U8","shape":[16],"data_offsets":[0,18446744073709551616]}})", data,
                    {"tensor 't' data_offsets[1]"});
}

TEST(Safetensors, OverlapsHolesAndUncoveredBytes) {
  const std::string data(12, 'x');
  expect_open_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                    R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                    data, {"tensor 'b' overlaps the tensor before it"});
  expect_open_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                    R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                    std::string(8, 'x'), {"overlaps"});
  // An empty tensor inside another one's bytes is an overlap too.
  expect_open_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                    R"("e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
                    std::string(8, 'x'), {"tensor 'e' overlaps"});
  expect_open_error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                    R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                    data, {"4 unused bytes (a hole) before tensor 'b'"});
  expect_open_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", data,
                    {"4 bytes after the last tensor are not covered"});
  expect_open_error("{}", "junk", {"4 bytes after the last tensor"});
}

TEST(Safetensors, SizeMustMatchShapeTimesDtype) {
  expect_open_error(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, 'x'),
                    {"tensor 't'", "8 bytes stored but shape [3] x F32 needs 12"});
  expect_open_error(R"({"t":{"dtype":"BF16","shape":[],"data_offsets":[0,4]}})", std::string(4, 'x'),
                    {"tensor 't'", "4 bytes stored but shape [] x BF16 needs 2"});
}

TEST(Safetensors, DuplicateKeysAreErrors) {
  const std::string entry = R"({"dtype":"U8","shape":[2],"data_offsets":[0,2]})";
  expect_open_error("{\"w\":" + entry + ",\"w\":" + entry + "}", "xy", {"duplicate tensor key 'w'"});
  expect_open_error(R"({"w":{"dtype":"U8","dtype":"U8","shape":[2],"data_offsets":[0,2]}})", "xy",
                    {"duplicate key 'dtype' inside 'w'"});
  expect_open_error(R"({"__metadata__":{"k":"1","k":"2"},"w":)" + entry + "}", "xy",
                    {"duplicate key 'k' inside '__metadata__'"});
  expect_open_error(R"({"__metadata__":{},"__metadata__":{}})", "", {"duplicate tensor key '__metadata__'"});
  // The same key in two different objects is fine.
  TempDir dir;
  auto path = dir / "ok.safetensors";
  write_bytes(path, raw_safetensors(R"({"__metadata__":{"dtype":"x"},"w":)" + entry + "}", "xy"));
  EXPECT_EQ(SafetensorsFile::open(path)->header().metadata.at("dtype"), "x");
}

TEST(Safetensors, MetadataMustBeStrings) {
  expect_open_error(R"({"__metadata__":{"format":"pt","n":1}})", "", {"__metadata__['n'] is not a string", "1"});
  expect_open_error(R"({"__metadata__":{"a":null}})", "", {"__metadata__['a'] is not a string"});
  expect_open_error(R"({"__metadata__":{"a":{"b":"c"}}})", "", {"__metadata__['a'] is not a string"});
  expect_open_error(R"({"__metadata__":["pt"]})", "", {"__metadata__ is not an object"});
  expect_open_error(R"({"__metadata__":"pt"})", "", {"__metadata__ is not an object"});
}

TEST(Safetensors, LongNamesAreCutInMessages) {
  std::string name(5000, 'n');
  std::string header = "{\"" + name + R"(":{"dtype":"Q","shape":[],"data_offsets":[0,0]}})";
  TempDir dir;
  auto path = dir / "long.safetensors";
  write_bytes(path, raw_safetensors(header, ""));
  std::string msg = error_of([&] { SafetensorsFile::open(path); });
  EXPECT_NE(msg.find("(5000 bytes)"), std::string::npos) << msg;
  EXPECT_LT(msg.size(), 1000u);
}

TEST(Safetensors, WriterRejectsBadInput) {
  TempDir dir;
  HostTensor a = iota_tensor(DType::kF32, {2});
  expect_error([&] { write_safetensors(dir / "x.safetensors", {{"a", a.view()}, {"a", a.view()}}); },
               {"duplicate tensor name 'a'"});
  TensorView short_view = a.view();
  short_view.nbytes = 4;
  expect_error([&] { write_safetensors(dir / "x.safetensors", {{"s", short_view}}); }, {"tensor 's' has 4 bytes"});
  expect_error([&] { write_safetensors(dir / "no_such_dir" / "x.safetensors", {{"a", a.view()}}); },
               {"cannot create"});
}

TEST(Safetensors, OpenErrors) {
  TempDir dir;
  expect_error([&] { SafetensorsFile::open(dir / "missing.safetensors"); }, {"cannot open", "missing.safetensors"});
  expect_error([&] { SafetensorsFile::open(dir.path()); }, {"not a regular file"});
  write_bytes(dir / "empty.safetensors", "");
  expect_error([&] { SafetensorsFile::open(dir / "empty.safetensors"); }, {"too short"});
}

}  // namespace
}  // namespace bg
