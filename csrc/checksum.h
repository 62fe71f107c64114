// A 64-bit checksum of a checkpoint's bytes, and a stream buffer that computes it while the
// checkpoint is written. Not cryptographic: it catches files damaged on disk or in transfer,
// which the format's own checks cannot all see (a flipped token id decodes as another token).
#pragma once

#include <cstdint>
#include <cstring>
#include <streambuf>

namespace rollout_spec {

// The bytes are taken eight at a time (little-endian words, the last one zero-padded) and each
// word is folded into the state by a bijection, so two inputs that differ in one word always
// differ in the digest; the length is folded in last. The digest does not depend on how the
// bytes are split into update calls.
class Checksum {
 public:
  void update(const char* data, size_t n) {
    length_ += n;
    while (n > 0) {
      if (pending_bytes_ == 0 && n >= 8) {
        uint64_t word;
        std::memcpy(&word, data, 8);
        mix(word);
        data += 8;
        n -= 8;
        continue;
      }
      pending_ |= static_cast<uint64_t>(static_cast<unsigned char>(*data)) << (8 * pending_bytes_);
      ++data;
      --n;
      if (++pending_bytes_ == 8) {
        mix(pending_);
        pending_ = 0;
        pending_bytes_ = 0;
      }
    }
  }

  uint64_t digest() const {
    Checksum end = *this;
    if (end.pending_bytes_ > 0) end.mix(end.pending_);
    end.mix(length_);
    return end.state_;
  }

 private:
  void mix(uint64_t word) {
    state_ = (state_ ^ word) * 0xFF51AFD7ED558CCDULL;
    state_ ^= state_ >> 29;
  }

  uint64_t state_ = 0x9E3779B97F4A7C15ULL;
  uint64_t pending_ = 0;
  int pending_bytes_ = 0;
  uint64_t length_ = 0;
};

// Passes everything written through to `target`, checksumming it on the way.
class ChecksumWriter : public std::streambuf {
 public:
  explicit ChecksumWriter(std::streambuf* target) : target_(target) {}
  uint64_t digest() const { return sum_.digest(); }

 protected:
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    const std::streamsize written = target_->sputn(s, n);
    sum_.update(s, static_cast<size_t>(written));
    return written;
  }
  int_type overflow(int_type c) override {
    if (traits_type::eq_int_type(c, traits_type::eof())) return traits_type::not_eof(c);
    const char ch = traits_type::to_char_type(c);
    return xsputn(&ch, 1) == 1 ? c : traits_type::eof();
  }
  int sync() override { return target_->pubsync(); }

 private:
  std::streambuf* target_;
  Checksum sum_;
};

}  // namespace rollout_spec
