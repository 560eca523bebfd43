"""Tests of tools.asv_wheel: a pure wheel installs by unpacking and uninstalls without a trace; anything it
cannot install like pip would is refused."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from tools import asv_wheel

WHEEL_META = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"


def _wheel(path: Path, files: dict[str, str], *, wheel_meta: str = WHEEL_META, name: str = "demo_pkg") -> Path:
    info = f"{name}-1.0.dist-info"
    members = {**files, f"{info}/METADATA": f"Name: {name}\nVersion: 1.0\n", f"{info}/WHEEL": wheel_meta}
    members[f"{info}/RECORD"] = "".join(f"{m},,\n" for m in [*members, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in members.items():
            archive.writestr(member, text)
    return path


def test_install_then_uninstall_leaves_nothing(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "other").mkdir(parents=True)
    (site / "other" / "keep.py").write_text("x = 1\n")
    wheel = _wheel(tmp_path / "demo.whl", {"pkg/__init__.py": "", "pkg/sub/mod.py": "VALUE = 2\n"})
    asv_wheel.install(wheel, site)
    assert (site / "pkg" / "sub" / "mod.py").read_text() == "VALUE = 2\n"
    # Bytecode written after the install (by an import) goes too.
    (site / "pkg" / "sub" / "__pycache__").mkdir()
    (site / "pkg" / "sub" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"")
    removed = asv_wheel.uninstall("demo-pkg", site)
    assert "pkg/sub/mod.py" in removed
    assert sorted(p.relative_to(site).as_posix() for p in site.rglob("*")) == ["other", "other/keep.py"]


def test_uninstall_of_what_is_not_installed_is_nothing(tmp_path: Path) -> None:
    assert asv_wheel.uninstall("demo-pkg", tmp_path) == []


def test_a_module_the_next_build_lacks_does_not_survive_a_switch(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    asv_wheel.install(_wheel(tmp_path / "a.whl", {"pkg/__init__.py": "", "pkg/old.py": ""}), site)
    asv_wheel.uninstall("demo_pkg", site)
    asv_wheel.install(_wheel(tmp_path / "b.whl", {"pkg/__init__.py": ""}), site)
    assert not (site / "pkg" / "old.py").exists()


@pytest.mark.parametrize(("files", "meta", "needle"), [
    ({"pkg/__init__.py": ""}, WHEEL_META.replace("true", "false"), "not a pure-Python wheel"),
    ({"pkg/__init__.py": "", "demo_pkg-1.0.data/scripts/run": ""}, WHEEL_META, "has a .data directory"),
    ({"../evil.py": ""}, WHEEL_META, "outside"),
])
def test_what_pip_would_install_differently_is_refused(tmp_path: Path, files: dict[str, str], meta: str, needle: str) -> None:
    with pytest.raises(SystemExit, match=needle):
        asv_wheel.install(_wheel(tmp_path / "w.whl", files, wheel_meta=meta), tmp_path / "site")
    assert not (tmp_path / "site" / "pkg").exists()
