"""SIMDe's headers, so the CPU kernels' AVX-512 builds can run on a CPU without AVX-512 (tests only).

Why: the kernels (attention, GEMM, layer ops) are compiled per instruction set, and a machine
runs only the builds its CPU supports. Most of ours are AVX2, so the AVX-512 code -- the masked
16-bit loads, the transpose-and-add shuffles, scalef in exp -- would only ever be checked on the
rare AVX-512 machine, where a mistake in it would change every token the engine makes. SIMDe
("SIMD Everywhere", header-only, MIT) implements the x86 intrinsics in portable C, each to Intel's
specification, and compiles them to the instructions the CPU does have. Built with `-DVFS_CPU_SIMDE_AVX512` (csrc/vec_simde.h),
the AVX-512 variant's own source runs here as the "avx512_simde" variant and the per-ISA tests
compare it with the torch reference like the others. It proves what the AVX-512 code computes,
not how fast it runs (emulated, it is slower than the AVX2 build).

Where the headers come from: Debian's libsimde-dev package (a registry this project may
use), version 0.8.2 -- the first with every intrinsic the kernels use but one
(_mm512_reduce_add_ps, which the shim defines). Bookworm's apt only has 0.7.4, which lacks
more, so `make setup` fetches trixie's .deb by URL, checks its SHA-256, and unpacks the
headers into the venv (`python -m kernels_cpu.simde install`). No dpkg needed: a .deb is an
`ar` archive holding data.tar.*.
"""
from __future__ import annotations

import hashlib
import io
import os
import pathlib
import re
import sys
import tarfile
import urllib.request

DEB_URL = "http://deb.debian.org/debian/pool/main/s/simde/libsimde-dev_0.8.2-3_all.deb"
DEB_SHA256 = "277dcde3fb84223b7026174042646e236da42adce2fcb77031807ede8166a51e"
MIN_VERSION = (0, 8, 2)
INCLUDE_ENV = "SIMDE_INCLUDE"          # a folder holding simde/ (overrides the search below)


def _version(include: pathlib.Path) -> tuple[int, int, int] | None:
    """SIMDe's version from simde/simde-common.h (None: no SIMDe there)."""
    try:
        text = (include / "simde" / "simde-common.h").read_text(errors="replace")
    except OSError:
        return None
    parts = [re.search(rf"#define SIMDE_VERSION_{p} (\d+)", text) for p in ("MAJOR", "MINOR", "MICRO")]
    return tuple(int(m.group(1)) for m in parts) if all(parts) else None


def candidates() -> list[pathlib.Path]:
    """Where to look, first match wins: $SIMDE_INCLUDE, the venv's include/ (where `install` puts
    them), then the system's."""
    env = os.environ.get(INCLUDE_ENV)
    return [pathlib.Path(p) for p in (env, os.path.join(sys.prefix, "include"), "/usr/local/include",
                                      "/usr/include") if p]


def _usable(include: pathlib.Path) -> bool:
    """include/ holds SIMDe at MIN_VERSION or newer."""
    version = _version(include)
    return version is not None and version >= MIN_VERSION


def include_dir() -> pathlib.Path | None:
    """A folder holding simde/ at MIN_VERSION or newer, or None."""
    return next((folder for folder in candidates() if _usable(folder)), None)


def missing_reason() -> str | None:
    """Why the emulated AVX-512 builds cannot be made here (None when they can)."""
    if include_dir() is not None:
        return None
    versions = {str(f): _version(f) for f in candidates()}
    found = {f: v for f, v in versions.items() if v is not None}
    return (f"the avx512_simde builds need SIMDe >= {'.'.join(map(str, MIN_VERSION))} headers "
            f"(found: {found or 'none'} in {[str(c) for c in candidates()]}); `make setup` installs them "
            f"into the venv (`python -m kernels_cpu.simde install`)")


def _deb_member(deb: bytes, prefix: bytes) -> bytes:
    """The contents of the first member of an ar archive whose name starts with prefix."""
    if not deb.startswith(b"!<arch>\n"):
        raise ValueError("not a .deb (ar) archive")
    pos = 8
    while pos + 60 <= len(deb):
        header = deb[pos:pos + 60]                     # name[16] mtime[12] uid[6] gid[6] mode[8] size[10] magic[2]
        name, size = header[:16].rstrip(b" /"), int(header[48:58])
        if name.startswith(prefix):
            return deb[pos + 60:pos + 60 + size]
        pos += 60 + size + (size & 1)                  # members are 2-byte aligned
    raise ValueError(f"no {prefix!r} member in the .deb")


def install(dest: pathlib.Path | None = None) -> pathlib.Path:
    """Download the pinned libsimde-dev .deb, check its hash, unpack usr/include/simde into
    dest (default: the venv's include/). Returns dest."""
    dest = pathlib.Path(dest or os.path.join(sys.prefix, "include"))
    if _usable(dest):
        return dest
    with urllib.request.urlopen(DEB_URL, timeout=120) as response:
        deb = response.read()
    digest = hashlib.sha256(deb).hexdigest()
    if digest != DEB_SHA256:
        raise RuntimeError(f"{DEB_URL}: SHA-256 {digest}, expected {DEB_SHA256}")
    data = _deb_member(deb, b"data.tar")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:   # data.tar.xz: tarfile finds the compression
        members = [m for m in tar.getmembers() if m.name.startswith("./usr/include/simde/") and m.isfile()]
        for m in members:
            m.name = m.name[len("./usr/include/"):]
        dest.mkdir(parents=True, exist_ok=True)
        tar.extractall(dest, members=members, filter="data")
    return dest


if __name__ == "__main__":            # python -m kernels_cpu.simde install
    if sys.argv[1:] != ["install"]:
        sys.exit("usage: python -m kernels_cpu.simde install")
    try:
        print(f"SIMDe headers in {install()}")
    except Exception as e:  # noqa: BLE001 — setup goes on: only the emulated AVX-512 tests need them
        print(f"warning: could not install SIMDe ({type(e).__name__}: {e}); the avx512_simde tests will skip",
              file=sys.stderr)
