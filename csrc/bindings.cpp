// The only file that knows Python: a thin nanobind layer over rollout_spec::DrafterCore and the
// tree-inputs build.
// Arrays come in as contiguous numpy arrays of fixed dtypes (the facade converts and validates);
// every batch call releases the GIL while the core works.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <fstream>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core_config.h"
#include "drafter_core.h"
#include "race_noise.h"
#include "tree_inputs.h"

namespace nb = nanobind;
using namespace nb::literals;
using rollout_spec::CoreConfig;
using rollout_spec::DrafterCore;
using rollout_spec::DraftOutput;
using rollout_spec::TreeInputsBuffers;

namespace {

template <class T>
using Vec = nb::ndarray<const T, nb::numpy, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// CSR shape check shared by start/extend/add_sequences.
void check_csr(size_t n, const Vec<int32_t>& tokens, const Vec<int64_t>& offsets) {
  if (offsets.shape(0) != n + 1) throw std::invalid_argument("offsets must have len(ids) + 1 entries");
  const int64_t* o = offsets.data();
  if (o[0] != 0 || o[n] != static_cast<int64_t>(tokens.shape(0)))
    throw std::invalid_argument("offsets must start at 0 and end at len(tokens)");
  for (size_t i = 0; i < n; ++i)
    if (o[i + 1] < o[i]) throw std::invalid_argument("offsets must be non-decreasing");
  const int32_t* t = tokens.data();
  for (size_t i = 0; i < tokens.shape(0); ++i)
    if (t[i] < 0) throw std::invalid_argument("token ids must be >= 0");
}

template <class T>
nb::ndarray<nb::numpy, T, nb::ndim<1>> to_numpy(std::vector<T>&& v) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<1>>(heap->data(), {heap->size()}, owner);
}

// A Python list of Python ints, each in [lo, hi], into `out`; false (out unspecified) for
// anything else: other types (numpy arrays, bools, floats) and out-of-range values take the
// facade's validating path, which raises the precise error.
template <class T>
bool int_list(PyObject* obj, int64_t lo, int64_t hi, std::vector<T>& out) {
  if (!PyList_CheckExact(obj)) return false;
  const Py_ssize_t n = PyList_GET_SIZE(obj);
  out.resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* v = PyList_GET_ITEM(obj, i);
    if (!PyLong_CheckExact(v)) return false;
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || x < lo || x > hi) return false;
    out[static_cast<size_t>(i)] = static_cast<T>(x);
  }
  return true;
}

nb::tuple propose_output(DraftOutput&& out) {
  return nb::make_tuple(to_numpy(std::move(out.offsets)), to_numpy(std::move(out.tokens)),
                        to_numpy(std::move(out.parents)), to_numpy(std::move(out.probs)));
}

// propose's list inputs: ids and budgets (None: budgets left empty) as lists of in-range Python
// ints of one length; false, with the vectors in any state, when they are anything else.
bool propose_list_args(nb::handle ids_obj, nb::handle budgets_obj, std::vector<int64_t>& ids,
                       std::vector<int32_t>& budgets, bool& have_budgets) {
  if (!int_list(ids_obj.ptr(), 0, INT64_MAX, ids)) return false;
  have_budgets = !budgets_obj.is_none();
  return !have_budgets || (int_list(budgets_obj.ptr(), 0, int64_t(1) << 20, budgets) &&
                           budgets.size() == ids.size());
}

// propose's array inputs: budgets, if given, one per id.
void check_budgets(const Vec<int64_t>& ids, const std::optional<Vec<int32_t>>& budgets) {
  if (budgets && budgets->shape(0) != ids.shape(0))
    throw std::invalid_argument("budgets must have len(req_ids) entries");
}

