// Checkpoint format of DrafterCore: a versioned little-endian binary dump of the sequences and
// of every shared chain index's insertion log (the chains are rebuilt on load by re-indexing the
// logged positions in that order, which reproduces them exactly; a request's own index is
// rebuilt from its tokens).
#include <algorithm>
#include <cstdio>
#include <istream>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "checksum.h"
#include "drafter_core.h"
#include "race_noise.h"

namespace rollout_spec {

namespace {
// "RSSPADR6": one log per index, positions indexed once their next token exists (version 3 had
// one log per key length and also indexed each sequence's last position); version 5 added the
// requests' noise keys to version 4, and version 6 drops the requests' match states (occurrences
// kept between proposals, no longer kept) and own indexes' logs (a request's own index holds its
// positions in order, so it is rebuilt from its tokens); version 7 appends a checksum of every
// byte before it (checksum.h). Versions 4 to 6 are still read, unchecked: the requests' logs of
// 4 and 5 are checked and their match states skipped; version 4's have no noise keys.
constexpr uint64_t kMagic = 0x3752444150535352ULL;
constexpr char kVersion = '7', kOldestVersion = '4', kFirstSummed = '7';

// A version byte as an error message may show it: the character when printable ASCII, else its
// value (a damaged byte of 0x80 or more would make the message invalid UTF-8 for Python).
std::string version_name(char version) {
  const auto byte = static_cast<unsigned char>(version);
  if (byte > 0x20 && byte < 0x7F) return std::string(1, version);
  char hex[16];
  std::snprintf(hex, sizeof hex, "byte 0x%02X", byte);
  return hex;
}

template <class T>
void put(std::ostream& os, const T& v) { os.write(reinterpret_cast<const char*>(&v), sizeof(T)); }

template <class T>
T get(std::istream& is) {
  T v{};
  if (!is.read(reinterpret_cast<char*>(&v), sizeof(T))) throw std::runtime_error("drafter checkpoint is truncated");
  return v;
}

template <class T, class A>
void put_vec(std::ostream& os, const std::vector<T, A>& v) {
  put<uint64_t>(os, v.size());
  os.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
}

// A count read from the file, refused unless `n` items of `bytes_each` fit in the file's
// `size` bytes: a corrupt count must not allocate gigabytes before the read fails.
uint64_t get_count(std::istream& is, uint64_t bytes_each, uint64_t size) {
  const uint64_t n = get<uint64_t>(is);
  if (n > size / bytes_each) throw std::runtime_error("drafter checkpoint is corrupt (a count exceeds the file)");
  return n;
}

template <class T>
std::vector<T> get_vec(std::istream& is, uint64_t size) {
  std::vector<T> v(get_count(is, sizeof(T), size));
  const uint64_t n = v.size();
  if (!is.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(T))))
    throw std::runtime_error("drafter checkpoint is truncated");
  return v;
}

void put_index(std::ostream& os, const ChainIndex& index) { put_vec(os, index.log()); }

// A version 4 or 5 request's own index log: it must list the positions with a next token, in order.
void check_own_log(std::istream& is, uint64_t size, int32_t slot, const Sequence& s) {
  const std::vector<ChainRecord> log = get_vec<ChainRecord>(is, size);
  if (log.size() != static_cast<size_t>(s.positions_with_next()))
    throw std::runtime_error("drafter checkpoint is corrupt (request index out of range)");
  for (size_t p = 0; p < log.size(); ++p)
    if (log[p].seq != slot || log[p].pos != static_cast<int32_t>(p))
      throw std::runtime_error("drafter checkpoint is corrupt (request index out of order)");
}

void get_index(std::istream& is, uint64_t size, ChainIndex& index, const std::vector<Sequence>& seqs) {
  std::vector<ChainRecord> log = get_vec<ChainRecord>(is, size);
  for (const ChainRecord& r : log)
    // In 64 bits: a damaged pos of 2**31-1 would wrap pos + 1 below the bound and be read.
    if (r.seq < 0 || r.seq >= static_cast<int32_t>(seqs.size()) || r.pos < 0 ||
        int64_t{r.pos} + 1 >= static_cast<int64_t>(seqs[r.seq].tokens.size()))
      throw std::runtime_error("drafter checkpoint is corrupt (record out of range)");
  index.restore(log, [&](int32_t seq) { return seqs[seq].tokens.data(); });
}

