#include "race_noise.h"

namespace rollout_spec {
namespace {

struct Words {
  uint32_t w[4];
};

// Philox-4x32-10, the rounds of triton's philox_impl.
Words philox(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    const uint64_t pb = static_cast<uint64_t>(0xCD9E8D57u) * c2;
    const uint64_t pa = static_cast<uint64_t>(0xD2511F53u) * c0;
    const uint32_t n0 = static_cast<uint32_t>(pb >> 32) ^ c1 ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(pa >> 32) ^ c3 ^ k1;
    c0 = n0;
    c1 = static_cast<uint32_t>(pb);
    c2 = n2;
    c3 = static_cast<uint32_t>(pa);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Words{{c0, c1, c2, c3}};
}

// A 32-bit word as a uniform in (0, 1): the word as int32, negatives folded onto ~x (31 bits, as
// triton's uint_to_uniform_float), at the middle of its cell, times a scale just below 2^-31
// (float operations, as the kernel's). The race's exponential is -log1p(-u), which needs u fine
// near 0, where it is: float32's spacing near 1 (2^-24) would leave the exponential's smallest
// values, the ones that let a token far below the best win, half their probability or none.
float to_uniform(uint32_t word) {
  int32_t x = static_cast<int32_t>(word);
  if (x < 0) x = ~x;
  return (static_cast<float>(x) + 0.5f) * 4.6566127342e-10f;
}

}  // namespace

void race_uniforms(const int64_t* seeds, const int64_t* positions, size_t num_rows, size_t vocab,
                   size_t q, uint32_t tag, float* out) {
  for (size_t a = 0; a < num_rows; ++a) {
    const uint64_t seed = static_cast<uint64_t>(seeds[a]), pos = static_cast<uint64_t>(positions[a]);
    const uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    const uint32_t p0 = static_cast<uint32_t>(pos), p1 = static_cast<uint32_t>(pos >> 32);
    float* row = out + a * vocab;
    for (size_t start = 0; start < vocab; start += 4 * q) {
      for (size_t i = 0; i < q; ++i) {
        const Words r = philox(static_cast<uint32_t>(start / 4 + i), p0, p1, tag, k0, k1);
        for (size_t w = 0; w < 4; ++w) {
          const size_t v = start + w * q + i;
          if (v < vocab) row[v] = to_uniform(r.w[w]);
        }
      }
    }
  }
}

float race_uniform(int64_t seed, int64_t position, int32_t column, uint32_t q, uint32_t tag) {
  const uint64_t sd = static_cast<uint64_t>(seed), pos = static_cast<uint64_t>(position);
  const uint32_t v = static_cast<uint32_t>(column), in_block = v % (4 * q);
  const uint32_t counter = (v - in_block) / 4 + in_block % q;
  const Words r = philox(counter, static_cast<uint32_t>(pos), static_cast<uint32_t>(pos >> 32), tag,
                         static_cast<uint32_t>(sd), static_cast<uint32_t>(sd >> 32));
  return to_uniform(r.w[in_block / q]);
}

}  // namespace rollout_spec
