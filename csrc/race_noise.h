// The verifier's keyed sampling noise on the host (rollout_spec/noise.py gives the law and the
// column layout; the Triton walk kernel draws the same bits on the GPU). The torch version of
// Philox took 0.35 s for a 64-row race on two cores; this loop takes a few milliseconds.
#pragma once

#include <cstddef>
#include <cstdint>

namespace rollout_spec {

constexpr uint32_t kRaceTag = 0x5EED0C0Fu;  // noise.NOISE_TAG
// The largest quarter block q the column layout takes: its blocks of 4q columns fit in 32 bits.
constexpr uint32_t kMaxNoiseQ = uint32_t(1) << 29;

// Fill out[a * vocab + v] (num_rows rows) with the uniform in (0, 1) of column v of the row keyed
// (seeds[a], positions[a]): word (v mod 4q) / q of Philox-4x32-10 at counter
// (v / 4q * q + v mod q, pos_lo, pos_hi, tag) under key (seed_lo, seed_hi), its 31 bits x as
// triton's uint_to_uniform_float takes them, as (x + 1/2) 2^-31 (the kernel's _uniform).
void race_uniforms(const int64_t* seeds, const int64_t* positions, size_t num_rows, size_t vocab,
                   size_t q, uint32_t tag, float* out);

// The uniform of one column of one such row: race_uniforms' out[v] for the row keyed (seed,
// position). The drafter reads it for the few tokens it may propose at a place (draft_builder.h).
float race_uniform(int64_t seed, int64_t position, int32_t column, uint32_t q, uint32_t tag);

}  // namespace rollout_spec