// What precedes the state: the size of the file without its checksum (every count is checked
// against it), the format version and the caller's meta string.
struct Header {
  uint64_t size;
  char version;
  std::string meta;
};

// Reads the first `payload` bytes and the checksum after them; throws unless they agree.
// Leaves the stream just after the magic.
void check_checksum(std::istream& is, uint64_t payload) {
  Checksum sum;
  std::vector<char> chunk(1 << 20);
  is.seekg(0, std::ios::beg);
  for (uint64_t left = payload; left > 0;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(left, chunk.size()));
    if (!is.read(chunk.data(), static_cast<std::streamsize>(n))) throw std::runtime_error("drafter checkpoint is truncated");
    sum.update(chunk.data(), n);
    left -= n;
  }
  if (get<uint64_t>(is) != sum.digest())
    throw std::runtime_error("drafter checkpoint is corrupt (its checksum does not match its contents: "
                             "damaged or truncated)");
  is.clear();
  is.seekg(sizeof(uint64_t), std::ios::beg);
}

// `verify`: check the checksum of a version that has one (load does; read_meta, which load
// follows, need not read the whole file twice).
Header read_header(std::istream& is, bool verify) {
  is.seekg(0, std::ios::end);
  const std::streamoff end = is.tellg();
  is.seekg(0, std::ios::beg);
  if (end < 0 || !is) throw std::runtime_error("drafter checkpoint: the file cannot be sized");
  const uint64_t size = static_cast<uint64_t>(end);
  const uint64_t magic = get<uint64_t>(is);
  // The low 7 bytes spell "RSSPADR", the top byte the format version.
  if ((magic & 0x00FFFFFFFFFFFFFFULL) != (kMagic & 0x00FFFFFFFFFFFFFFULL))
    throw std::runtime_error("not a rollout-spec drafter checkpoint");
  const char version = static_cast<char>(magic >> 56);
  if (version < kOldestVersion || version > kVersion)
    throw std::runtime_error("drafter checkpoint of another format version (" + version_name(version) +
                             ", this build reads " + std::string(1, kOldestVersion) + " to " +
                             std::string(1, kVersion) + ")");
  uint64_t payload = size;
  if (version >= kFirstSummed) {
    if (size < 2 * sizeof(uint64_t)) throw std::runtime_error("drafter checkpoint is truncated");
    payload = size - sizeof(uint64_t);
    if (verify) check_checksum(is, payload);
  }
  const std::vector<char> meta = get_vec<char>(is, payload);
  return Header{payload, version, std::string(meta.begin(), meta.end())};
}
}  // namespace

void DrafterCore::save(std::ostream& out, const std::string& meta) const {
  auto lock = lock_idle();
  ChecksumWriter summed(out.rdbuf());
  std::ostream os(&summed);
  put(os, kMagic);
  put_vec(os, std::vector<char>(meta.begin(), meta.end()));
  put(os, step_);
  put(os, next_order_);
  put(os, evictions_);
  put(os, noise_q_);
  put<uint64_t>(os, seqs_.size());
  for (const Sequence& s : seqs_) {
    put_vec(os, s.tokens);
    put(os, s.req_id);
    put(os, s.group);
    put(os, s.prompt_len);
    put(os, s.step);
    put(os, s.order);
    put<uint8_t>(os, static_cast<uint8_t>(s.live | (s.alive << 1) | (s.pinned << 2)));
  }
  put_vec(os, free_slots_);
  put<uint64_t>(os, requests_.size());
  for (const auto& [id, req] : requests_) {
    put(os, id);
    put(os, req.slot);
    put(os, req.noise_seed);
    put(os, req.noise_temperature);
  }
  put<uint64_t>(os, groups_.size());
  for (const auto& [g, index] : groups_) {
    put(os, g);
    put_index(os, index);
  }
  put_index(os, global_);
  if (!os) throw std::runtime_error("writing the drafter checkpoint failed");
  put(out, summed.digest());
  if (!out) throw std::runtime_error("writing the drafter checkpoint failed");
}

std::string DrafterCore::read_meta(std::istream& is) { return read_header(is, /*verify=*/false).meta; }

