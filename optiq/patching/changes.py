"""Reversible edits of a namespace, and the sites recipes change: what every patch kind is built from.

Every change is a name bound in a namespace (an instance's ``forward``, a module's function, a registry's key, the
model's attention implementation) together with what was bound there before, so undoing it puts back the very
object that was there."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

_ABSENT = object()


@dataclass
class Change:
    """One reversible edit: ``redo`` makes it, ``undo`` restores what was there before."""

    label: str
    redo: Callable[[], None]
    undo: Callable[[], None]


def set_attribute(owner: Any, name: str, value: Any) -> Change:
    """Bind ``owner.name``; undo restores the owner's own previous binding, or deletes it when there was none (so an
    instance falls back to its class's method again)."""
    before = vars(owner).get(name, _ABSENT)

    def undo():
        if before is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, before)

    return Change(f"{getattr(owner, '__name__', type(owner).__name__)}.{name}", lambda: setattr(owner, name, value),
                  undo)


def set_item(mapping: dict, key: str, value: Any) -> Change:
    before = mapping.get(key, _ABSENT)

    def undo():
        if before is _ABSENT:
            del mapping[key]
        else:
            mapping[key] = before

    return Change(f"registry[{key!r}]", lambda: mapping.__setitem__(key, value), undo)


def together(label: str, changes: list[Change]) -> Change:
    def redo():
        for change in changes:
            change.redo()

    def undo():
        for change in reversed(changes):
            change.undo()

    return Change(label, redo, undo)


@dataclass
class Site:
    """One place a recipe changes: what ran there before, what runs there now, and how to put a callable there.

    For an attention interface, ``original`` and ``replacement`` are (attention function, mask function) pairs."""

    label: str
    original: Any
    replacement: Any
    bind: Callable[[Any], Change]
