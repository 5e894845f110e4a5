"""Which keys differ between the config a checkpoint was written under and this run's."""

from __future__ import annotations

from typing import Any

from rlm.plugin.registry import full_specs, plain


def dict_diff(saved: Any, current: Any, prefix: str = "") -> list[str]:
    """``key: a -> b`` for every dotted key whose value differs between two nested configs."""
    if isinstance(saved, dict) and isinstance(current, dict) and saved and current:
        out = []
        for key in sorted(set(saved) | set(current), key=str):
            out += dict_diff(saved.get(key), current.get(key), f"{prefix}{key}.")
        return out
    if plain(saved) != plain(current):
        return [f"{prefix.rstrip('.')}: checkpoint has {saved!r}, this run has {current!r}"]
    return []


def config_diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between two LMModule hyperparameter dicts in the parts that shape the model."""
    diffs = []
    for key in ("model", "plugins"):
        if key in saved:
            old, new = saved[key], current.get(key)
            if key == "plugins":  # None and {} alike; options left at their defaults count as given
                old, new = full_specs(old), full_specs(new)
            diffs += dict_diff({key: _normalise(old)}, {key: _normalise(new)})
    return diffs


def _normalise(value: Any) -> Any:
    """Plain containers for comparing configs (tuples and lists alike, disabled plugins dropped)."""
    if isinstance(value, dict):
        return {k: _normalise(v) for k, v in value.items() if v is not None and v is not False}
    if isinstance(value, list | tuple):
        return [_normalise(v) for v in value]
    return value
