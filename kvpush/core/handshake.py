"""The handshake side channel: each worker serves its agent info over TCP, one
length-prefixed message each way per round trip (core/frames.py).

A peer fetches it (on the peer table's background pool, never on the ticking
thread), checks compatibility, and the next tick then loads the NIXL metadata.

The info is what it takes to WRITE into this worker's KV memory (NIXL metadata)
or to map it (CUDA IPC handles), so with a shared secret nothing of it leaves
before both sides proved the secret, in two round trips on one connection:

1. client: ``hello``            server: a fresh challenge (32 bytes: its expiry,
                                random bytes and the server's own MAC over both;
                                expires after CHALLENGE_TTL_S, single-use)
2. client: ``proof`` = its own nonce, its agent name and
   HMAC(secret, "client", challenge, nonce, agent, engine)
                                server: checks the proof, consumes the challenge,
                                then answers the info, enciphered, with
                                HMAC(secret, "server", nonce, challenge, ciphertext)

Each MAC names the protocol version and its direction, so neither a replayed nor
a reflected message proves anything. The server keeps no state per ``hello``: the
challenge carries its own expiry under a MAC with a key of the server's own, and only
challenges answered with a valid proof are remembered (until they expire), so a flood of
anonymous ``hello``s can neither grow memory nor evict an honest client's challenge.
Anything else gets a short refusal naming its cause, with nothing of the info, and is
counted by cause (``refused``). The agent names that proved the secret are reported
(``on_client``): the worker acts on NIXL notifications only from those. Without a
secret the info is served at once to anyone, as before, and a warning says so at
start-up.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Annotated

import msgspec

from kvpush.core import frames
from kvpush.core.errors import HandshakeError, worth_logging
from kvpush.core.layout import KVLayout
from kvpush.core.secret import Secret, as_secret

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 3
MAX_INFO_BYTES = 64 << 20
NONCE_BYTES = 32
MAX_REQUEST_BYTES = 4096  # a request is ~200 bytes; larger ones are refused unread
CHALLENGE_TTL_S = 10.0
_STAMP = 8  # a challenge: its expiry (ms, big-endian), random bytes, the server's tag
_TAG = 8
CAUSES = ("malformed", "oversized", "version", "no_secret", "bad_mac", "replay")
_SHORT = {
    "malformed": "malformed request",
    "oversized": "request too large",
    "version": f"protocol version not supported (this side speaks {PROTOCOL_VERSION})",
    "no_secret": "this side channel requires the shared secret (KVPUSH_SHARED_SECRET)",
    "bad_mac": "the shared secret does not match",
    "replay": "unknown, used or expired challenge",
}


class AgentInfo(msgspec.Struct, kw_only=True):
    """What a worker tells peers about itself."""

    protocol_version: int
    engine_id: str
    tp_rank: Annotated[int, msgspec.Meta(ge=0)]
    tp_size: Annotated[int, msgspec.Meta(ge=1)]
    agent_name: str
    nixl_metadata: bytes
    layout: KVLayout
    # What a process on the same host needs to map our KV memory (core/peer_copy.py).
    peer_copy: Annotated[bytes, msgspec.Meta(max_length=1 << 20)] | None = None
    # The name of our completion lane (core/lane.py), when we receive direct copies, and
    # our host (lane.host_identity): lane words go only to peers on the same one.
    lane: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    host_id: Annotated[str, msgspec.Meta(max_length=512)] = ""


class HandshakeRequest(msgspec.Struct, kw_only=True):
    protocol_version: int
    engine_id: Annotated[str, msgspec.Meta(max_length=256)]  # the asking engine, for logs
    nonce: Annotated[bytes, msgspec.Meta(max_length=64)] = b""  # the client's, fresh
    step: str = ""  # "hello" or "proof" (version 1 had a single step)
    agent: Annotated[str, msgspec.Meta(max_length=256)] = ""  # the client's NIXL agent
    challenge: Annotated[bytes, msgspec.Meta(max_length=64)] = b""  # the server's, answered
    mac: Annotated[bytes, msgspec.Meta(max_length=64)] = b""


class HandshakeReply(msgspec.Struct, kw_only=True):
    # The fields of version 1 first: a version-1 client decodes a refusal as one.
    info: bytes | None = None  # msgpack of AgentInfo (enciphered with a secret)
    mac: bytes = b""
    error: str | None = None
    challenge: bytes = b""


_reply_decoder = msgspec.msgpack.Decoder(HandshakeReply)
_info_decoder = msgspec.msgpack.Decoder(AgentInfo)
_request_decoder = msgspec.msgpack.Decoder(HandshakeRequest)
_encoder = msgspec.msgpack.Encoder()


def _mac(secret: Secret, direction: str, *parts: bytes | str) -> bytes:
    # msgpack of the list: an unambiguous encoding of every part.
    msg = _encoder.encode([f"kvpush-handshake/{PROTOCOL_VERSION}/{direction}", *parts])
    return hmac.new(secret.reveal(), msg, hashlib.sha256).digest()


def _cipher(secret: Secret, challenge: bytes, nonce: bytes, data: bytes) -> bytes:
    """XOR with a SHAKE-256 keystream of (secret, both nonces): the info is not readable
    on the wire either. Its own inverse; every exchange has a fresh challenge."""
    seed = _encoder.encode([f"kvpush-handshake/{PROTOCOL_VERSION}/stream", challenge, nonce])
    stream = hashlib.shake_256(secret.reveal() + seed).digest(len(data))
    n = len(data)
    return (int.from_bytes(data, "little") ^ int.from_bytes(stream, "little")).to_bytes(n, "little")


class AgentSet:
    """Agent names that proved the secret; bounded (oldest forgotten), any thread."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self._names: OrderedDict[str, None] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def add(self, name: str) -> None:
        with self._lock:
            self._names[name] = None
            self._names.move_to_end(name)
            while len(self._names) > self._limit:
                self._names.popitem(last=False)

    def __contains__(self, name: object) -> bool:
        return name in self._names


