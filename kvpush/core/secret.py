"""The shared secret, wrapped so that no repr, str, format or log line can show it."""

from __future__ import annotations

import hmac

MIN_ADVISED_BYTES = 16  # shorter secrets work, with a warning: they can be guessed offline


class Secret:
    """Bytes that print as ``Secret(<hidden>)``; ``reveal()`` is the only way to the value."""

    __slots__ = ("_value",)

    def __init__(self, value: bytes | str) -> None:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        if not raw:
            raise ValueError("an empty shared secret is no secret")
        self._value = raw

    def reveal(self) -> bytes:
        return self._value

    def __len__(self) -> int:
        return len(self._value)

    def __repr__(self) -> str:
        return "Secret(<hidden>)"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Secret):
            other = other._value
        if not isinstance(other, bytes):
            return NotImplemented
        return hmac.compare_digest(self._value, other)

    def __hash__(self) -> int:
        return hash(("kvpush-secret", self._value))


def as_secret(value: Secret | bytes | str | None) -> Secret | None:
    """None for no (or an empty) secret, else the value as a Secret."""
    if value is None or isinstance(value, Secret):
        return value
    return Secret(value) if value else None
