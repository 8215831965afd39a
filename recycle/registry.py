"""One kind of registry for the code a drafter format needs, keyed by the format's name.

A format's record (`recycle/formats/NAME.py`) is data: it says which hooks the format has (`hooks`), never where
their code lives. The layer that owns a kind of hook keeps one `Registry` of them and its modules register
themselves with a decorator, so every arrow is an ordinary import pointing down:

    # recycle/drafters/__init__.py
    BUILDERS: Registry[Builder] = Registry("module builder")

    # recycle/drafters/eagle3.py
    @BUILDERS.register("eagle3")
    def build(directory, config, state, dtype, attn_implementation) -> nn.Module: ...

`tests/test_registries.py` resolves every hook every record declares, in the registry that owns it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from recycle.errors import RecycleError

T = TypeVar("T")


class Registry(Generic[T]):
    """Objects of one kind (`what`: "decoding engine", "converter", ...) keyed by format name."""

    def __init__(self, what: str):
        self.what = what
        self._items: dict[str, T] = {}

    def register(self, *names: str) -> Callable[[T], T]:
        """A decorator: `@REG.register("eagle", "eagle3")` files the decorated object under each name."""
        def put(obj: T) -> T:
            for name in names:
                self.add(name, obj)
            return obj
        return put

    def add(self, name: str, obj: T) -> None:
        if name in self._items and self._items[name] is not obj:
            raise ValueError(f"two {self.what}s registered for '{name}'")  # a programming error, not user input
        self._items[name] = obj

    def get(self, name: str, title: str | None = None) -> T:
        """The object registered for a format; a one-line RecycleError where there is none."""
        try:
            return self._items[name]
        except KeyError:
            raise RecycleError(f"{title or name}: recycle has no {self.what} for it") from None

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def names(self) -> tuple[str, ...]:
        return tuple(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}: {', '.join(self._items) or 'empty'})"
