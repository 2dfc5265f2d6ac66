// safetensors reader/writer. Every header field is validated before any tensor byte is touched.
#include "formats/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>
#include <unordered_set>

#include "core/error.h"

namespace bg {
namespace {

using json = nlohmann::json;

uint64_t read_u64_le(std::span<const std::byte> bytes) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(bytes[static_cast<size_t>(i)]);
  return v;
}

// Header text is untrusted: names and values quoted in messages are escaped (control bytes, and non-ASCII bytes when
// `ascii_only`) and cut to a bounded length so an error never carries megabytes or terminal escapes.
std::string printable(std::string_view s, bool ascii_only = false) {
  constexpr size_t kMaxShown = 200;
  std::string out;
  for (size_t i = 0; i < s.size() && i < kMaxShown; ++i) {
    auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f || (ascii_only && c >= 0x80)) {
      out += fmt::format("\\x{:02x}", c);
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  if (s.size() > kMaxShown) out += fmt::format("... ({} bytes)", s.size());
  return out;
}

// A short description of a JSON value for messages; never recursive (dump() of a deeply nested value would be).
std::string describe(const json& j) {
  if (j.is_string()) return fmt::format("\"{}\"", printable(j.get_ref<const std::string&>()));
  if (j.is_array()) return fmt::format("an array of {} elements", j.size());
  if (j.is_object()) return fmt::format("an object of {} keys", j.size());
  return j.dump();  // number, bool, null: no strings inside, cannot throw
}

uint64_t json_u64(const json& j, const std::string& what) {
  BG_CHECK(j.is_number_unsigned() || (j.is_number_integer() && j.get<int64_t>() >= 0),
           "{}: expected a non-negative integer, got {}", what, describe(j));
  return j.get<uint64_t>();
}

// Records the first key that repeats within one JSON object. nlohmann keeps the last value of a repeated key
// silently; safetensors forbids duplicates, and a repeated tensor name would hide which bytes are meant.
class DuplicateKeyFinder {
 public:
  bool on_event(json::parse_event_t event, const json& parsed) {
    using E = json::parse_event_t;
    if (event == E::object_start) {
      open_.emplace_back();
    } else if (event == E::object_end) {
      if (!open_.empty()) open_.pop_back();
    } else if (event == E::key && !open_.empty() && parsed.is_string()) {
      const auto& key = parsed.get_ref<const std::string&>();
      if (open_.size() == 1) top_key_ = key;
      if (!open_.back().insert(key).second && !duplicate_) {
        duplicate_ = open_.size() == 1 ? fmt::format("duplicate tensor key '{}'", printable(key))
                                       : fmt::format("duplicate key '{}' inside '{}'", printable(key),
                                                     printable(top_key_));
      }
    }
    return true;  // keep everything; the DOM is discarded anyway when a duplicate is reported
  }
  const std::optional<std::string>& duplicate() const { return duplicate_; }

 private:
  std::vector<std::unordered_set<std::string>> open_;  // key sets of the objects being parsed, outermost first
  std::string top_key_;                                // the header key whose value is being parsed
  std::optional<std::string> duplicate_;
};

// Parses the header text. Every nlohmann exception (syntax, invalid UTF-8, control characters) becomes a bg::Error.
json parse_header_json(std::string_view text, const std::string& what) {
  DuplicateKeyFinder dups;
  json root;
  try {
    root = json::parse(
        text.begin(), text.end(),
        [&dups](int, json::parse_event_t event, json& parsed) { return dups.on_event(event, parsed); },
        /*allow_exceptions=*/true);
  } catch (const json::exception& e) {
    fail("{}: header is not valid JSON: {}", what, printable(e.what(), /*ascii_only=*/true));
  }
  BG_CHECK(!dups.duplicate().has_value(), "{}: {} in the header", what, *dups.duplicate());
  return root;
}

std::map<std::string, std::string> parse_metadata(const json& value, const std::string& what) {
  std::map<std::string, std::string> out;
  BG_CHECK(value.is_object() || value.is_null(), "{}: __metadata__ is not an object (got {})", what,
           describe(value));
  if (value.is_null()) return out;
  for (const auto& [key, v] : value.items()) {
    BG_CHECK(v.is_string(), "{}: __metadata__['{}'] is not a string (got {})", what, printable(key), describe(v));
    out[key] = v.get<std::string>();
  }
  return out;
}

SafetensorsEntry parse_entry(const std::string& name, const json& j, uint64_t buffer_bytes, uint64_t data_start,
                             const std::string& what) {
  std::string where = fmt::format("{}: tensor '{}'", what, printable(name));
  BG_CHECK(j.is_object(), "{}: entry is not a JSON object (got {})", where, describe(j));
  BG_CHECK(j.contains("dtype") && j["dtype"].is_string(), "{}: missing or non-string 'dtype'", where);
  BG_CHECK(j.contains("shape") && j["shape"].is_array(), "{}: missing or non-array 'shape'", where);
  BG_CHECK(j.contains("data_offsets") && j["data_offsets"].is_array() && j["data_offsets"].size() == 2,
           "{}: 'data_offsets' must be an array of two integers", where);
  for (const auto& [key, _] : j.items()) {
    BG_CHECK(key == "dtype" || key == "shape" || key == "data_offsets", "{}: unknown field '{}'", where,
             printable(key));
  }
  SafetensorsEntry e;
  e.name = name;
  const auto& dtype_str = j["dtype"].get_ref<const std::string&>();
  auto dtype = dtype_from_name(dtype_str);
  BG_CHECK(dtype.has_value(), "{}: unknown or unsupported dtype '{}'", where, printable(dtype_str));
  e.dtype = *dtype;
  constexpr uint64_t kMaxNumel = uint64_t{1} << 62;  // shape_numel's limit; checked here to name the tensor
  uint64_t numel = 1;
  for (const auto& d : j["shape"]) {
    uint64_t dim = json_u64(d, where + " shape");
    BG_CHECK(dim < kMaxNumel, "{}: dimension {} is too large", where, dim);
    e.shape.push_back(static_cast<int64_t>(dim));
    BG_CHECK(dim == 0 || numel <= kMaxNumel / dim, "{}: shape {} is too large", where, shape_str(e.shape));
    numel *= dim;
  }
  uint64_t begin = json_u64(j["data_offsets"][0], where + " data_offsets[0]");
  uint64_t end = json_u64(j["data_offsets"][1], where + " data_offsets[1]");
  BG_CHECK(begin <= end, "{}: data_offsets [{}, {}) are reversed", where, begin, end);
  BG_CHECK(end <= buffer_bytes, "{}: data_offsets [{}, {}) run past the data buffer of {} bytes", where, begin, end,
           buffer_bytes);
  uint64_t elem = dtype_size_bytes(e.dtype);
  BG_CHECK(numel <= UINT64_MAX / elem, "{}: shape {} overflows", where, shape_str(e.shape));
  BG_CHECK(end - begin == numel * elem, "{}: {} bytes stored but shape {} x {} needs {}", where, end - begin,
           shape_str(e.shape), dtype_str, numel * elem);
  e.file_offset = data_start + begin;
  e.nbytes = end - begin;
  return e;
}

// No overlap and no holes: sorted by offset, the entries must tile the buffer [data_start, file_size) exactly.
void check_tiling(const SafetensorsHeader& h, uint64_t file_size, const std::string& what) {
  std::vector<const SafetensorsEntry*> sorted;
  for (const auto& e : h.entries) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) {
    return a->file_offset != b->file_offset ? a->file_offset < b->file_offset : a->nbytes < b->nbytes;
  });
  uint64_t cursor = h.data_start;
  for (const auto* e : sorted) {
    BG_CHECK(e->file_offset >= cursor, "{}: tensor '{}' overlaps the tensor before it (offset {} < {})", what,
             printable(e->name), e->file_offset - h.data_start, cursor - h.data_start);
    BG_CHECK(e->file_offset == cursor, "{}: {} unused bytes (a hole) before tensor '{}'", what,
             e->file_offset - cursor, printable(e->name));
    cursor = e->file_offset + e->nbytes;
  }
  BG_CHECK(cursor == file_size, "{}: {} bytes after the last tensor are not covered by the header", what,
           file_size - cursor);
}

}  // namespace

