"""The one rule for commands that write a whole output folder and rename it into place at ``--out``: taken, a new
or empty folder or this command's own earlier output; with ``--force``, a folder holding anything else; never, a
file, a folder holding something the command reads, the current folder or one above it, home, or the root.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from pathlib import Path


def claim_out_dir(
    out: str | os.PathLike,
    *,
    reads: Iterable[str | os.PathLike],
    force: bool,
    own: tuple[str, str] | None = None,
) -> Path:
    """The resolved ``out`` when the command may replace it; else ValueError naming the path, why, and what
    to pass. ``reads``: what the command reads; ``own``: (file, key) marking its earlier output (a JSON object in
    ``file`` with ``key``), replaced without ``force``."""
    path = Path(out).expanduser().resolve()
    said = f"--out {str(out)!r}" + (f" ({path})" if str(path) != str(out) else "")
    new = "choose a new --out folder"
    if path.exists() and not path.is_dir():
        raise ValueError(f"{said} is a file; {new}")
    home, cwd = Path.home().resolve(), Path.cwd().resolve()
    for place, what in ((Path(path.anchor), "the filesystem root"), (home, "your home folder")):
        if path == place:
            raise ValueError(f"{said} is {what}, which is never replaced, even with --force; {new}")
    if cwd.is_relative_to(path):
        where = "is" if path == cwd else "holds"
        raise ValueError(f"{said} {where} the current folder, never replaced, even with --force; {new}")
    for source in reads:
        source = Path(source).expanduser().resolve()
        if source.is_relative_to(path):
            raise ValueError(f"{said} holds {source}, which this command reads: it is never replaced, even "
                             f"with --force; {new} (a new folder inside it is fine)")  # fmt: skip
    entries = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    mine = False  # an earlier output of this command: own[0] holds a JSON object with the key own[1]
    with contextlib.suppress(OSError, ValueError, TypeError):
        mine = own is not None and own[1] in json.loads((path / own[0]).read_text())
    if entries and not force and not mine:
        shown = ", ".join(map(repr, entries[:3])) + (", ..." if len(entries) > 3 else "")
        what = " and is not an earlier output of this command" if own else ""
        raise ValueError(f"{said} exists and is not empty ({shown}){what}; {new}, or pass --force to replace "
                         "it and everything in it")  # fmt: skip
    return path