class SideChannelServer:
    """Answers handshake requests with a fixed AgentInfo, on its own thread."""

    def __init__(
        self,
        host: str,
        port: int,
        info: AgentInfo,
        secret: Secret | bytes | str | None = None,
        on_client: Callable[[str], None] | None = None,
    ) -> None:
        self._info = _encoder.encode(info)
        self._secret = as_secret(secret)
        self._on_client = on_client
        self._key = os.urandom(32)  # tags this server's challenges; never leaves it
        # Challenges answered with a valid proof, until they expire: single use.
        self._used: OrderedDict[bytes, float] = OrderedDict()
        # Fixed keys: other threads may copy these while the server counts.
        self.refused: dict[str, int] = dict.fromkeys(CAUSES, 0)
        self.served = 0
        try:
            sock = frames.listen(host, port)
        except OSError as e:
            raise HandshakeError(f"cannot bind side channel {host}:{port}: {e}") from e
        if self._secret is None:
            log.warning(
                "kvpush side channel %s:%d has no shared secret: any process that can reach "
                "it obtains this worker's NIXL metadata (write access to its KV memory) and "
                "CUDA IPC handles. Set KVPUSH_SHARED_SECRET on every server, bind to loopback "
                "or a private address, and list trusted_decoders (README, Trust).",
                host,
                port,
            )
        elif len(self._secret) < 16:
            log.warning("the kvpush shared secret is shorter than 16 bytes: easy to guess")
        self._frames = frames.FrameServer(
            sock, self._serve_one, self._oversized, MAX_REQUEST_BYTES, "kvpush-side-channel"
        )

    @property
    def running(self) -> bool:
        """False once the serving thread has exited; the worker checks it each step."""
        return self._frames.running

    @property
    def dropped(self) -> dict[str, int]:
        """Connections the server closed, by cause: ``idle`` (nothing sent for
        frames.IDLE_S), ``crowded`` (the one idle longest, for a new one)."""
        return self._frames.closed

    def counts(self) -> dict[str, int]:
        """``handshake_refused_<cause>`` and ``handshake_dropped_<cause>`` (a snapshot's)."""
        refused = {f"handshake_refused_{k}": v for k, v in self.refused.items()}
        return refused | {f"handshake_dropped_{k}": v for k, v in self.dropped.items()}

    def _serve_one(self, request: bytes) -> bytes:
        try:
            reply = self._answer(request)
        except Exception:  # a bug answering one request must not stop the server
            log.exception("side channel: answering a request failed")
            reply = HandshakeReply(error="internal error")
        return _encoder.encode(reply)

    def _oversized(self, size: int) -> bytes:
        return _encoder.encode(self._refuse("oversized", f"{size} bytes"))

    def _answer(self, request: bytes) -> HandshakeReply:
        try:
            req = _request_decoder.decode(request)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return self._refuse("malformed", str(e))
        who = f"engine {req.engine_id!r} agent {req.agent!r}"
        if req.protocol_version != PROTOCOL_VERSION:
            return self._refuse("version", f"{who} speaks {req.protocol_version}")
        if req.step not in ("hello", "proof"):
            return self._refuse("malformed", f"{who}: step {req.step!r}")
        if self._secret is None:  # as before the secret existed: anyone is served
            self.served += 1
            return HandshakeReply(info=self._info)
        if req.step == "hello":
            return HandshakeReply(challenge=self._new_challenge())
        expires = self._expiry(req.challenge)
        if expires is None or expires < time.monotonic() or req.challenge in self._used:
            return self._refuse("replay", who)
        if len(req.nonce) != NONCE_BYTES:
            return self._refuse("malformed", f"{who}: nonce of {len(req.nonce)} bytes")
        if not req.mac:
            return self._refuse("no_secret", who)
        want = _mac(self._secret, "client", req.challenge, req.nonce, req.agent, req.engine_id)
        if not hmac.compare_digest(req.mac, want):
            return self._refuse("bad_mac", who)
        self._use(req.challenge, expires)
        if self._on_client is not None and req.agent:
            self._on_client(req.agent)
        self.served += 1
        log.debug("handshake: served %s", who)
        body = _cipher(self._secret, req.challenge, req.nonce, self._info)
        mac = _mac(self._secret, "server", req.nonce, req.challenge, body)
        return HandshakeReply(info=body, mac=mac)

    def _tag(self, head: bytes) -> bytes:
        return hmac.new(self._key, head, hashlib.sha256).digest()[:_TAG]

    def _new_challenge(self) -> bytes:
        ms = int((time.monotonic() + CHALLENGE_TTL_S) * 1000)
        head = ms.to_bytes(_STAMP, "big") + os.urandom(NONCE_BYTES - _STAMP - _TAG)
        return head + self._tag(head)

    def _expiry(self, challenge: bytes) -> float | None:
        """When a challenge of ours expires (monotonic seconds); None if not ours."""
        if len(challenge) != NONCE_BYTES:
            return None
        head, tag = challenge[:-_TAG], challenge[-_TAG:]
        if not hmac.compare_digest(tag, self._tag(head)):
            return None
        return int.from_bytes(head[:_STAMP], "big") / 1000

    def _use(self, challenge: bytes, expires: float) -> None:
        """Spend a proven challenge: only a holder of the secret adds here, once per
        handshake, and entries leave as they expire (one TTL for all: in order)."""
        now = time.monotonic()
        used = self._used
        while used and next(iter(used.values())) < now:
            used.popitem(last=False)
        used[challenge] = expires

    def _refuse(self, cause: str, detail: str) -> HandshakeReply:
        self.refused[cause] += 1
        n = self.refused[cause]
        if worth_logging(n):
            log.warning("handshake refused (%s, #%d): %s", cause, n, detail[:200])
        return HandshakeReply(error=_SHORT[cause])

    def close(self) -> None:
        self._frames.close()


