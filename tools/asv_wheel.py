"""Install and uninstall this project's (pure-Python) wheel in an asv environment, without pip.

    python tools/asv_wheel.py install path/to/statedict_conformance-*.whl
    python tools/asv_wheel.py uninstall statedict-conformance

``asv continuous --interleave-rounds`` uninstalls one commit's build and installs the other's before
every round; with pip that is two interpreter start-ups of pip's own imports per round (about 1.5 s
of CPU here, a quarter of a regression-gate round). This does the same with the standard library:
``install`` unpacks the wheel into the running interpreter's ``purelib`` (what pip does for a wheel
whose ``Root-Is-Purelib`` is true, console scripts and bytecode aside), ``uninstall`` removes every file
the installed distribution's ``RECORD`` lists, their bytecode, and the directories that leaves empty.
Anything else (a platform wheel, a wheel with ``.data`` or without ``RECORD``) is refused with the reason:
use pip for it. It runs under asv's environment Python, so it imports nothing of this project.
"""

from __future__ import annotations

import csv
import io
import re
import shutil
import sys
import sysconfig
import zipfile
from pathlib import Path

__all__ = ["install", "uninstall", "main"]


def _site() -> Path:
    return Path(sysconfig.get_path("purelib"))


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def install(wheel: str | Path, site: Path | None = None) -> list[str]:
    """Unpack ``wheel`` into ``site`` (default: this interpreter's purelib); return the paths written."""
    site = site or _site()
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = [n for n in names if re.fullmatch(r"[^/]+\.dist-info/WHEEL", n)]
        if len(info) != 1:
            raise SystemExit(f"{wheel}: not a wheel (no single *.dist-info/WHEEL)")
        metadata = archive.read(info[0]).decode()
        if "Root-Is-Purelib: true" not in metadata:
            raise SystemExit(f"{wheel}: not a pure-Python wheel (Root-Is-Purelib is not true): install it with pip")
        if any(re.match(r"[^/]+\.data/", n) for n in names):
            raise SystemExit(f"{wheel}: has a .data directory (scripts, headers or data files): install it with pip")
        for name in names:
            target = (site / name).resolve()
            if site.resolve() not in target.parents:
                raise SystemExit(f"{wheel}: member {name!r} would be written outside {site}")
        archive.extractall(site)
    return names


def uninstall(distribution: str, site: Path | None = None) -> list[str]:
    """Remove the installed ``distribution`` from ``site`` (default: this interpreter's purelib): the files
    of its RECORD, their ``__pycache__`` bytecode, and directories left empty. Returns what was removed
    ([] when it is not installed)."""
    site = site or _site()
    infos = [p for p in site.glob("*.dist-info") if _normalized(p.name.split("-")[0]) == _normalized(distribution)]
    removed: list[str] = []
    for info in infos:
        record = info / "RECORD"
        if not record.is_file():
            raise SystemExit(f"{info}: no RECORD: uninstall it with pip")
        files = [site / row[0] for row in csv.reader(io.StringIO(record.read_text())) if row]
        dirs: set[Path] = set()
        for path in files:
            if path.suffix == ".py":
                for cached in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
                    cached.unlink()
            if path.is_file() or path.is_symlink():
                path.unlink()
                removed.append(str(path.relative_to(site)))
            dirs.update(p for p in path.parents if site in p.parents)
        for directory in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            cache = directory / "__pycache__"
            if cache.is_dir() and not any(cache.iterdir()):
                cache.rmdir()
            if directory.is_dir() and not any(directory.iterdir()):
                directory.rmdir()
        if info.is_dir():
            shutil.rmtree(info)
    return removed


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("install", "uninstall"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    if args[0] == "install":
        install(args[1])
    else:
        uninstall(args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