SafetensorsHeader parse_safetensors_header(std::span<const std::byte> bytes, uint64_t file_size,
                                           const std::string& what) {
  BG_CHECK(file_size >= 8 && bytes.size() >= 8, "{}: file of {} bytes is too short for a safetensors header", what,
           file_size);
  uint64_t header_len = read_u64_le(bytes);
  BG_CHECK(header_len <= kMaxSafetensorsHeaderBytes, "{}: header length {} exceeds the {} byte limit", what,
           header_len, kMaxSafetensorsHeaderBytes);
  BG_CHECK(header_len <= file_size - 8, "{}: header length {} runs past the end of the {} byte file", what,
           header_len, file_size);
  BG_CHECK(bytes.size() >= 8 + header_len, "{}: header truncated ({} of {} bytes available)", what, bytes.size() - 8,
           header_len);
  std::string_view text(reinterpret_cast<const char*>(bytes.data() + 8), header_len);
  json root = parse_header_json(text, what);
  BG_CHECK(root.is_object(), "{}: header JSON is not an object (got {})", what, describe(root));

  SafetensorsHeader h;
  h.data_start = 8 + header_len;
  uint64_t buffer_bytes = file_size - h.data_start;
  for (const auto& [key, value] : root.items()) {
    if (key == "__metadata__") {
      h.metadata = parse_metadata(value, what);
    } else {
      h.entries.push_back(parse_entry(key, value, buffer_bytes, h.data_start, what));
    }
  }
  check_tiling(h, file_size, what);
  return h;
}

