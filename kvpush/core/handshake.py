"""The handshake side channel: each worker serves its agent info over ZMQ.

A peer fetches it (on the writer's background executor, never on the writer
itself), checks compatibility, and the writer then loads the NIXL metadata.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
from typing import Annotated

import msgspec
import zmq

from kvpush.core.errors import HandshakeError, LayoutError
from kvpush.core.layout import KVLayout, Region, check_compatible

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_INFO_BYTES = 64 << 20


class AgentInfo(msgspec.Struct, kw_only=True):
    """What a worker tells peers about itself."""

    protocol_version: int
    engine_id: str
    tp_rank: Annotated[int, msgspec.Meta(ge=0)]
    tp_size: Annotated[int, msgspec.Meta(ge=1)]
    agent_name: str
    nixl_metadata: bytes
    layout: KVLayout
    staging: Region | None = None  # the staging buffer, when the worker has a staging hook
    # What a process on the same host needs to map our KV memory (core/peer_copy.py).
    peer_copy: Annotated[bytes, msgspec.Meta(max_length=1 << 20)] | None = None
    # The name of our completion lane (core/lane.py), when we receive direct copies, and
    # our host (lane.host_identity): lane words go only to peers on the same one.
    lane: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    host_id: Annotated[str, msgspec.Meta(max_length=512)] = ""


class HandshakeRequest(msgspec.Struct, kw_only=True):
    protocol_version: int
    engine_id: str  # the asking engine, for logs
    nonce: Annotated[bytes, msgspec.Meta(max_length=64)] = b""  # fresh per handshake


class HandshakeReply(msgspec.Struct, kw_only=True):
    info: bytes | None = None  # msgpack of AgentInfo, exactly as the MAC covers it
    mac: bytes = b""  # HMAC-SHA256(shared secret, nonce + info) when the server has a secret
    error: str | None = None


def _mac(secret: bytes, nonce: bytes, info: bytes) -> bytes:
    return hmac.new(secret, nonce + info, hashlib.sha256).digest()


_reply_decoder = msgspec.msgpack.Decoder(HandshakeReply)
_info_decoder = msgspec.msgpack.Decoder(AgentInfo)
_request_decoder = msgspec.msgpack.Decoder(HandshakeRequest)
_encoder = msgspec.msgpack.Encoder()


class SideChannelServer:
    """Answers handshake requests with a fixed AgentInfo, on its own thread."""

    def __init__(self, host: str, port: int, info: AgentInfo, secret: bytes | None = None) -> None:
        self._info = _encoder.encode(info)
        self._secret = secret
        self._stop = threading.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        try:
            self._sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            self._sock.close()
            raise HandshakeError(f"cannot bind side channel {host}:{port}: {e}") from e
        self._thread = threading.Thread(target=self._serve, name="kvpush-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                raw = self._sock.recv()
            except zmq.ZMQError as e:
                log.warning("side channel receive failed: %s", e)
                continue
            self._sock.send(_encoder.encode(self._answer(raw)))
        self._sock.close()

    def _answer(self, raw: bytes) -> HandshakeReply:
        try:
            req = _request_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("malformed handshake request rejected: %s", e)
            return HandshakeReply(error=f"malformed request: {e}")
        if req.protocol_version != PROTOCOL_VERSION:
            return HandshakeReply(
                error=f"protocol version {req.protocol_version} != {PROTOCOL_VERSION}"
            )
        log.debug("handshake from engine %s", req.engine_id)
        mac = _mac(self._secret, req.nonce, self._info) if self._secret else b""
        return HandshakeReply(info=self._info, mac=mac)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def fetch_agent_info(
    host: str,
    port: int,
    engine_id: str,
    timeout_s: float,
    local: KVLayout | None = None,
    secret: bytes | None = None,
) -> AgentInfo:
    """Ask a peer's side channel for its AgentInfo; raise HandshakeError on any failure.

    With ``local`` given, the peer's layout must be writable from ours. With ``secret``
    given, the peer must prove it holds the same secret (HMAC over our nonce and its info).
    """
    nonce = os.urandom(16)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_INFO_BYTES)
    try:
        sock.connect(f"tcp://{host}:{port}")
        req = HandshakeRequest(protocol_version=PROTOCOL_VERSION, engine_id=engine_id, nonce=nonce)
        sock.send(_encoder.encode(req))
        if not sock.poll(int(timeout_s * 1000)):
            raise HandshakeError(f"no handshake answer from {host}:{port} in {timeout_s:.1f}s")
        reply = _reply_decoder.decode(sock.recv())
    except zmq.ZMQError as e:
        raise HandshakeError(f"handshake with {host}:{port}: {e}") from e
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HandshakeError(f"malformed handshake reply from {host}:{port}: {e}") from e
    finally:
        sock.close()
    if reply.error is not None or reply.info is None:
        raise HandshakeError(f"{host}:{port} refused the handshake: {reply.error}")
    if secret and not hmac.compare_digest(reply.mac, _mac(secret, nonce, reply.info)):
        raise HandshakeError(f"{host}:{port} failed to prove the shared secret; not trusted")
    try:
        info = _info_decoder.decode(reply.info)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HandshakeError(f"malformed agent info from {host}:{port}: {e}") from e
    if info.protocol_version != PROTOCOL_VERSION:
        raise HandshakeError(
            f"{host}:{port} speaks protocol {info.protocol_version}, we {PROTOCOL_VERSION}"
        )
    if local is not None:
        try:
            check_compatible(local, info.layout)
        except LayoutError as e:
            raise HandshakeError(f"{host}:{port} ({info.engine_id}) is incompatible: {e}") from e
    return info
