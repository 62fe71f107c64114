// The only file that knows Python: a thin nanobind layer over the rollout_spec core.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

NB_MODULE(_core, m) {
    m.doc() = "rollout-spec native core (suffix index, match state, tree proposal)";
    m.attr("ABI_VERSION") = 1;
}