std::unique_ptr<SafetensorsFile> SafetensorsFile::open(const std::filesystem::path& path) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  BG_CHECK(fd >= 0, "cannot open '{}': {}", path.string(), std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("'{}' is not a regular file", path.string());
  }
  uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    ::close(fd);
    fail("{}: file of {} bytes is too short for a safetensors header", path.string(), file_size);
  }
  void* map = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  BG_CHECK(map != MAP_FAILED, "cannot mmap '{}': {}", path.string(), std::strerror(errno));
  f->map_ = map;
  f->map_bytes_ = file_size;
  std::span<const std::byte> bytes(static_cast<const std::byte*>(map), file_size);
  f->header_ = parse_safetensors_header(bytes, file_size, path.string());
  for (size_t i = 0; i < f->header_.entries.size(); ++i) f->index_[f->header_.entries[i].name] = i;
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

TensorView SafetensorsFile::view(const std::string& name) const {
  auto it = index_.find(name);
  BG_CHECK(it != index_.end(), "{}: no tensor named '{}'", path_.string(), name);
  const auto& e = header_.entries[it->second];
  return TensorView{e.dtype, e.shape, static_cast<const std::byte*>(map_) + e.file_offset, e.nbytes, e.name};
}

void write_safetensors(const std::filesystem::path& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    BG_CHECK(!header.contains(t.name), "write_safetensors: duplicate tensor name '{}'", t.name);
    uint64_t expected = static_cast<uint64_t>(t.view.numel()) * dtype_size_bytes(t.view.dtype);
    BG_CHECK(expected == t.view.nbytes, "write_safetensors: tensor '{}' has {} bytes for shape {}", t.name,
             t.view.nbytes, shape_str(t.view.shape));
    header[t.name] = {{"dtype", std::string(dtype_name(t.view.dtype))},
                      {"shape", t.view.shape},
                      {"data_offsets", {offset, offset + t.view.nbytes}}};
    offset += t.view.nbytes;
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text.push_back(' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  BG_CHECK(out.good(), "cannot create '{}'", path.string());
  uint64_t len = text.size();
  unsigned char len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>((len >> (8 * i)) & 0xff);
  out.write(reinterpret_cast<const char*>(len_bytes), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& t : tensors) {
    out.write(reinterpret_cast<const char*>(t.view.data), static_cast<std::streamsize>(t.view.nbytes));
  }
  out.close();
  BG_CHECK(out.good(), "write to '{}' failed", path.string());
}

}  // namespace bg
