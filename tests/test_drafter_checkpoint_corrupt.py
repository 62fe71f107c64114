"""Damaged drafter checkpoints: refused with a RuntimeError that says so, never a crash, a huge
allocation or a drafter whose later calls read out of bounds."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_spec.drafter import NgramDrafter
from rollout_spec.tree import DraftBatch

from drafter_states import LIVE_IDS, evicted_drafter

HEADER_AT = 8  # the uint64 length of the JSON header follows the 8-byte magic


def saved_drafter(path: Path) -> bytes:
    """A checkpoint with finished and live requests, groups, an eviction and noise keys."""
    d = evicted_drafter()
    d.set_noise_keys(LIVE_IDS, list(range(16)), [1.0] * 16, vocab_size=20)
    d.save(path)
    return path.read_bytes()


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> bytes:
    return saved_drafter(tmp_path_factory.mktemp("ckpt") / "good.bin")


def split(data: bytes) -> tuple[dict, int]:
    """The JSON header and the offset of what follows it."""
    (n,) = struct.unpack_from("<Q", data, HEADER_AT)
    start = HEADER_AT + 8
    return json.loads(data[start : start + n]), start + n


def checksum(payload: bytes) -> int:
    """csrc/checksum.h's digest, written again: little-endian words (the last zero-padded), each
    folded in by a multiply and a shift, then the length."""
    mask, state = (1 << 64) - 1, 0x9E3779B97F4A7C15
    words = [w for (w,) in struct.iter_unpack("<Q", payload + bytes(-len(payload) % 8))]
    for word in words + [len(payload)]:
        state = ((state ^ word) * 0xFF51AFD7ED558CCD) & mask
        state ^= state >> 29
    return state


def resealed(data: bytes) -> bytes:
    """A damaged checkpoint with a checksum that matches again (its last 8 bytes replaced), so
    that the checks behind the checksum see the damage."""
    return data[:-8] + struct.pack("<Q", checksum(data[:-8]))


def with_header(data: bytes, meta: object) -> bytes:
    """``data`` with its header replaced by ``meta`` (JSON text, or raw bytes), resealed."""
    _, rest = split(data)
    text = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
    return resealed(data[:HEADER_AT] + struct.pack("<Q", len(text)) + text + data[rest:])


def _written(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "bad.bin"
    path.write_bytes(data)
    return path


def load(tmp_path: Path, data: bytes) -> NgramDrafter:
    return NgramDrafter.load(_written(tmp_path, data))


def fields(data: bytes) -> dict[str, int]:
    """Offsets of the sequence and free-slot fields that follow the header (format 7): per
    sequence its tokens, request id, group, prompt length, step, order and flags, then the
    free-slot list. Keys like ``seq3.prompt_len``, ``free0``, ``nfree``."""
    _, at = split(data)
    at += 28  # step, next order, evictions, noise block
    out = {}
    (num_seqs,) = struct.unpack_from("<Q", data, at)
    at += 8
    for i in range(num_seqs):
        (num_tokens,) = struct.unpack_from("<Q", data, at)
        at += 8 + 4 * num_tokens
        for name, size in (("req_id", 8), ("group", 4), ("prompt_len", 4), ("step", 8), ("order", 8),
                           ("flags", 1)):
            out[f"seq{i}.{name}"] = at
            at += size
        out[f"seq{i}.num_tokens"] = num_tokens
    out["nfree"] = struct.unpack_from("<Q", data, at)[0]
    at += 8
    for i in range(out["nfree"]):
        out[f"free{i}"] = at + 4 * i
    return out


def with_int32(data: bytes, at: int, value: int) -> bytes:
    """``data`` with the int32 at ``at`` replaced by ``value``, resealed."""
    return resealed(data[:at] + struct.pack("<i", value) + data[at + 4 :])


def test_the_fixture_loads(tmp_path, good):
    assert good[7:8] == b"7" and resealed(good) == good  # format 7: the checksum is csrc's
    load(tmp_path, good).check_integrity()


@pytest.mark.parametrize("where", ["first token", 0.5, -9, -1])
def test_any_changed_byte_fails_the_checksum(tmp_path, good, where):
    """A flipped token id decodes as another token: only the checksum can tell. Any byte of the
    state or of the checksum itself (a damaged header is refused as such: test above)."""
    if where == "first token":
        at = split(good)[1] + 28 + 8 + 8  # step .. noise block, the sequence count, its token count
    else:
        at = int(where * len(good)) if isinstance(where, float) else where % len(good)
    data = bytearray(good)
    data[at] ^= 0x10
    with pytest.raises(RuntimeError, match=r"corrupt \(its checksum does not match its contents: damaged or truncated\)"):
        NgramDrafter.load(_written(tmp_path, bytes(data)))


@pytest.mark.parametrize("prompt_len", [-1, "size + 1", 2**31 - 256])
def test_a_prompt_length_outside_its_sequence_is_refused(tmp_path, good, prompt_len):
    """It loaded, and then a finish and a start sized the next request's tables from a negative
    or huge response length: an endless loop or a bad_alloc."""
    at = fields(good)
    live = next(i for i in range(100) if good[at[f"seq{i}.flags"]] & 1)
    value = at[f"seq{live}.num_tokens"] + 1 if prompt_len == "size + 1" else prompt_len
    with pytest.raises(RuntimeError, match=r"corrupt \(prompt length outside its sequence\)"):
        load(tmp_path, with_int32(good, at[f"seq{live}.prompt_len"], value))


def test_a_free_slot_listed_twice_is_refused(tmp_path):
    """Two new requests would have shared that sequence slot."""
    d = evicted_drafter()
    d.finish_batch(LIVE_IDS)
    d.end_step()
    d.start(100, [1] * 1000)  # past the capacity: older sequences are evicted, their slots free
    d.save(tmp_path / "freed.bin")
    data = (tmp_path / "freed.bin").read_bytes()
    at = fields(data)
    assert at["nfree"] >= 2
    first = struct.unpack_from("<i", data, at["free0"])[0]
    with pytest.raises(RuntimeError, match=r"corrupt \(free slot listed twice\)"):
        load(tmp_path, with_int32(data, at["free1"], first))


def test_a_count_larger_than_the_file_is_refused_before_allocating(tmp_path, good):
    # After the header: step (8), next order (8), evictions (8), noise block (4), then the
    # number of sequences. 2**36 sequences would take terabytes.
    _, at = split(good)
    at += 28
    data = resealed(good[:at] + struct.pack("<Q", 2**36) + good[at + 8 :])
    with pytest.raises(RuntimeError, match=r"corrupt \(a count exceeds the file\)"):
        load(tmp_path, data)


def test_a_zero_noise_block_with_seeded_requests_is_refused(tmp_path, good):
    _, at = split(good)
    at += 24
    assert struct.unpack_from("<I", good, at)[0] == 16  # quarter_block(20)
    data = resealed(good[:at] + struct.pack("<I", 0) + good[at + 4 :])
    with pytest.raises(RuntimeError, match=r"corrupt \(noise key\)"):
        load(tmp_path, data)


@pytest.mark.parametrize("meta, why", [
    (b"{not json", "JSONDecodeError"),
    (b"\xff\xfe", "UnicodeDecodeError"),
    ({"live": []}, "KeyError"),
    ("config-less", "TypeError"),
])
def test_a_damaged_header_is_named(tmp_path, good, meta, why):
    with pytest.raises(RuntimeError, match=rf"is corrupt \(its header: {why}"):
        load(tmp_path, with_header(good, meta))


def test_a_header_config_out_of_range_is_named(tmp_path, good):
    """The header's SpecConfig is validated as the constructor's is, a number too large for a
    float included."""
    meta, _ = split(good)
    for value in (1.5, 10**400):
        damaged = dict(meta, config=dict(meta["config"], min_token_prob=value))
        with pytest.raises(RuntimeError, match=r"its header: ValueError: min_token_prob must be in"):
            load(tmp_path, with_header(good, damaged))


def test_header_live_ids_must_be_the_cores(tmp_path, good):
    meta, _ = split(good)
    assert meta["live"] == LIVE_IDS
    for live in (meta["live"][:-1], meta["live"][:-1] + [99]):
        with pytest.raises(RuntimeError, match="live requests are not the core's"):
            load(tmp_path, with_header(good, dict(meta, live=live)))
    with pytest.raises(RuntimeError, match=r"its header: ValueError: live request ids"):
        load(tmp_path, with_header(good, dict(meta, live=meta["live"][:-1] + [-1])))


def test_set_noise_refuses_a_zero_block():
    d = NgramDrafter()
    d.start(0, [1, 2, 3])
    with pytest.raises(ValueError, match=r"q must be in \[1, 2\*\*29\]"):
        d._core.set_noise(np.array([0]), np.array([5]), np.array([1.0]), 0)


@settings(max_examples=150, deadline=None)
@given(damage=st.one_of(
    st.tuples(st.just("bytes"), st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)),
                                         min_size=1, max_size=4)),
    st.tuples(st.just("word"), st.floats(0, 1, exclude_max=True), st.binary(min_size=8, max_size=8)),
    st.tuples(st.just("cut"), st.floats(0, 1, exclude_max=True)),
))
def test_any_damage_raises_or_loads_a_consistent_drafter(tmp_path_factory, good, damage):
    """Flipped bytes, an overwritten 8-byte word or a truncation, resealed so that the checks
    behind the checksum see them: either RuntimeError, or a drafter that passes its integrity
    check and proposes, extends, finishes and starts like any other."""
    data = bytearray(good[:-8])
    if damage[0] == "bytes":
        for where, value in damage[1]:
            data[int(where * len(data))] = value
    elif damage[0] == "word":
        at = int(damage[1] * (len(data) - 8))
        data[at : at + 8] = damage[2]
    else:
        data = data[: int(damage[1] * len(data))]
    try:
        d = load(tmp_path_factory.mktemp("damaged"), resealed(bytes(data) + bytes(8)))
    except RuntimeError as err:
        assert "checkpoint" in str(err)
        return
    d.check_integrity()
    live = sorted(d._live)
    if live:
        d.propose(live)
        d.extend_batch(live, [[1, 2]] * len(live))
        b = d.propose(live)
        DraftBatch(offsets=b.offsets, tokens=b.tokens, parents=b.parents, probs=b.probs).validate()
        d.finish_batch(live)  # a finish reads the prompt length, a start sizes tables from it
    d.start_batch([1000, 1001], [[1, 2, 3], [4, 5]], [0, 7])
    d.propose([1000, 1001])
    d.end_step()
    d.check_integrity()


def test_an_interrupted_save_keeps_the_checkpoint_before_it(tmp_path, good, monkeypatch):
    """The save is written beside the path and renamed: stopped before the rename, the file
    there is the previous checkpoint, whole, and no temporary file is left."""
    import os

    path = tmp_path / "drafter.bin"
    path.write_bytes(good)
    d = NgramDrafter()
    d.start(0, [1, 2, 3])

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        d.save(path)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["drafter.bin"]
    assert path.read_bytes() == good
    d.save(path)
    assert NgramDrafter.load(path).is_live(0)


def test_a_deeply_nested_header_is_named(tmp_path, good):
    with pytest.raises(RuntimeError, match=r"is corrupt \(its header: RecursionError"):
        load(tmp_path, with_header(good, b"[" * 100_000 + b"]" * 100_000))


def test_checkpoint_paths_are_checked(tmp_path, good):
    """A NUL byte would cut the path in the core's C calls (loading or overwriting another
    file); a directory is not read as a truncated checkpoint; bytes paths work."""
    (tmp_path / "a.bin").write_bytes(good)
    with pytest.raises(ValueError, match="path must not contain a NUL byte"):
        NgramDrafter.load(f"{tmp_path}/a.bin\0more")
    with pytest.raises(ValueError, match="path must not contain a NUL byte"):
        NgramDrafter().save(f"{tmp_path}/a.bin\0.new")
    assert (tmp_path / "a.bin").read_bytes() == good
    with pytest.raises(RuntimeError, match="is a directory, not a checkpoint file"):
        NgramDrafter.load(tmp_path)
    with pytest.raises(TypeError, match="path must be a str, bytes or os.PathLike, got int"):
        NgramDrafter.load(5)
    assert NgramDrafter.load(str(tmp_path / "a.bin").encode()).is_live(LIVE_IDS[0])
    with pytest.raises(ValueError, match="path must be valid UTF-8"):
        NgramDrafter().save(bytes(tmp_path) + b"/\xff.bin")


def test_an_empty_path_is_named(tmp_path):
    """An empty path names no file: a ValueError naming the argument, not pathlib's error about
    the temporary it would have named beside ``Path(".")``."""
    with pytest.raises(ValueError, match="path must name a file, got an empty path"):
        NgramDrafter().save("")
    with pytest.raises(ValueError, match="path must name a file, got an empty path"):
        NgramDrafter.load(b"")


def test_a_format_7_file_relabelled_as_an_older_format_is_refused(tmp_path, good):
    """Format 6 has no checksum: a format-7 file whose version byte was damaged into '6' must not
    be read without one. It is refused by the 8 bytes (its checksum) left after its state, even
    with other damage that only the checksum would have caught (a changed token id)."""
    data = bytearray(good)
    data[7] = ord("6")
    at = split(good)[1] + 28 + 8 + 8  # the first token (see test_any_changed_byte_fails_the_checksum)
    for damaged in (bytes(data), bytes(data[:at]) + struct.pack("<i", 3) + bytes(data[at + 4 :])):
        with pytest.raises(RuntimeError, match="corrupt"):
            NgramDrafter.load(_written(tmp_path, damaged))


def test_save_into_a_missing_directory_names_the_path(tmp_path):
    with pytest.raises(RuntimeError, match="cannot open .*missing.* for writing"):
        NgramDrafter().save(tmp_path / "missing" / "drafter.bin")


def test_save_onto_a_directory_is_a_runtime_error_naming_the_path(tmp_path):
    """As the docstring says (RuntimeError when writing fails), for the rename too; a trailing
    separator names a directory, not the file before it."""
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(RuntimeError, match=r"cannot write the checkpoint .*ckpt'"):
        NgramDrafter().save(tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match=r"cannot write the checkpoint .*other/'.*directory"):
        NgramDrafter().save(f"{tmp_path}/other/")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


LOAD_IN_CHILD = (
    "import sys\n"
    "from rollout_spec.drafter import NgramDrafter\n"
    "try:\n"
    "    NgramDrafter.load(sys.argv[1])\n"
    "except RuntimeError as err:\n"
    "    sys.exit(0 if 'corrupt (record out of range)' in str(err) else f'another error: {err}')\n"
    "sys.exit('loaded')\n"
)


@pytest.mark.parametrize("version", ["7", "6"])
def test_a_shared_record_at_the_largest_position_is_refused(tmp_path, good, version):
    """The global index's last record (seq, pos: the 8 bytes before the checksum) at position
    2**31-1: its pos + 1 must not wrap below the range check, which would let load read past
    the sequence (a crash). Format 7 resealed; format 6, which has no checksum, as damaged.
    Loaded in a child process, so that a crash fails this test rather than the run."""
    payload = bytearray(good[:-8])
    payload[-4:] = struct.pack("<i", 2**31 - 1)
    if version == "7":
        data = resealed(bytes(payload) + bytes(8))
    else:
        payload[7] = ord("6")
        data = bytes(payload)
    done = subprocess.run([sys.executable, "-c", LOAD_IN_CHILD, str(_written(tmp_path, data))],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
