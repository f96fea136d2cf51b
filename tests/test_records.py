"""Tests of vae_trainer.data.records: streaming part files and tar shards, pipes, damage, counting."""

import base64
import gzip
import os
import sys
import time
import tracemalloc

import numpy as np
import pytest
from conftest import write_tar

from vae_trainer.data.filelists import IMAGE, LINES, TAR, Part
from vae_trainer.data.images import BadImage
from vae_trainer.data.records import (
    Damaged,
    TarSample,
    describe,
    image_bytes,
    iterate_records,
)


def _tar(path, members):
    return str(write_tar(path, members))


def test_gzip_part_is_streamed_with_memory_independent_of_its_size(tmp_path):
    """A 19 MB part (300 lines of 64 KB) is read holding about one line, not the part."""
    rng = np.random.default_rng(0)
    lines = [b"c\t-\t" + base64.b64encode(rng.bytes(48 * 1024)) for _ in range(300)]
    path = tmp_path / "big.gz"
    with gzip.open(path, "wb", compresslevel=1) as handle:
        handle.writelines(line + b"\n" for line in lines)
    tracemalloc.start()
    try:
        count = 0
        for payload in iterate_records(Part(str(path), LINES)):
            assert payload == lines[count]
            count += 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 300
    assert peak < 3 * 1024 * 1024, f"peak {peak / 2**20:.1f} MiB while reading a {sum(map(len, lines)) / 2**20:.0f} MiB part"


def test_multi_member_gzip_crlf_and_plain_text(tmp_path):
    gz = tmp_path / "multi.gz"
    gz.write_bytes(gzip.compress(b"a\r\nb\n") + gzip.compress(b"c\n\nd"))
    assert list(iterate_records(Part(str(gz), LINES))) == [b"a", b"b", b"c", b"", b"d"]
    plain = tmp_path / "plain.txt"
    plain.write_bytes(b"x\ny\nz\n")
    assert list(iterate_records(Part(str(plain), LINES), start=1)) == [None, b"y", b"z"]
    assert list(iterate_records(Part(str(gz), LINES), start=5)) == [None] * 5  # counted without keeping any


def test_corrupt_gzip_ends_with_a_damage_marker(tmp_path):
    whole = gzip.compress(b"".join(b"line %d\n" % i for i in range(2000)))
    cut = tmp_path / "cut.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    records = list(iterate_records(Part(str(cut), LINES)))
    assert isinstance(records[-1], Damaged) and records[-1].reason == "corrupt_gzip"
    assert records[:-1] == [b"line %d" % i for i in range(len(records) - 1)] and len(records) > 100
    garbage = tmp_path / "garbage.gz"
    garbage.write_bytes(whole[:40] + b"\x00" * 20 + whole[60:])
    assert isinstance(list(iterate_records(Part(str(garbage), LINES)))[-1], Damaged)


def test_tar_samples_grouped_by_key_like_webdataset(tmp_path):
    path = _tar(tmp_path / "s.tar", [
        ("a/0001.json", b"{}"), ("a/0001.jpg", b"J1"), ("a/0001.png", b"P1"),  # jpg preferred over png
        ("__index__", b"meta"), ("a/0002.seg.png", b"S2"), ("a/0002.PNG", b"P2"),  # case-insensitive
        ("a/0003.txt", b"no image"), ("noextension", b"?"),
        ("b/0001.webp", b"W"),  # same stem, other folder: another sample
    ])
    samples = list(iterate_records(Part(path, TAR)))
    assert samples == [TarSample("a/0001", b"J1"), TarSample("a/0002", b"P2"), TarSample("a/0003", None),
                       TarSample("b/0001", b"W")]
    assert list(iterate_records(Part(path, TAR), start=2)) == [None, None, TarSample("a/0003", None),
                                                                TarSample("b/0001", b"W")]
    with pytest.raises(BadImage) as bad:
        image_bytes(samples[2], 2)
    assert bad.value.reason == "no_image"
    assert describe(Part(path, TAR), 2, samples[2]) == f"{path}:a/0003"


def test_pipe_tar_and_failing_pipe(tmp_path):
    path = _tar(tmp_path / "s.tar", [(f"{i}.png", bytes([i])) for i in range(3)])
    piped = list(iterate_records(Part(f"pipe:cat {path}", TAR)))
    assert piped == [TarSample(str(i), bytes([i])) for i in range(3)]
    failing = list(iterate_records(Part(f"pipe:cat {path}; exit 4", TAR)))
    assert failing[:3] == piped and isinstance(failing[3], Damaged) and "status 4" in failing[3].detail
    missing = list(iterate_records(Part("pipe:cat /nonexistent/x.tar", TAR)))
    assert len(missing) == 1 and isinstance(missing[0], Damaged)
    # A reader that stops early kills the command (and its children) instead of waiting for it.
    big = _tar(tmp_path / "big.tar", [(f"{i:03d}.png", bytes(20_000)) for i in range(100)])
    marker = f"b11-{os.getpid()}-sleeper"
    sleeper = f"{sys.executable} -c 'import time; time.sleep(600)' {marker}"
    slow = iterate_records(Part(f"pipe:cat {big}; {sleeper}", TAR))
    assert next(slow) == TarSample("000", bytes(20_000))
    slow.close()
    # SIGKILL reaches the command's group at once but a loaded machine may run the sleeper a moment longer: wait up
    # to 10 s of its 600 (the full suite at load 6 once saw it still there right after close()).
    deadline = time.monotonic() + 10
    while [pid for pid in os.listdir("/proc") if pid.isdigit() and marker in _cmdline(pid)]:
        assert time.monotonic() < deadline, "the command's child outlived close()"
        time.sleep(0.05)


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def test_image_parts_and_image_bytes(tmp_path):
    path = tmp_path / "x.png"
    path.write_bytes(b"bytes of x")
    assert list(iterate_records(Part(str(path), IMAGE, 1))) == [str(path)]
    assert image_bytes(str(path), 2) == b"bytes of x"
    os.remove(path)
    with pytest.raises(BadImage) as bad:
        image_bytes(str(path), 2)
    assert bad.value.reason == "missing_file" and str(path) in bad.value.detail  # gone, not unreadable
    os.mkdir(path)  # there, but not readable as a file
    with pytest.raises(BadImage) as bad:
        image_bytes(str(path), 2)
    assert bad.value.reason == "unreadable"
    assert image_bytes(b"a\tb\t" + base64.b64encode(b"img") + b"\tmore", 2) == b"img"
    with pytest.raises(BadImage) as bad:
        image_bytes(b"a\tb", 2)
    assert bad.value.reason == "columns"


@pytest.mark.parametrize("kind", [LINES, TAR])
def test_a_part_gone_since_the_start_is_a_missing_file_not_corrupt(tmp_path, kind):
    path = str(tmp_path / ("gone.tar" if kind == TAR else "gone.gz"))
    records = list(iterate_records(Part(path, kind)))
    assert records == [Damaged("missing_file", f"part file not found: {path}")]
