"""`Registry`: the names a config key accepts for one extension point, each mapped to its entry.

The extension points declare one registry each, beside their interface, and register their built-ins in the same
module:

* attention backends: :data:`dsv4.model.attention_backend.ATTENTION_BACKENDS` (``model.attention_backend``),
* MoE token dispatchers: :data:`dsv4.parallel.dispatch.DISPATCHER_REGISTRY` (``dispatcher``),
* document sources: :data:`dsv4.data.sources.DATA_SOURCES` (``data.kind``).

Code that validates or resolves a name asks the registry; no other place lists the names. Adding an implementation
is one module plus one ``register`` call (``docs/extending.md``)::

    ATTENTION_BACKENDS.register("mine", AttentionBackend(attention=lambda: my_kernel))

    @DATA_SOURCES.register("mine")          # decorator form: registers and returns the object
    ...

Invariants:

* a name is a non-empty string, registered at most once: registering a taken name raises ``ValueError`` (to
  replace an entry, ``unregister`` it first);
* names in ``reserved`` (config values that are policies, not entries, such as ``auto``) cannot be registered;
* ``names()`` is in registration order, the order error messages list and policies such as ``auto`` walk;
* ``get``/``check`` of an unknown name raise ``ValueError`` naming the config key, the bad name and the valid
  names; nothing else in the registry raises for an unknown name.

Entries are whatever the extension point declares (a frozen dataclass each); an entry whose implementation needs
an optional dependency imports it inside its own callables, so registering it never imports the dependency.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, Sequence, TypeVar, overload

E = TypeVar("E")

DEFAULT_UNKNOWN = "`{key}`: unknown {kind} {name!r}; expected one of {choices}"


class Registry(Generic[E]):
    """Name -> entry for the extension point selected by config key ``key``.

    Args:
        key: the config key whose value is a name here (``"dispatcher"``, ``"data.kind"``), named by every error.
        kind: what an entry is, in words (``"MoE dispatcher"``), for error messages.
        reserved: config values that are not entries (``("auto",)``): they cannot be registered.
        unknown: the unknown-name message, a ``str.format`` template over ``key``, ``kind``, ``name``, ``choices``
            (the valid names joined by ", ") and ``names`` (the tuple); default :data:`DEFAULT_UNKNOWN`.
    """

    def __init__(self, key: str, kind: str, *, reserved: Sequence[str] = (), unknown: str = DEFAULT_UNKNOWN) -> None:
        self.key, self.kind, self.unknown = key, kind, unknown
        self.reserved = tuple(reserved)
        self._entries: dict[str, E] = {}

    # ------------------------------------------------------------------------------------------- registration

    @overload
    def register(self, name: str) -> Callable[[E], E]: ...

    @overload
    def register(self, name: str, entry: E) -> E: ...

    def register(self, name: str, entry: E | None = None):
        """Register ``entry`` under ``name`` and return it; without ``entry``, a decorator that does so."""
        if entry is None:
            return lambda obj: self.register(name, obj)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{type(self).__name__}({self.key!r}): a name must be a non-empty string, got {name!r}")
        if name in self._entries:
            raise ValueError(f"`{self.key}`: {self.kind} {name!r} is already registered (unregister it first)")
        if name in self.reserved:
            raise ValueError(f"`{self.key}`: {name!r} is reserved (a policy over the registered {self.kind}s)")
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> E:
        """Remove ``name`` and return its entry (tests undo their registrations with it)."""
        self.get(name)
        return self._entries.pop(name)

    # ---------------------------------------------------------------------------------------------- lookup

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)

    def get(self, name: str) -> E:
        """The entry called ``name``; ``ValueError`` naming the key, ``name`` and the valid names otherwise."""
        if not isinstance(name, str) or name not in self._entries:
            raise self._unknown(name, self.names())
        return self._entries[name]

    def check(self, name: str, *, allow: Sequence[str] = ()) -> str:
        """``name`` if it is registered or one of ``allow`` (e.g. the ``reserved`` policies a config value may also
        take), else the ``ValueError`` of :meth:`get`, listing ``allow`` first."""
        if isinstance(name, str) and (name in allow or name in self._entries):
            return name
        raise self._unknown(name, (*allow, *self.names()))

    def _unknown(self, name: object, valid: tuple[str, ...]) -> ValueError:
        return ValueError(self.unknown.format(key=self.key, kind=self.kind, name=name, choices=", ".join(valid),
                                              names=valid))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.key!r}: {', '.join(self._entries)})"
