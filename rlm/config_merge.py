"""Deprecated: moved to :mod:`rlm.cli.merge` (issue 27), a shim for one release (rlm/_moved.py)."""

from rlm._moved import forward

__getattr__, __dir__ = forward(__name__, "rlm.cli.merge")
