"""kernels_cpu.simde: the pinned SIMDe headers that let the AVX-512 builds run emulated.
Offline: a .deb is built here in memory (ar archive -> data.tar.xz -> usr/include/simde/...)."""
import hashlib
import io
import tarfile

import pytest

from kernels_cpu import simde


def make_deb(version=(0, 8, 2)) -> bytes:
    header = "".join(f"#define SIMDE_VERSION_{p} {v}\n" for p, v in zip(("MAJOR", "MINOR", "MICRO"), version))
    files = {"./usr/include/simde/simde-common.h": header, "./usr/include/simde/x86/avx512.h": "// avx512\n",
             "./usr/share/doc/libsimde-dev/copyright": "MIT\n"}
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:xz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))

    def member(name: bytes, body: bytes) -> bytes:
        head = name.ljust(16) + b"0".ljust(12) + b"0".ljust(6) + b"0".ljust(6) + b"100644".ljust(8)
        return head + str(len(body)).encode().ljust(10) + b"`\n" + body + (b"\n" if len(body) % 2 else b"")
    return (b"!<arch>\n" + member(b"debian-binary", b"2.0\n") + member(b"control.tar.xz", b"x")
            + member(b"data.tar.xz", data.getvalue()))


@pytest.fixture
def served(monkeypatch):
    """Serve a fake .deb at DEB_URL, pinned by its own hash."""
    def serve(deb: bytes, sha256: str | None = None):
        monkeypatch.setattr(simde, "DEB_SHA256", sha256 or hashlib.sha256(deb).hexdigest())
        monkeypatch.setattr(simde.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(deb))
    return serve


def test_install_unpacks_only_the_headers_and_is_found(tmp_path, served, monkeypatch):
    served(make_deb())
    dest = simde.install(tmp_path / "include")
    assert (dest / "simde" / "x86" / "avx512.h").read_text() == "// avx512\n"
    assert not (dest / "share").exists() and not (dest / "usr").exists()
    monkeypatch.setenv(simde.INCLUDE_ENV, str(dest))
    assert simde.include_dir() == dest and simde.missing_reason() is None


def test_a_download_with_another_hash_is_refused(tmp_path, served):
    served(make_deb(), sha256="0" * 64)
    with pytest.raises(RuntimeError, match="SHA-256"):
        simde.install(tmp_path)
    assert not (tmp_path / "simde").exists()


def test_headers_older_than_needed_are_not_used(tmp_path, served, monkeypatch):
    """Bookworm's 0.7.4 lacks intrinsics the kernels use: found, reported, not used."""
    served(make_deb((0, 7, 4)))
    dest = simde.install(tmp_path)
    monkeypatch.setattr(simde, "candidates", lambda: [dest])
    assert simde.include_dir() is None
    assert "(0, 7, 4)" in simde.missing_reason() and "make setup" in simde.missing_reason()


def test_not_a_deb_is_refused():
    with pytest.raises(ValueError, match="not a .deb"):
        simde._deb_member(b"PK\x03\x04 a zip", b"data.tar")
