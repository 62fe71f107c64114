// The key lengths (bits of kAllKeys, for kKeyLens = {4, 2, 1}) that each scope's index keeps.
// A lookup skips a key length its scope does not keep; every figure below is replay TPF on the
// shared traces (T=0.6 steps 0/1/2, T=1.0 steps 0/1; docs/drafter.md).
#pragma once

#include <cstdint>

#include "chain_index.h"

namespace rollout_spec {

// A request's own index: 4 and 1. A 1-gram record's match is measured backwards, so within one
// request's text the 2-gram chain found nothing the 1-gram chain did not (TPF equal to the third
// decimal without it), while it cost a third of the request scope's inserts (prompts included).
// The 4-gram chain stays: it reaches a copied span anywhere in a long prompt, where the last
// token's 16 newest records do not (a code-edit trace lost 18% TPF with the 1-gram key alone).
constexpr uint32_t kRequestKeys = 0b101u;

// A group's index: 4 and 1, for the same reason: without its 2-gram chains TPF moved by at most
// 0.2% (2.763 / 3.038 / 3.129 and 1.501 / 1.561), and each position costs one insert less and
// the groups' 2-gram tables (a sixth of all index memory at T=1.0) are gone.
constexpr uint32_t kGroupKeys = 0b101u;

// The global index: 2 and 1. Its 4-gram chains held one record per position of every rollout
// (at T=1.0 nine in ten 4-grams are new, each a 32-byte head in a half-empty table: 32 MB of
// 145 MB after both steps), while the 2-gram chains, whose longer matches are measured
// backwards, find most of what they found: TPF 2.761 / 3.030 / 3.115 and 1.500 / 1.558, against
// 2.763 / 3.038 / 3.129 and 1.501 / 1.561 with them. Without the 2-gram chains instead (and every
// group key kept), T=1.0 falls to 1.498 / 1.554, and without the 1-gram chains to 1.429 / 1.493.
constexpr uint32_t kGlobalKeys = 0b110u;

}  // namespace rollout_spec