def fetch_agent_info(
    host: str,
    port: int,
    engine_id: str,
    timeout_s: float,
    secret: Secret | bytes | str | None = None,
    agent: str = "",
) -> AgentInfo:
    """Ask a peer's side channel for its AgentInfo; raise HandshakeError on any failure.

    Layouts are checked by the caller, per direction. With ``secret``
    given, both sides prove they hold it before the info is sent (``agent``, our NIXL
    agent's name, is what the peer then hears notifications from), and a peer that
    does not prove it is not trusted.
    """
    key = as_secret(secret)
    where = f"{host}:{port}"
    deadline = time.monotonic() + timeout_s
    family, sockaddr = _resolve(host, port, where)
    try:
        sock = frames.connect(sockaddr, family, deadline)
    except frames.FrameError as e:
        raise _failed(e, where, timeout_s) from e
    try:
        hello = HandshakeRequest(
            protocol_version=PROTOCOL_VERSION, engine_id=engine_id, agent=agent, step="hello"
        )
        first = _ask(sock, hello, deadline, where, timeout_s)
        if first.info is not None:  # a server without a secret serves at once
            if key is not None:
                raise HandshakeError(f"{where} does not prove the shared secret; not trusted")
            raw = first.info
        else:
            if len(first.challenge) != NONCE_BYTES:
                raise HandshakeError(f"malformed handshake challenge from {where}")
            nonce = os.urandom(NONCE_BYTES)
            challenge = first.challenge
            mac = b"" if key is None else _mac(key, "client", challenge, nonce, agent, engine_id)
            proof = msgspec.structs.replace(
                hello, step="proof", nonce=nonce, challenge=challenge, mac=mac
            )
            second = _ask(sock, proof, deadline, where, timeout_s)
            if second.info is None:
                raise HandshakeError(f"{where} sent no agent info")
            if key is None:
                raise HandshakeError(f"{where} requires a shared secret; none configured")
            want = _mac(key, "server", nonce, first.challenge, second.info)
            if not hmac.compare_digest(second.mac, want):
                raise HandshakeError(f"{where} failed to prove the shared secret; not trusted")
            raw = _cipher(key, first.challenge, nonce, second.info)
    finally:
        sock.close()
    try:
        info = _info_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HandshakeError(f"malformed agent info from {where}: {e}") from e
    if info.protocol_version != PROTOCOL_VERSION:
        theirs = info.protocol_version
        raise HandshakeError(f"{where} speaks protocol {theirs}, we {PROTOCOL_VERSION}")
    return info