// propose's fast path for the decode loop's input: ids (and budgets, or None) as lists of
// Python ints, converted here instead of through numpy (about 40 us per call of 512 requests).
// Returns None, with nothing changed, when they are anything else; repeated and unknown ids
// are the core's errors either way.
nb::object propose_lists(DrafterCore& core, nb::handle ids_obj, nb::handle budgets_obj) {
  thread_local std::vector<int64_t> ids;
  thread_local std::vector<int32_t> budgets;
  bool have_budgets = false;
  if (!propose_list_args(ids_obj, budgets_obj, ids, budgets, have_budgets)) return nb::none();
  DraftOutput out;
  {
    nb::gil_scoped_release release;
    core.propose(ids.data(), have_budgets ? budgets.data() : nullptr, ids.size(), out);
  }
  return propose_output(std::move(out));
}

// propose_ahead for the same inputs as propose_lists; false, with nothing queued, when they are
// anything else (the facade then validates them and calls propose_ahead with arrays).
bool propose_ahead_lists(DrafterCore& core, nb::handle ids_obj, nb::handle budgets_obj) {
  std::vector<int64_t> ids;
  std::vector<int32_t> budgets;
  bool have_budgets = false;
  if (!propose_list_args(ids_obj, budgets_obj, ids, budgets, have_budgets)) return false;
  nb::gil_scoped_release release;
  core.propose_ahead(ids.data(), have_budgets ? budgets.data() : nullptr, ids.size());
  return true;
}

// extend's fast path for the usual input, a Python list of Python lists of ints: flattened here
// without building numpy arrays. Returns false, with nothing changed, for anything else (other
// types, bools, out-of-range values, a length mismatch); the facade then takes its validating path,
// which raises the precise error.
// The core's extend, or with `background` its extend_in_background (GIL released either way).
void run_extend(DrafterCore& core, const int64_t* ids, const int32_t* tokens,
                const int64_t* offsets, size_t n, bool background) {
  nb::gil_scoped_release release;
  if (background) core.extend_in_background(ids, tokens, offsets, n);
  else core.extend(ids, tokens, offsets, n);
}

bool extend_flat(DrafterCore& core, const int64_t* ids, size_t n, nb::handle lists, bool background) {
  PyObject* outer = lists.ptr();
  if (!PyList_CheckExact(outer) || static_cast<size_t>(PyList_GET_SIZE(outer)) != n) return false;
  std::vector<int64_t> offsets(n + 1, 0);
  std::vector<int32_t> tokens;
  for (size_t i = 0; i < n; ++i) {
    PyObject* part = PyList_GET_ITEM(outer, i);
    if (!PyList_CheckExact(part)) return false;
    const Py_ssize_t m = PyList_GET_SIZE(part);
    for (Py_ssize_t j = 0; j < m; ++j) {
      PyObject* t = PyList_GET_ITEM(part, j);
      if (!PyLong_CheckExact(t)) return false;  // bools and numpy scalars take the slow path
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(t, &overflow);
      if (overflow || v < 0 || v > INT32_MAX) return false;
      tokens.push_back(static_cast<int32_t>(v));
    }
    offsets[i + 1] = static_cast<int64_t>(tokens.size());
  }
  run_extend(core, ids, tokens.data(), offsets.data(), n, background);
  return true;
}

bool extend_lists(DrafterCore& core, Vec<int64_t> ids, nb::handle lists, bool background) {
  return extend_flat(core, ids.data(), ids.shape(0), lists, background);
}

// The same with the ids as a list of Python ints too (the decode loop's form): false, with
// nothing changed, when they are anything else.
bool extend_pylists(DrafterCore& core, nb::handle ids_obj, nb::handle lists, bool background) {
  thread_local std::vector<int64_t> ids;
  if (!int_list(ids_obj.ptr(), 0, INT64_MAX, ids)) return false;
  return extend_flat(core, ids.data(), ids.size(), lists, background);
}

