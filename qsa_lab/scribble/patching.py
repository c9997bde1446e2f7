"""The one patch-and-restore helper of the engine adapters: an engine's attributes replaced for one
generation and given back as they were, whatever the generation did.

    with patched() as patch:
        patch.wrap(SomeClass, "step", lambda orig: my_step(orig))    # orig: the attribute as it was
        patch.set(module, "torch", stand_in)
        ...                                                          # every attribute back here

An attribute the owner only inherited (a class's method defined on its base, a bound method of an
instance) is deleted again, not pinned to the value it had: the owner reads it through its base again.
"""
from __future__ import annotations

import contextlib

_INHERITED = object()       # the owner did not define the attribute itself


class Patches:
    """The attributes replaced so far, with what each owner held before."""

    def __init__(self):
        self._saved = []

    def set(self, owner, attr: str, new) -> None:
        self._saved.append((owner, attr, vars(owner).get(attr, _INHERITED)))
        setattr(owner, attr, new)

    def wrap(self, owner, attr: str, wrapper) -> None:
        """Replace `owner.attr` by `wrapper(the attribute as the owner reads it now)`."""
        self.set(owner, attr, wrapper(getattr(owner, attr)))

    def restore(self) -> None:
        """Every attribute back, the last replaced first."""
        while self._saved:
            owner, attr, value = self._saved.pop()
            if value is _INHERITED:
                delattr(owner, attr)
            else:
                setattr(owner, attr, value)


@contextlib.contextmanager
def patched():
    """Patches for the length of a `with` block."""
    patches = Patches()
    try:
        yield patches
    finally:
        patches.restore()
