#include "state_dict/manifest.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "formats/io/crc32c.h"
#include "state_dict/internal/status_macros.h"

namespace state_dict {
namespace {

constexpr char kMagic[] = "torchfsdp-checkpoint";

absl::StatusOr<c10::ScalarType> ParseDtype(const std::string& name) {
  for (int i = 0; i < static_cast<int>(c10::ScalarType::NumOptions); ++i) {
    const auto type = static_cast<c10::ScalarType>(i);
    if (name != c10::toString(type)) continue;
    // Sizes are computed from it before any file is read: a type without
    // an element size (the sub-byte ones) cannot be a checkpoint's.
    try {
      if (c10::elementSize(type) > 0) return type;
    } catch (const c10::Error&) {
    }
    break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", name, "' (expected a ScalarType with an element size)"));
}

// One line split into words, with errors that name the manifest and line.
class Line {
 public:
  Line(const std::string& source, int number, absl::string_view text)
      : source_(source), number_(number), words_(absl::StrSplit(text, ' ', absl::SkipEmpty())) {}

  size_t size() const { return words_.size(); }
  const std::string& word(size_t i) const { return words_[i]; }

  absl::Status Error(absl::string_view what) const {
    return absl::DataLossError(absl::StrCat("manifest ", source_, " line ", number_, ": ", what));
  }

  // Expects words_[i] == label and returns words_[i + 1].
  absl::StatusOr<std::string> Field(size_t i, absl::string_view label) const {
    if (i + 1 >= words_.size() || words_[i] != label) {
      return Error(absl::StrCat("expected '", label, " <value>'"));
    }
    return words_[i + 1];
  }

  absl::StatusOr<int64_t> IntField(size_t i, absl::string_view label) const {
    auto text = Field(i, label);
    if (!text.ok()) return text.status();
    int64_t v;
    if (!absl::SimpleAtoi(*text, &v)) {
      return Error(absl::StrCat(label, " '", *text, "' is not an integer"));
    }
    return v;
  }

  absl::StatusOr<uint32_t> CrcField(size_t i) const {
    auto text = Field(i, "crc32c");
    if (!text.ok()) return text.status();
    uint32_t v;
    if (!absl::SimpleHexAtoi(*text, &v)) {
      return Error(absl::StrCat("crc32c '", *text, "' is not hexadecimal"));
    }
    return v;
  }

 private:
  const std::string& source_;
  int number_;
  std::vector<std::string> words_;
};

}  // namespace

const char* CheckpointKindName(CheckpointKind kind) {
  return kind == CheckpointKind::kFull ? "full" : "sharded";
}

std::string FormatManifest(const Manifest& m) {
  std::string out =
      absl::StrCat(kMagic, " ", m.format_version, "\nkind ", CheckpointKindName(m.kind), "\nstep ",
                   m.step, "\nworld_size ", m.world_size, "\n");
  for (const ManifestFile& f : m.files) {
    absl::StrAppend(&out, "file ", f.name, " rank ", f.rank, " bytes ", f.bytes, " crc32c ",
                    absl::Hex(f.crc32c, absl::kZeroPad8), " tensors ", f.tensors.size(), "\n");
    for (const ManifestTensor& t : f.tensors) {
      absl::StrAppend(&out, "tensor ", t.key, " name ", t.name, " dtype ", c10::toString(t.dtype),
                      " shape ", t.global_shape.empty() ? "-" : absl::StrJoin(t.global_shape, ","),
                      " offset ", t.range.offset, " numel ", t.range.numel, " crc32c ",
                      absl::Hex(t.crc32c, absl::kZeroPad8), "\n");
    }
  }
  if (m.format_version >= 2) {
    const uint32_t crc = formats::Crc32c(out.data(), out.size());
    absl::StrAppend(&out, "end crc32c ", absl::Hex(crc, absl::kZeroPad8), "\n");
  } else {
    out += "end\n";
  }
  return out;
}

namespace {

// ParseManifest's file and tensor lines (lines[4] on): each "file" line
// followed by the "tensor" lines it announces.
absl::Status ParseManifestFiles(const std::vector<absl::string_view>& lines,
                                const std::string& source, Manifest& m) {
  size_t remaining_tensors = 0;
  for (size_t i = 4; i < lines.size(); ++i) {
    Line line(source, static_cast<int>(i + 1), lines[i]);
    if (line.size() == 0) return line.Error("empty line");
    if (line.word(0) == "file") {
      if (remaining_tensors != 0) return line.Error("previous file lists too few tensors");
      ManifestFile f;
      int64_t rank, bytes, count;
      STATE_DICT_ASSIGN_OR_RETURN(f.name, line.Field(0, "file"));
      STATE_DICT_ASSIGN_OR_RETURN(rank, line.IntField(2, "rank"));
      STATE_DICT_ASSIGN_OR_RETURN(bytes, line.IntField(4, "bytes"));
      STATE_DICT_ASSIGN_OR_RETURN(f.crc32c, line.CrcField(6));
      STATE_DICT_ASSIGN_OR_RETURN(count, line.IntField(8, "tensors"));
      if (rank < 0 || bytes < 0 || count < 0) return line.Error("negative field");
      f.rank = static_cast<int>(rank);
      f.bytes = static_cast<uint64_t>(bytes);
      remaining_tensors = static_cast<size_t>(count);
      m.files.push_back(std::move(f));
    } else if (line.word(0) == "tensor") {
      if (m.files.empty() || remaining_tensors == 0) {
        return line.Error("tensor line outside a file's list");
      }
      --remaining_tensors;
      ManifestTensor t;
      std::string dtype, shape;
      STATE_DICT_ASSIGN_OR_RETURN(t.key, line.Field(0, "tensor"));
      STATE_DICT_ASSIGN_OR_RETURN(t.name, line.Field(2, "name"));
      STATE_DICT_ASSIGN_OR_RETURN(dtype, line.Field(4, "dtype"));
      auto parsed = ParseDtype(dtype);
      if (!parsed.ok()) return line.Error(parsed.status().message());
      t.dtype = *parsed;
      STATE_DICT_ASSIGN_OR_RETURN(shape, line.Field(6, "shape"));
      if (shape != "-") {
        for (absl::string_view dim : absl::StrSplit(shape, ',')) {
          int64_t d;
          if (!absl::SimpleAtoi(dim, &d) || d < 0) {
            return line.Error(absl::StrCat("bad shape '", shape, "'"));
          }
          t.global_shape.push_back(d);
        }
      }
      STATE_DICT_ASSIGN_OR_RETURN(t.range.offset, line.IntField(8, "offset"));
      STATE_DICT_ASSIGN_OR_RETURN(t.range.numel, line.IntField(10, "numel"));
      STATE_DICT_ASSIGN_OR_RETURN(t.crc32c, line.CrcField(12));
      m.files.back().tensors.push_back(std::move(t));
    } else {
      return line.Error(absl::StrCat("unknown entry '", line.word(0), "'"));
    }
  }
  if (remaining_tensors != 0) {
    return absl::DataLossError(
        absl::StrCat("manifest ", source, ": last file lists too few tensors"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Manifest> ParseManifest(const std::string& text, const std::string& source) {
  std::vector<absl::string_view> lines = absl::StrSplit(text, '\n');
  // A complete manifest ends with "end\n" or "end crc32c <hex>\n" (so the
  // split's last piece is "").
  if (lines.size() < 2 || lines.back() != "" ||
      !(lines[lines.size() - 2] == "end" || absl::StartsWith(lines[lines.size() - 2], "end "))) {
    return absl::DataLossError(
        absl::StrCat("manifest ", source, " is incomplete (no final 'end' line)"));
  }
  const absl::string_view end_line = lines[lines.size() - 2];
  const size_t covered = text.size() - end_line.size() - 1;  // bytes before "end"
  lines.resize(lines.size() - 2);
  Manifest m;
  if (lines.size() < 4) {
    return absl::DataLossError(absl::StrCat("manifest ", source, " is too short"));
  }
  {
    Line header(source, 1, lines[0]);
    int64_t version;
    STATE_DICT_ASSIGN_OR_RETURN(version, header.IntField(0, kMagic));
    if (version > kCheckpointFormatVersion) {
      return absl::FailedPreconditionError(
          absl::StrCat("manifest ", source, " has format version ", version,
                       ", newer than this build reads (up to ", kCheckpointFormatVersion,
                       "); use a newer build"));
    }
    if (version < 1) return header.Error("format version must be >= 1");
    m.format_version = static_cast<int>(version);
  }
  {
    // Checked before any other field is believed.
    Line end(source, static_cast<int>(lines.size() + 1), end_line);
    if (m.format_version == 1) {
      if (end_line != "end") return end.Error("expected 'end' (format version 1)");
    } else {
      if (end.size() != 3 || end.word(0) != "end") {
        return end.Error("expected 'end crc32c <8 hex digits>'");
      }
      uint32_t recorded;
      STATE_DICT_ASSIGN_OR_RETURN(recorded, end.CrcField(1));
      const uint32_t actual = formats::Crc32c(text.data(), covered);
      if (actual != recorded) {
        return absl::DataLossError(absl::StrCat(
            "manifest ", source, " is damaged: its ", covered,
            " bytes before the 'end' line have "
            "crc32c ",
            absl::Hex(actual, absl::kZeroPad8), ", the manifest records ",
            absl::Hex(recorded, absl::kZeroPad8), " (edited or corrupted after it was written)"));
      }
    }
  }
  {
    Line line(source, 2, lines[1]);
    std::string kind;
    STATE_DICT_ASSIGN_OR_RETURN(kind, line.Field(0, "kind"));
    if (kind == "full") {
      m.kind = CheckpointKind::kFull;
    } else if (kind == "sharded") {
      m.kind = CheckpointKind::kSharded;
    } else {
      return line.Error(absl::StrCat("unknown kind '", kind, "'"));
    }
  }
  STATE_DICT_ASSIGN_OR_RETURN(m.step, Line(source, 3, lines[2]).IntField(0, "step"));
  {
    Line line(source, 4, lines[3]);
    int64_t world;
    STATE_DICT_ASSIGN_OR_RETURN(world, line.IntField(0, "world_size"));
    if (world < 1) return line.Error("world_size must be >= 1");
    m.world_size = static_cast<int>(world);
  }
  if (auto s = ParseManifestFiles(lines, source, m); !s.ok()) return s;
  return m;
}

}  // namespace state_dict