nb::dict stats_dict(const DrafterCore& core) {
  rollout_spec::CoreStats s = core.stats();
  nb::dict d;
  d["num_requests"] = s.num_requests;
  d["num_sequences"] = s.num_sequences;
  d["index_tokens"] = s.index_tokens;
  d["memory_bytes"] = s.memory_bytes;
  d["step"] = s.step;
  d["num_groups"] = s.num_groups;
  d["request_records"] = s.request_records;
  d["group_records"] = s.group_records;
  d["global_records"] = s.global_records;
  d["evictions"] = s.evictions;
  d["proposals"] = s.proposals;
  d["ahead_hits"] = s.ahead_hits;
  d["ahead_dropped"] = s.ahead_dropped;
  return d;
}

nb::tuple propose(DrafterCore& core, Vec<int64_t> ids, std::optional<Vec<int32_t>> budgets) {
  size_t n = ids.shape(0);
  check_budgets(ids, budgets);
  DraftOutput out;
  {
    nb::gil_scoped_release release;
    core.propose(ids.data(), budgets ? budgets->data() : nullptr, n, out);
  }
  return propose_output(std::move(out));
}

// An uninitialised numpy array of `shape`, its memory owned by the array.
template <class T>
nb::ndarray<nb::numpy, T> new_array(std::initializer_list<size_t> shape) {
  size_t count = 1;
  for (size_t s : shape) count *= s;
  T* data = new T[count];
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  return nb::ndarray<nb::numpy, T>(data, shape, owner);
}

// tree.host_tree_inputs' native half: TreeInputs' host fields of a DraftBatch's CSR arrays, int64
// roots and a width, as (input_ids, depth, parent_col, row_index, flat_index, valid, tree_mask,
// positions). Bad shapes and values raise ValueError naming the field.
nb::tuple tree_inputs(Vec<int32_t> offsets, Vec<int32_t> tokens, Vec<int32_t> parents,
                      Vec<int64_t> root_tokens, Vec<int64_t> root_positions, int64_t width) {
  if (offsets.shape(0) < 1) throw std::invalid_argument("DraftBatch.offsets must have B + 1 >= 1 entries");
  const size_t num_req = offsets.shape(0) - 1, num_nodes = tokens.shape(0);
  if (parents.shape(0) != num_nodes)
    throw std::invalid_argument("DraftBatch.parents must have len(tokens) entries");
  if (root_tokens.shape(0) != num_req || root_positions.shape(0) != num_req)
    throw std::invalid_argument("root_tokens and root_positions must have B = len(offsets) - 1 entries");
  if (width < 1) throw std::invalid_argument("width must be >= 1, got " + std::to_string(width));
  const size_t w = static_cast<size_t>(width);
  rollout_spec::check_tree_inputs(offsets.data(), num_req, parents.data(), num_nodes, w);
  auto input_ids = new_array<int64_t>({num_req, w}), depth = new_array<int64_t>({num_req, w}),
       parent_col = new_array<int64_t>({num_req, w}), row_index = new_array<int64_t>({num_req, w}),
       flat_index = new_array<int64_t>({num_req + num_nodes}),
       positions = new_array<int64_t>({num_req, w});
  auto valid = new_array<bool>({num_req, w}), tree_mask = new_array<bool>({num_req, w, w});
  const TreeInputsBuffers out{input_ids.data(), positions.data(), depth.data(),
                              parent_col.data(), row_index.data(), flat_index.data(),
                              valid.data(), tree_mask.data()};
  {
    nb::gil_scoped_release release;
    rollout_spec::fill_tree_inputs(offsets.data(), num_req, tokens.data(), parents.data(),
                                   root_tokens.data(), root_positions.data(), w, out);
  }
  return nb::make_tuple(input_ids, depth, parent_col, row_index, flat_index, valid, tree_mask,
                        positions);
}

