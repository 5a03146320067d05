"""kvpush's own exceptions (NIXL's are mapped onto these in nixl_transport), and how often
a warning that repeats is logged."""

from __future__ import annotations


def worth_logging(count: int) -> bool:
    """Log the first ten of a kind, then every thousandth: a flood must not flood the log
    (its counter counts every one)."""
    return count <= 10 or count % 1000 == 0


class KVPushError(Exception):
    """Base of every kvpush error."""


class WireError(KVPushError):
    """A notification or handshake message that does not decode; never fatal to a thread."""


class ConfigError(KVPushError):
    """A configuration value that cannot work."""


class LayoutError(KVPushError):
    """Block ids or regions that do not fit the advertised KV layout."""


class HandshakeError(KVPushError):
    """A peer could not be reached or is not compatible with us."""


class TransportError(KVPushError):
    """A transport operation failed."""


class PeerUnknownError(TransportError):
    """The peer (or an address of it) is not known to the transport."""


class PeerGoneError(TransportError):
    """The peer disconnected or died."""
