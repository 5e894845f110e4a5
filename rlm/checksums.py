"""Folders that carry the size and sha256 of their files in a JSON manifest ``{..., "files": {name: bytes},
"sha256": {name: hex}, "meta_sha256": hex}``, checked on load; the manifest checksums itself too.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

META_SHA = "meta_sha256"  # the manifest's own checksum, of its other keys


def file_sha256(path: Path, chunk: int = 2**24) -> str:
    """sha256 (hex) of a file, read chunk by chunk."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def meta_digest(meta: dict[str, Any]) -> str:
    """sha256 of a manifest's content without its own checksum (keys sorted, compact)."""
    body = {k: v for k, v in meta.items() if k != META_SHA}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(
    folder: Path, meta: dict[str, Any], name: str = "meta.json", names: Iterable[str] | None = None
) -> dict[str, Any]:
    """``meta`` with the size and sha256 of each named file of ``folder`` (default: every file in it but
    the manifest ``name``) and its own checksum, as it will read back from JSON."""
    if names is None:
        names = (p.name for p in folder.iterdir() if p.is_file() and p.name != name)
    names = sorted(names)
    meta = {**meta, "files": {n: (folder / n).stat().st_size for n in names}}
    meta["sha256"] = {n: file_sha256(folder / n) for n in names}
    meta = json.loads(json.dumps(meta, default=str))
    meta[META_SHA] = meta_digest(meta)
    return meta


def read_manifest(path: Path, name: str, what: str, error: type[Exception]) -> dict[str, Any]:
    """The parsed manifest ``path / name``; ``error`` naming it and ``what`` when missing or not JSON."""
    try:
        return json.loads((path / name).read_bytes())
    except FileNotFoundError:
        raise error(
            f"no {what} at {path}: {name} is missing (not one, or its write was interrupted)"
        ) from None
    except ValueError as err:  # not JSON, or not UTF-8
        raise error(f"damaged {what} at {path}: {name} is not valid JSON ({err})") from None


def check_sealed(
    path: Path,
    meta: dict[str, Any],
    name: str,
    what: str,
    remedy: str,
    error: type[Exception],
    verify: bool | None = None,
    unsealed_ok: bool = False,
    only: str | None = None,
) -> None:
    """Raise ``error`` ("damaged {what} at {path}: ...; {remedy}") when the manifest was edited, or a file
    it lists (``only`` that one) is missing, of another size or (``verify``) of another checksum.
    ``unsealed_ok``: a manifest without its own checksum passes."""
    if META_SHA not in meta and not unsealed_ok or META_SHA in meta and meta_digest(meta) != meta[META_SHA]:
        raise error(
            f"damaged {what} at {path}: {name} was changed after it was written (its checksum does not match), "
            f"so nothing it records can be trusted; {remedy}"
        )
    for file, size in (meta.get("files") or {}).items():
        if only is not None and file != only:
            continue
        actual = (path / file).stat().st_size if (path / file).is_file() else None
        if actual is None:
            raise error(f"damaged {what} at {path}: {file} is missing; {remedy}")
        if actual != size:
            raise error(f"damaged {what} at {path}: {file} is {actual} bytes, {name} says {size}; {remedy}")
    if verify is None:  # sizes are checked always, checksums unless RLM_INDEX_VERIFY=0
        verify = os.environ.get("RLM_INDEX_VERIFY", "1").lower() not in ("0", "false", "no")
    if verify:
        for file, digest in (meta.get("sha256") or {}).items():
            if (only is None or file == only) and file_sha256(path / file) != digest:
                raise error(
                    f"damaged {what} at {path}: {file} does not match its checksum in {name} "
                    f"({remedy}; RLM_INDEX_VERIFY=0 skips this check)"
                )
