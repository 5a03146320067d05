"""Sealed ``kv_transfer_params``: the router's own, told apart from a client's.

A client that reaches a prefiller's or decoder's HTTP port directly can send its own
``kv_transfer_params``: P then keeps a finished prompt's blocks for a decoder that never
registers (until its lease ends), D allocates blocks and registers with whatever P they
name. With a params secret (``ENV``, the same on the router, P and D) the router seals
every leg's params with an HMAC of their content, and the connector acts only on sealed
ones: unsealed params are ignored, and the request is served as by a plain server.

A seal covers every key but itself and the connector's own marks (``_kvpush_*``, which D
adds to a request's params after checking them). Sealed params are flat, bounded
scalars: anything else cannot be the router's, so is refused before it is hashed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

from kvpush.core.secret import Secret

ENV = "KVPUSH_PARAMS_SECRET"  # from the environment only: configs end up in logs
KEY = "kvpush_seal"
_MARKS = "_kvpush_"
_DOMAIN = b"kvpush-params-v1\0"  # this MAC is of params, never of a handshake message
_MAX_KEYS = 64
_MAX_CHARS = 1024


def from_env(env: dict[str, str] | None = None) -> Secret | None:
    value = (os.environ if env is None else env).get(ENV)
    return Secret(value) if value else None


def flat(params: dict[str, Any]) -> bool:
    """Whether `params` are what a seal can cover: at most 64 string keys, each value a
    string of at most 1 KiB, a number, a bool or null."""
    if len(params) > _MAX_KEYS:
        return False
    for key, value in params.items():
        if not isinstance(key, str) or len(key) > _MAX_CHARS:
            return False
        if isinstance(value, str):
            if len(value) > _MAX_CHARS:
                return False
        elif value is not None and not isinstance(value, int | float):  # (bool is an int)
            return False
    return True


def seal(params: dict[str, Any], secret: Secret) -> dict[str, Any]:
    """`params` with their seal; raises ValueError for params that are not `flat`."""
    if not flat(params):
        raise ValueError("only flat params of bounded scalars can be sealed")
    return {**params, KEY: _mac(params, secret)}


def sealed(params: dict[str, Any], secret: Secret) -> bool:
    """Whether `params` (untrusted) carry a seal of theirs made with `secret`."""
    got = params.get(KEY)
    if not isinstance(got, str) or len(got) != 64 or not flat(params):
        return False
    try:
        want = _mac(params, secret)
    except ValueError:  # a float JSON cannot write (inf, nan)
        return False
    return hmac.compare_digest(got.encode(), want.encode())


def _mac(params: dict[str, Any], secret: Secret) -> str:
    content = {k: v for k, v in params.items() if k != KEY and not k.startswith(_MARKS)}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hmac.new(secret.reveal(), _DOMAIN + text.encode(), hashlib.sha256).hexdigest()
