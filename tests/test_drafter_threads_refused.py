"""When the OS refuses the drafter a thread (a container's pids limit, RLIMIT_NPROC), the call
that needed it raises and changes nothing, and the drafter goes on as before: no abort from a
half-built thread pool, no hang behind a job that was counted but never ran.

A preloaded shim makes ``pthread_create`` fail once a file exists (after ``ALLOW_THREADS`` more
successes: a pool refused its second thread has one running to stop); each case runs in its own
process."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("cc") is None,
                                reason="needs Linux and a C compiler for the pthread_create shim")

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>
static int allowed = 0;
int pthread_create(pthread_t* t, const pthread_attr_t* a, void* (*f)(void*), void* arg) {
  static int (*real)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*) = 0;
  if (!real) real = (int (*)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*))dlsym(RTLD_NEXT, "pthread_create");
  const char* arm = getenv("REFUSE_THREADS_WHILE");
  if (arm && access(arm, F_OK) == 0 && allowed++ >= atoi(getenv("ALLOW_THREADS"))) return EAGAIN;
  return real(t, a, f, arg);
}
"""

CASE = textwrap.dedent("""
    import json, os, sys
    from rollout_spec.config import SpecConfig
    from rollout_spec.drafter import NgramDrafter

    def started():
        d = NgramDrafter(SpecConfig(propose_threads=4))
        d.start_batch(list(range(64)), [[1, 2, 3, 1, 2, 9]] * 64, group_ids=[0] * 64)
        return d

    mode, arm = sys.argv[1], os.environ["REFUSE_THREADS_WHILE"]
    d, twin = started(), started()
    ids = list(range(64))
    before = d.stats()
    open(arm, "w").close()
    try:
        if mode == "pool":
            d.propose(ids)
        elif mode == "background":
            d.extend_batch([0], [[1, 2]], background=True)
        elif mode == "extend 64":  # split over the pool
            d.extend_batch(ids, [[1, 2]] * 64)
        elif mode == "background extend 64":
            d.extend_batch(ids, [[1, 2]] * 64, background=True)
        else:
            d.propose_ahead(ids)
        outcome = "returned"
    except RuntimeError:
        outcome = "raised"
    finally:
        os.unlink(arm)
    unchanged = d.stats() == before
    for x in (d, twin):
        x.extend_batch([0], [[1, 2]], background=True)
    same = d.propose(ids).tokens.tolist() == twin.propose(ids).tokens.tolist()
    d.check_integrity()
    print(json.dumps([outcome, unchanged, same]))
""")


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("shim")
    (folder / "refuse.c").write_text(SHIM)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(folder / "refuse.so"), str(folder / "refuse.c"), "-ldl"],
                   check=True)
    return folder / "refuse.so"


@pytest.mark.parametrize("mode, allow", [("pool", 0), ("pool", 1), ("background", 0), ("ahead", 0),
                                         ("extend 64", 0), ("background extend 64", 1)])
def test_a_refused_thread_is_an_error_that_changes_nothing(shim, tmp_path, mode, allow):
    env = dict(os.environ, REFUSE_THREADS_WHILE=str(tmp_path / "armed"), ALLOW_THREADS=str(allow),
               LD_PRELOAD=":".join(filter(None, [os.environ.get("LD_PRELOAD"), str(shim)])))
    run = subprocess.run([sys.executable, "-c", CASE, mode], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.splitlines()[-1]) == ["raised", True, True]
