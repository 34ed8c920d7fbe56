// The wire facts C++ needs, in one place: codec tags (dataplane/codec.py), torch value
// codes (torch_wire/values.py), message types (dataplane/wire.py), the writer the
// client's queue (pytorch_ext/csrc/op_serve.cpp) encodes batch items with, and the reader
// the server's executor (server/csrc/batch.cpp) decodes them with, which checks every
// length and type it meets. tests/unit/test_codec_header.py checks the numbers below
// against the Python modules, so the C++ and Python codecs cannot drift apart.
//
// A RunPlanned item is (RUN_PLANNED, (plan id, values)); its values fill the holes of the
// RunOp that defined the plan in that RunOp's wire order (args, then kwargs as encoded,
// then outs): a storage id per tensor reference, the bytes per inline CPU tensor and per
// Scalar argument sent as a value (SCALAR: float64, int64, bool or complex128). The
// client encodes keyword arguments sorted by name, and its C++ queue gathers the tensors
// of a call in that same order (op_plans.cpp, OpInfo::encoding_order).
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace remote_accel::wire {

static_assert(std::endian::native == std::endian::little, "the wire format is little-endian");

// codec tags
constexpr uint8_t kNone = 0x00, kFalse = 0x01, kTrue = 0x02, kInt = 0x03, kFloat = 0x04, kStr = 0x05,
                  kBytes = 0x06, kList = 0x07, kTuple = 0x08, kDict = 0x09, kComplex = 0x0a, kExt = 0x0b,
                  kSmallInt = 0x0c;
constexpr int kSmallBias = 128;
constexpr int kMaxDepth = 64;
constexpr int64_t kMaxItems = int64_t{1} << 22;

// torch_wire/values.py Ext codes
constexpr uint8_t kExtTensor = 1, kExtCpuTensor = 7;

// message types allowed inside a Batch
constexpr int64_t kAlloc = 16, kFree = 17, kWrite = 18, kRun = 32, kRunGraph = 37, kRunPlanned = 38;

// -- writing ---------------------------------------------------------------------------

inline void put_int(std::string& out, int64_t v) {
  if (v >= -kSmallBias && v < kSmallBias) {  // the common case: dims, flags, small ids
    out.push_back(static_cast<char>(kSmallInt));
    out.push_back(static_cast<char>(v + kSmallBias));
  } else {
    out.push_back(static_cast<char>(kInt));
    out.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
}

inline void put_container_header(std::string& out, uint8_t tag, uint32_t n) {
  out.push_back(static_cast<char>(tag));
  out.append(reinterpret_cast<const char*>(&n), sizeof n);
}

inline void put_tuple_header(std::string& out, uint32_t n) { put_container_header(out, kTuple, n); }

inline void put_bytes(std::string& out, const void* data, uint32_t n) {
  put_container_header(out, kBytes, n);
  out.append(static_cast<const char*>(data), n);
}

// -- reading ---------------------------------------------------------------------------

// Malformed input; the message is safe to show the peer.
struct Malformed {
  std::string what;
};

// Reads codec values from bytes it does not trust: each read checks what is left, so
// no length or count from the wire reaches an allocation or an index unchecked.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : p_(data), n_(size) {}

  size_t pos() const { return pos_; }
  void seek(size_t pos) { pos_ = pos; }
  bool at_end() const { return pos_ == n_; }

  uint8_t tag() {
    need(1);
    return p_[pos_++];
  }
  uint8_t peek() const {
    if (pos_ >= n_) throw Malformed{"meta truncated"};
    return p_[pos_];
  }

  // An int (not a bool): codec's one-byte or eight-byte form.
  bool try_int(int64_t& out) {
    const uint8_t t = peek();
    if (t == kSmallInt) {
      need(2);
      out = static_cast<int64_t>(p_[pos_ + 1]) - kSmallBias;
      pos_ += 2;
      return true;
    }
    if (t == kInt) {
      need(9);
      std::memcpy(&out, p_ + pos_ + 1, 8);
      pos_ += 9;
      return true;
    }
    return false;
  }
  int64_t int_value(const char* what) {
    int64_t v;
    if (!try_int(v)) throw Malformed{std::string(what) + ": expected int"};
    return v;
  }

  // A container header of `tag`; its count, checked against the bytes left and the item budget.
  uint32_t container(uint8_t expect, const char* what) {
    if (tag() != expect) throw Malformed{std::string(what)};
    need(4);
    uint32_t n;
    std::memcpy(&n, p_ + pos_, 4);
    pos_ += 4;
    need(n);  // every item takes at least one byte
    count(n);
    return n;
  }

  // Bytes (a bytes value): a view into the input.
  std::string_view bytes_value(const char* what) {
    if (tag() != kBytes) throw Malformed{std::string(what)};
    return sized();
  }

  // Skips one value of any type, checking it as codec.decode would.
  void skip(int depth) {
    if (depth > kMaxDepth) throw Malformed{"meta nested too deeply"};
    const uint8_t t = tag();
    switch (t) {
      case kSmallInt: need(1); pos_ += 1; return;
      case kNone: case kFalse: case kTrue: return;
      case kInt: case kFloat: need(8); pos_ += 8; return;
      case kComplex: need(16); pos_ += 16; return;
      case kBytes: sized(); return;
      case kStr: {
        const auto s = sized();
        if (!valid_utf8(s)) throw Malformed{"meta string is not valid UTF-8"};
        return;
      }
      case kList: case kTuple: case kDict: {
        --pos_;
        const uint32_t n = container(t, "container");
        for (uint32_t i = 0; i < n; ++i) {
          if (t == kDict) {
            if (peek() != kStr) throw Malformed{"meta dict key is not a string"};
            skip(depth + 1);
          }
          skip(depth + 1);
        }
        return;
      }
      case kExt: need(1); pos_ += 1; skip(depth + 1); return;
      default: throw Malformed{"unknown meta tag " + std::to_string(t) + " at offset " + std::to_string(pos_ - 1)};
    }
  }

 private:
  void need(size_t k) const {
    if (k > n_ - pos_) throw Malformed{"meta truncated: need " + std::to_string(k) + " bytes at offset " +
                                       std::to_string(pos_)};
  }
  void count(uint32_t k) {
    items_ += k;
    if (items_ > kMaxItems) throw Malformed{"meta holds too many items"};
  }
  std::string_view sized() {
    need(4);
    uint32_t n;
    std::memcpy(&n, p_ + pos_, 4);
    pos_ += 4;
    need(n);
    std::string_view s(reinterpret_cast<const char*>(p_ + pos_), n);
    pos_ += n;
    return s;
  }
  // As Python's bytes.decode() accepts: no overlongs, no surrogates, nothing past U+10FFFF.
  static bool valid_utf8(std::string_view s) {
    const auto* b = reinterpret_cast<const uint8_t*>(s.data());
    const size_t n = s.size();
    for (size_t i = 0; i < n;) {
      const uint8_t c = b[i];
      if (c < 0x80) { ++i; continue; }
      size_t len;
      uint8_t lo = 0x80, hi = 0xbf;
      if (c >= 0xc2 && c <= 0xdf) len = 2;
      else if (c >= 0xe0 && c <= 0xef) { len = 3; if (c == 0xe0) lo = 0xa0; if (c == 0xed) hi = 0x9f; }
      else if (c >= 0xf0 && c <= 0xf4) { len = 4; if (c == 0xf0) lo = 0x90; if (c == 0xf4) hi = 0x8f; }
      else return false;
      if (n - i < len || b[i + 1] < lo || b[i + 1] > hi) return false;
      for (size_t k = 2; k < len; ++k) {
        if (b[i + k] < 0x80 || b[i + k] > 0xbf) return false;
      }
      i += len;
    }
    return true;
  }

  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
  int64_t items_ = 0;
};

}  // namespace remote_accel::wire
