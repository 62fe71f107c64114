"""scripts/sanitize.sh refuses what it cannot run before it builds anything."""
from __future__ import annotations

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
