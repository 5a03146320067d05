"""kvpush's own exceptions; NIXL's are mapped onto these in nixl_transport."""

from __future__ import annotations


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
