"""The on-disk kernel cache: one directory per kernel, published atomically, verified on load.

Layout: $TILECRAFT_CACHE_DIR/v1/<key[:2]>/<key>/ holding kernel.so, device.src, host.src,
params.json, program.tir (the traced IR, for people) and manifest.json (size and sha256 of every
file plus the key's inputs). An entry is written into .staging/ and renamed into place, so
readers never see half an entry; one that fails verification is moved aside and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from tilecraft import env

FORMAT = 1
FILES = ("kernel.so", "device.src", "host.src", "params.json", "program.tir")
log = logging.getLogger("tilecraft.cache")


def root() -> Path:
    return env.cache_dir() / f"v{FORMAT}"


def digest(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def entry_dir(key: str) -> Path:
    return root() / key[:2] / key


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Entry:
    key: str
    path: Path

    def file(self, name: str) -> Path:
        return self.path / name


def verify(path: Path, key: str) -> str | None:
    """None if the entry at `path` is complete and intact, else what is wrong with it."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except FileNotFoundError:
        return "manifest.json is missing"
    except (OSError, ValueError) as e:
        return f"manifest.json is unreadable ({e})"
    if manifest.get("format") != FORMAT or manifest.get("key") != key:
        return "manifest is for another format or key"
    for name in FILES:
        meta = manifest.get("files", {}).get(name)
        p = path / name
        if meta is None or not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != meta["size"]:
            return f"{name} has {p.stat().st_size} bytes, manifest says {meta['size']}"
        if _sha(p) != meta["sha256"]:
            return f"{name} does not match its checksum"
    return None


def _discard(path: Path) -> None:
    """Move a bad entry out of the way first (atomic), then delete it."""
    trash = root() / ".trash" / f"{path.name}-{uuid.uuid4().hex[:8]}"
    trash.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    except OSError:
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


def lookup(key: str, on_corrupt=None) -> Entry | None:
    """The verified entry for `key`, or None. A corrupt entry is logged, removed, and reported to
    `on_corrupt(problem)`; the caller then rebuilds it."""
    path = entry_dir(key)
    if not path.exists():
        return None
    problem = verify(path, key)
    if problem is None:
        return Entry(key, path)
    log.warning("tilecraft: cache entry %s is corrupt (%s); rebuilding it", path, problem)
    if on_corrupt is not None:
        on_corrupt(problem)
    _discard(path)
    return None


def publish(key: str, inputs: dict, write_files) -> Entry:
    """Write an entry via `write_files(staging_dir)` and rename it into place.

    If another process published the same key first, its (verified) entry wins and ours is
    dropped: both callers end up with a good entry.
    """
    final = entry_dir(key)
    staging = root() / ".staging" / f"{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    try:
        write_files(staging)
        files = {}
        for name in FILES:
            p = staging / name
            if not p.is_file():
                p.write_text("")
            files[name] = {"size": p.stat().st_size, "sha256": _sha(p)}
        manifest = {"format": FORMAT, "key": key, "inputs": inputs, "files": files}
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True, default=str))
        for p in staging.iterdir():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        final.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                os.rename(staging, final)
                return Entry(key, final)
            except OSError:
                if final.exists() and verify(final, key) is None:
                    return Entry(key, final)  # someone else won the race with a good entry
                _discard(final)
        raise OSError(f"could not publish cache entry {final}")
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def clear() -> None:
    shutil.rmtree(root(), ignore_errors=True)
