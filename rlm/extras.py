"""Optional dependencies, imported with an error that names the extra installing them (``hf``, ``plots``,
``eval``, ``gpu``); the core, training on local text, needs none.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(ModuleNotFoundError):
    """An optional dependency is not installed; the message says which extra installs it."""


def require(module: str, extra: str, purpose: str, alternative: str = "") -> ModuleType:
    """Import ``module``, or raise :class:`MissingExtra` naming ``pip install 'rlm[extra]'`` (and an alternative)."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        if err.name is not None and err.name.split(".")[0] != module.split(".")[0]:
            raise  # the package is there but one of its own imports failed: show that error as it is
        raise MissingExtra(
            f"{purpose} needs the {module.split('.')[0]!r} package, which is not installed: "
            f"pip install 'rlm[{extra}]'" + (f" ({alternative})" if alternative else ""),
            name=module,
        ) from err