// noise.race_uniforms' native half: float32[A, vocab] uniforms of the rows keyed (seeds[a],
// positions[a]), in the column layout of quarter block q, with counter word 3 = tag.
nb::ndarray<nb::numpy, float> race_uniforms(Vec<int64_t> seeds, Vec<int64_t> positions,
                                            int64_t vocab, int64_t q, uint32_t tag) {
  if (positions.shape(0) != seeds.shape(0))
    throw std::invalid_argument("positions must have len(seeds) entries");
  if (vocab < 1 || q < 1 || q > rollout_spec::kMaxNoiseQ)
    throw std::invalid_argument("vocab must be >= 1 and q in [1, 2**29]");
  const size_t rows = seeds.shape(0), v = static_cast<size_t>(vocab);
  auto out = new_array<float>({rows, v});
  {
    nb::gil_scoped_release release;
    rollout_spec::race_uniforms(seeds.data(), positions.data(), rows, v, static_cast<size_t>(q),
                                tag, out.data());
  }
  return out;
}

void bind_config(nb::module_& m) {
  nb::class_<CoreConfig>(m, "CoreConfig")
      .def(nb::init<>())
      .def_rw("num_draft_tokens", &CoreConfig::num_draft_tokens)
      .def_rw("max_batch_draft_tokens", &CoreConfig::max_batch_draft_tokens)
      .def_rw("max_depth", &CoreConfig::max_depth)
      .def_rw("max_match_len", &CoreConfig::max_match_len)
      .def_rw("min_match_len", &CoreConfig::min_match_len)
      .def_rw("min_token_prob", &CoreConfig::min_token_prob)
      .def_rw("tree", &CoreConfig::tree)
      .def_rw("adaptive_budget", &CoreConfig::adaptive_budget)
      .def_rw("history_steps", &CoreConfig::history_steps)
      .def_rw("capacity_tokens", &CoreConfig::capacity_tokens)
      .def_rw("max_occurrences", &CoreConfig::max_occurrences)
      .def_rw("global_max_occurrences", &CoreConfig::global_max_occurrences)
      .def_rw("chain_walk", &CoreConfig::chain_walk)
      .def_rw("global_unigram_walk", &CoreConfig::global_unigram_walk)
      .def_rw("enough_occurrences", &CoreConfig::enough_occurrences)
      .def_rw("match_power", &CoreConfig::match_power)
      .def_rw("evidence_discount", &CoreConfig::evidence_discount)
      .def_rw("propose_threads", &CoreConfig::propose_threads)
      .def_rw("parallel_min_requests", &CoreConfig::parallel_min_requests)
      .def_prop_ro("scope_weights", [](const CoreConfig& c) {
        return nb::make_tuple(c.scope_weight[0], c.scope_weight[1], c.scope_weight[2]);
      })
      .def("set_scope_weights", [](CoreConfig& c, double r, double g, double w) {
        c.scope_weight[0] = r;
        c.scope_weight[1] = g;
        c.scope_weight[2] = w;
      });
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "rollout-spec native core: multi-scope n-gram chain index and draft-tree proposals";
  m.attr("ABI_VERSION") = 3;
  m.attr("KEY_LENGTHS") = nb::make_tuple(4, 2, 1);
  m.attr("RACE_TAG") = rollout_spec::kRaceTag;
  bind_config(m);
  m.def("tree_inputs", &tree_inputs, "offsets"_a, "tokens"_a, "parents"_a, "root_tokens"_a,
        "root_positions"_a, "width"_a);
  m.def("race_uniforms", &race_uniforms, "seeds"_a, "positions"_a, "vocab"_a, "q"_a, "tag"_a);
  nb::class_<DrafterCore>(m, "DrafterCore")
      .def(nb::init<const CoreConfig&>(), "config"_a)
      .def("start", [](DrafterCore& c, Vec<int64_t> ids, Vec<int32_t> groups, Vec<int32_t> toks, Vec<int64_t> offs) {
        if (groups.shape(0) != ids.shape(0)) throw std::invalid_argument("group_ids must have len(req_ids) entries");
        check_csr(ids.shape(0), toks, offs);
        nb::gil_scoped_release release;
        c.start(ids.data(), groups.data(), toks.data(), offs.data(), ids.shape(0));
      })
      .def("extend", [](DrafterCore& c, Vec<int64_t> ids, Vec<int32_t> toks, Vec<int64_t> offs,
                        bool background) {
        check_csr(ids.shape(0), toks, offs);
        run_extend(c, ids.data(), toks.data(), offs.data(), ids.shape(0), background);
      }, "ids"_a, "tokens"_a, "offsets"_a, "background"_a = false)
      // The list fast paths take None too (.none()), and answer it as any other non-list: the
      // facade's validating path then names the argument.
      .def("extend_lists", &extend_lists, "ids"_a, "lists"_a.none(), "background"_a = false)
      .def("extend_pylists", &extend_pylists, "ids"_a.none(), "lists"_a.none(), "background"_a = false)
      .def("finish", [](DrafterCore& c, Vec<int64_t> ids) {
        nb::gil_scoped_release release;
        c.finish(ids.data(), ids.shape(0));
      })
      .def("set_noise", [](DrafterCore& c, Vec<int64_t> ids, Vec<int64_t> seeds, Vec<double> temps, uint32_t q) {
        if (seeds.shape(0) != ids.shape(0) || temps.shape(0) != ids.shape(0))
          throw std::invalid_argument("seeds and temperatures must have len(req_ids) entries");
        nb::gil_scoped_release release;
        c.set_noise(ids.data(), seeds.data(), temps.data(), ids.shape(0), q);
      }, "ids"_a, "seeds"_a, "temperatures"_a, "q"_a)
      .def("propose", &propose, "ids"_a, "budgets"_a = nb::none())
      .def("propose_lists", &propose_lists, "ids"_a.none(), "budgets"_a = nb::none())
      .def("propose_ahead", [](DrafterCore& c, Vec<int64_t> ids, std::optional<Vec<int32_t>> budgets) {
        check_budgets(ids, budgets);
        nb::gil_scoped_release release;
        c.propose_ahead(ids.data(), budgets ? budgets->data() : nullptr, ids.shape(0));
      }, "ids"_a, "budgets"_a = nb::none())
      .def("propose_ahead_lists", &propose_ahead_lists, "ids"_a.none(), "budgets"_a = nb::none())
      .def("add_sequences", [](DrafterCore& c, Vec<int32_t> groups, Vec<int32_t> toks, Vec<int64_t> offs, bool pinned) {
        check_csr(groups.shape(0), toks, offs);
        nb::gil_scoped_release release;
        c.add_sequences(groups.data(), toks.data(), offs.data(), groups.shape(0), pinned);
      })
      .def("end_step", [](DrafterCore& c) {
        nb::gil_scoped_release release;
        c.end_step();
      })
      .def("has_request", &DrafterCore::has_request)
      .def("stats", &stats_dict)
      .def("check_integrity", [](const DrafterCore& c) {
        nb::gil_scoped_release release;
        return c.check_integrity();
      })
      .def("save", [](const DrafterCore& c, const std::string& path, const std::string& meta) {
        nb::gil_scoped_release release;
        std::ofstream os(path, std::ios::binary);
        if (!os) throw std::runtime_error("cannot open " + path + " for writing");
        c.save(os, meta);
        os.close();  // the last buffered bytes can fail too (a full disk)
        if (!os) throw std::runtime_error("writing " + path + " failed");
      })
      .def("load", [](DrafterCore& c, const std::string& path) {
        std::string meta;
        {
          nb::gil_scoped_release release;
          std::ifstream is(path, std::ios::binary);
          if (!is) throw std::runtime_error("cannot open " + path + " for reading");
          meta = c.load(is);
        }
        return nb::bytes(meta.data(), meta.size());
      })
      .def_static("read_meta", [](const std::string& path) {
        std::ifstream is(path, std::ios::binary);
        if (!is) throw std::runtime_error("cannot open " + path + " for reading");
        const std::string meta = DrafterCore::read_meta(is);
        return nb::bytes(meta.data(), meta.size());
      });
}
