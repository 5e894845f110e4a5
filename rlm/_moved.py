"""Old module paths kept importable for one release after issue 27 regrouped rlm/ by concern.

Each old path (``rlm.lightning``, ``rlm.config_merge``, ...) is a two-line module that calls :func:`forward`:
importing it warns once with a DeprecationWarning naming the new path, and every name, private ones
included, is looked up in the new module. So ``class_path: rlm.lightning.LMModule`` in a saved config,
``_class_path`` in a checkpoint's hyperparameters and objects pickled under the old module names still load,
and give the very same classes. Nothing in rlm imports an old path.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def forward(old: str, *new: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Warn that module ``old`` moved to ``new[0]``; the ``__getattr__`` and ``__dir__`` that read the
    ``new`` modules in order."""
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release: it moved to {new[0]}",
        DeprecationWarning,
        stacklevel=3,  # the module that imported the old path (import machinery frames are skipped)
    )

    def __getattr__(name: str) -> Any:
        for target in new:
            module = importlib.import_module(target)
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r} (it moved to {new[0]})")

    def __dir__() -> list[str]:
        return sorted({name for target in new for name in dir(importlib.import_module(target))})

    return __getattr__, __dir__
