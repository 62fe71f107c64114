"""scripts/sanitize.sh refuses what it cannot run before it builds anything."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sanitize.sh"


def test_unknown_kind_is_refused_by_name():
    res = subprocess.run(["bash", str(SCRIPT), "memory"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "kind must be 'address' or 'thread', got 'memory'" in res.stderr


def test_missing_runtime_is_named(tmp_path):
    fake = tmp_path / "c++"  # a compiler that knows no sanitizer runtime
    fake.write_text("#!/bin/sh\necho libtsan.so\n")
    fake.chmod(0o755)
    res = subprocess.run(["bash", str(SCRIPT), "thread"], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "CXX": str(fake)})
    assert res.returncode == 2
    assert "has no libtsan.so" in res.stderr


def test_a_failed_build_shows_its_log(tmp_path):
    fake = tmp_path / "cmake"  # a configure step that fails
    fake.write_text("#!/bin/sh\necho 'CMake Error: no CXX compiler found'\nexit 1\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", SANITIZE_BUILD_DIR=str(tmp_path / "out"))
    res = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 1
    assert "CMake Error: no CXX compiler found" in res.stderr
    assert f"failed, see {tmp_path / 'out' / 'sanitize-address' / 'cmake.log'}" in res.stderr
