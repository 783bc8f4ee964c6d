"""Hard-link into one virtualenv the distributions of a lock that another already holds at the same version.

    python scripts/share_dists.py FROM_VENV TO_VENV LOCK

scripts/setup.sh runs it before installing .venv-vllm: that environment shares ~90 of its ~175
pinned distributions with .venv at the same version, among them ~2 GB of CUDA libraries that both
torch builds load (nvidia-cublas, -cuda-runtime, -cusparselt, ...). A hard link costs no space and
stays valid whatever later happens to the other venv (pip removes files, it never rewrites them).
pip then finds those distributions installed and downloads only the rest. Console scripts are not
linked (their shebang names the other venv's Python). Standard library only: runs before any venv.
"""

from __future__ import annotations

import csv
import errno
import os
import re
import shutil
import sys
from pathlib import Path


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(lock: Path) -> dict[str, str]:
    """`name==version` lines of a lock, by normalized name."""
    pins = {}
    for line in lock.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;#]+)", line)
        if match:
            pins[normalize(match.group(1))] = match.group(2)
    return pins


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise SystemExit(f"no site-packages under {venv}")
    return found[0]


def installed(site: Path) -> dict[str, tuple[str, Path]]:
    """(version, dist-info folder) of every distribution installed in `site`, by normalized name."""
    dists = {}
    for info in site.glob("*.dist-info"):
        name, version = None, None
        try:
            with open(info / "METADATA", encoding="utf-8", errors="replace") as handle:
                for line in handle:
                    if line.startswith("Name:"):
                        name = line.split(":", 1)[1].strip()
                    elif line.startswith("Version:"):
                        version = line.split(":", 1)[1].strip()
                    if (name and version) or not line.strip():
                        break
        except OSError:
            continue
        if name and version:
            dists[normalize(name)] = (version, info)
    return dists


def link(source: Path, target: Path) -> int:
    """Hard-link (or, across file systems, copy) one file; the bytes it saved."""
    if target.exists():
        return 0
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
        return source.stat().st_size
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        shutil.copy2(source, target)
        return 0


def share(source_venv: Path, target_venv: Path, lock: Path) -> tuple[list[str], int]:
    """Link every distribution pinned in `lock` that `source_venv` holds at that version and
    `target_venv` lacks; the names linked and the bytes saved."""
    source_site, target_site = site_packages(source_venv), site_packages(target_venv)
    have, there = installed(source_site), installed(target_site)
    shared, saved = [], 0
    for name, version in sorted(pinned(lock).items()):
        if name in there or have.get(name, ("", None))[0] != version:
            continue
        info = have[name][1]
        with open(info / "RECORD", newline="", encoding="utf-8") as handle:
            paths = [row[0] for row in csv.reader(handle) if row]
        for relative in paths:
            path = (source_site / relative).resolve()
            if source_site.resolve() not in path.parents or not path.is_file():
                continue  # console scripts (bin/) and files another install removed
            saved += link(path, target_site / path.relative_to(source_site.resolve()))
        shared.append(f"{name}=={version}")
    return shared, saved


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise SystemExit(__doc__)
    source, target, lock = (Path(a) for a in argv)
    if not source.is_dir():
        print(f"[share_dists] {source} does not exist: nothing to share")
        return
    shared, saved = share(source, target, lock)
    print(f"[share_dists] {len(shared)} distributions hard-linked from {source.name}: {saved / 2**30:.2f} GiB not downloaded")


if __name__ == "__main__":
    main(sys.argv[1:])