std::string DrafterCore::load(std::istream& is) {
  auto lock = lock_to_change([] {});
  const Header header = read_header(is, /*verify=*/true);
  const uint64_t size = header.size;
  // Versions 4 and 5 also hold each request's own index log and match state.
  const bool has_noise = header.version >= '5', has_request_logs = header.version <= '5';
  step_ = get<int64_t>(is);
  next_order_ = get<uint64_t>(is);
  evictions_ = get<int64_t>(is);
  noise_q_ = has_noise ? get<uint32_t>(is) : 0;
  // A sequence takes at least its token count and fixed fields: 8 + 8 + 4 + 4 + 8 + 8 + 1 bytes.
  seqs_.assign(get_count(is, 41, size), Sequence{});
  stored_tokens_ = 0;
  for (Sequence& s : seqs_) {
    const std::vector<int32_t> tokens = get_vec<int32_t>(is, size);
    if (std::any_of(tokens.begin(), tokens.end(), [](int32_t t) { return t < 0; }))
      throw std::runtime_error("drafter checkpoint is corrupt (negative token id)");
    s.tokens.assign(tokens.begin(), tokens.end());
    s.req_id = get<int64_t>(is);
    s.group = get<int32_t>(is);
    s.prompt_len = get<int32_t>(is);
    s.step = get<int64_t>(is);
    s.order = get<uint64_t>(is);
    uint8_t flags = get<uint8_t>(is);
    s.live = flags & 1;
    s.alive = flags & 2;
    s.pinned = flags & 4;
    stored_tokens_ += static_cast<int64_t>(s.tokens.size());
  }
  free_slots_ = get_vec<int32_t>(is, size);  // checked with the rest at the end
  refresh_all_views();
  requests_.clear();
  for (uint64_t n = get<uint64_t>(is); n > 0; --n) {
    int64_t id = get<int64_t>(is);
    RequestState& req = requests_[id];
    req.own = RequestIndex(kRequestKeys);
    req.slot = get<int32_t>(is);
    if (req.slot < 0 || req.slot >= static_cast<int32_t>(seqs_.size()))
      throw std::runtime_error("drafter checkpoint is corrupt (request slot out of range)");
    const Sequence& s = seqs_[req.slot];
    if (has_request_logs) check_own_log(is, size, req.slot, s);
    req.own.reserve_positions(static_cast<size_t>(s.positions_with_next()));
    req.own.insert_up_to(s.tokens.data(), s.positions_with_next());
    if (has_request_logs) {  // the match state, skipped: occurrences, tokens since, a valid flag
      get_vec<Occurrence>(is, size);
      get<int32_t>(is);
      get<uint8_t>(is);
    }
    req.noise_seed = has_noise ? get<int64_t>(is) : -1;
    req.noise_temperature = has_noise ? get<double>(is) : 1.0;
    if (req.noise_seed < -1 || !(req.noise_temperature > 0.0 && req.noise_temperature <= 1e6) ||
        (req.noise_seed >= 0 && (noise_q_ < 1 || noise_q_ > kMaxNoiseQ)))
      throw std::runtime_error("drafter checkpoint is corrupt (noise key)");
  }
  groups_.clear();
  for (uint64_t n = get<uint64_t>(is); n > 0; --n) {
    int32_t g = get<int32_t>(is);
    get_index(is, size, group_index(g), seqs_);
  }
  global_ = empty_global_index(cfg_);
  get_index(is, size, global_, seqs_);
  // The state ends where the file does (format 7: where its checksum starts). A format-7 file
  // whose version byte was damaged into an older, unsummed one would otherwise be read without
  // its checksum, the 8 bytes of it left over.
  const std::streamoff end = is.tellg();
  if (end < 0 || static_cast<uint64_t>(end) != size)
    throw std::runtime_error("drafter checkpoint is corrupt (bytes after its state)");
  // Checkpoints written before session 74 may keep finished sequences without tokens, which are
  // freed at once now (nothing refers to them: they have no positions to index).
  for (int32_t slot = 0; slot < static_cast<int32_t>(seqs_.size()); ++slot)
    if (seqs_[slot].alive) release_if_empty(slot);
  // Fields that decode but disagree (a flag, a group, a slot shared by two requests) would make
  // later calls read out of bounds: the whole state is checked before it is used.
  const std::string problem = integrity_problem();
  if (!problem.empty()) throw std::runtime_error("drafter checkpoint is corrupt (" + problem + ")");
  return header.meta;
}

}  // namespace rollout_spec