def _resolve(host: str, port: int, where: str) -> tuple[int, tuple[object, ...]]:
    """``host`` as a numeric address (family and socket address), resolved here, on the
    caller's thread (a handshake pool thread, never the engine's)."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        infos = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise HandshakeError(f"cannot resolve {where}: {e}") from e
    if not infos:
        raise HandshakeError(f"cannot resolve {where}: no address")
    return int(infos[0][0]), tuple(infos[0][4])


def _failed(e: frames.FrameError, where: str, timeout_s: float) -> HandshakeError:
    if isinstance(e, frames.FrameTimeout):
        return HandshakeError(f"no handshake answer from {where} in {timeout_s:.1f}s")
    return HandshakeError(f"handshake with {where}: {e}")


def _ask(
    sock: socket.socket, req: HandshakeRequest, deadline: float, where: str, timeout_s: float
) -> HandshakeReply:
    """One round trip; raises HandshakeError for no answer in time, garbage or a refusal."""
    try:
        frames.send(sock, _encoder.encode(req), deadline)
        answer = frames.receive(sock, MAX_INFO_BYTES, deadline)
    except frames.FrameError as e:
        raise _failed(e, where, timeout_s) from e
    try:
        reply = _reply_decoder.decode(answer)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HandshakeError(f"malformed handshake reply from {where}: {e}") from e
    if reply.error is not None:
        raise HandshakeError(f"{where} refused the handshake: {reply.error}")
    return reply
