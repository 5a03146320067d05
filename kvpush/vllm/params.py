"""A request's ``kv_transfer_params`` are untrusted input: checked here before D acts on them.

Anyone who reaches a decoder's HTTP port can send them (a router strips a client's own, but
vLLM can be reached directly), and D would otherwise handshake with whatever address they
name, for as many ranks as they say. The checks match the wire's (core/wire.py): exact
types (a bool is no int, a str no port), bounded strings, ports in 1..65535, TP and PP sizes
whose ranks kvpush can address (every P rank's side channel is ``port + stage * tp + rank``,
at most ``wire.MAX_TP`` ranks), and nothing nested or oversized. Work is linear in the size
of what is looked at, and nothing looks past the bounds. A violation raises
:class:`BadParams`, which fails that request alone (``PushScheduler.reject``).
"""

from __future__ import annotations

import re
from typing import Any

from kvpush.core.wire import MAX_TP

MAX_KEYS = 64  # a leg carries about ten; more is not a leg from a router
MAX_KEY_CHARS = 64
MAX_NAME_CHARS = 512  # an engine id (wire.Name)
# A transfer or request id: D's key adds ":<prompt>:<sample>" (transfer_key) and must stay
# within wire.Name, or P would drop the registration as undecodable.
MAX_ID_CHARS = 256
MAX_HOST_CHARS = 255  # wire.Host
MAX_OTHER_CHARS = 1024  # a string under a key kvpush does not read
_MAX_MARK_CHARS = 64  # SchedulerSide's marks (a 32-character token)
MAX_OTHER_ITEMS = 1 << 16  # items of a list under a key kvpush does not read (block ids)
# A host name, an IPv4 address or a bracketed IPv6 one (with a zone): what ZMQ's tcp://
# endpoint takes, and nothing of its other syntax ("*", ";", "/", spaces).
_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+(?:%[\w.-]+)?\]")

# The keys kvpush reads on D, and other connectors' keys it leaves alone but still bounds.
_FLAGS = ("do_remote_prefill", "do_remote_decode")
_IDS = ("transfer_id", "remote_request_id")
_SIZES = ("remote_tp_size", "tp_size", "remote_pp_size", "pp_size")


class BadParams(ValueError):
    """``kv_transfer_params`` that D must not act on; the message says which and why."""


def check_recv_params(params: Any, trusted: frozenset[str] | None = None) -> None:
    """Raise :class:`BadParams` unless ``params`` are a well-formed remote-prefill leg:
    ``remote_host`` and ``remote_port`` present, every known key of its type and range,
    every other key a bounded scalar or a bounded flat list; with ``trusted``
    (``trusted_prefillers``), naming one of those side channels."""
    if not isinstance(params, dict):
        raise BadParams(f"kv_transfer_params must be an object, not {type(params).__name__}")
    if len(params) > MAX_KEYS:  # before looking at any of them
        raise BadParams(f"kv_transfer_params have {len(params)} keys (at most {MAX_KEYS})")
    for key in ("remote_host", "remote_port"):
        if params.get(key) is None:
            raise BadParams(f"kv_transfer_params lack the prefiller's side channel ({key})")
    for key, value in params.items():
        if not isinstance(key, str) or len(key) > MAX_KEY_CHARS:
            raise BadParams(f"kv_transfer_params key {_show(key)} is not a short string")
        _check_value(key, value)
    tp = _size(params, "remote_tp_size", "tp_size")
    pp = _size(params, "remote_pp_size", "pp_size")
    if tp * pp > MAX_TP:
        raise BadParams(f"{tp} x {pp} prefiller ranks: kvpush addresses at most {MAX_TP}")
    last = params["remote_port"] + tp * pp - 1  # the side channel of P's last rank
    if last > 65535:
        raise BadParams(f"the prefiller's ranks would listen up to port {last} (> 65535)")
    where = f"{params['remote_host']}:{params['remote_port']}"
    if trusted is not None and where not in trusted:
        raise BadParams(f"kv_transfer_params name {where}, not one of trusted_prefillers")


def _size(params: dict[str, Any], name: str, alias: str) -> int:
    value = params.get(name)
    if value is None:
        value = params.get(alias)
    return 1 if value is None else int(value)


def _check_value(key: str, value: Any) -> None:
    if key in _FLAGS:
        if value is not None and not isinstance(value, bool):
            raise BadParams(f"kv_transfer_params {key} must be true or false, not {_show(value)}")
    elif key.startswith("_kvpush_"):  # the connector's own marks: a short token, or a flag
        if value is not None and not isinstance(value, bool):
            _string(key, value, _MAX_MARK_CHARS, allow_none=False)
    elif key == "remote_engine_id":
        _string(key, value, MAX_NAME_CHARS, allow_none=True)
    elif key in _IDS:
        _string(key, value, MAX_ID_CHARS, allow_none=True)
    elif key == "remote_host":
        _string(key, value, MAX_HOST_CHARS, allow_none=False)
        if not _HOST.fullmatch(value):
            raise BadParams(f"kv_transfer_params remote_host {_show(value)} is not a host")
    elif key == "remote_port":
        _integer(key, value, 1, 65535)
    elif key in _SIZES:
        if value is not None:
            _integer(key, value, 1, MAX_TP)
    else:
        _other(key, value)


def _string(key: str, value: Any, limit: int, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, str) or not 0 < len(value) <= limit:
        raise BadParams(
            f"kv_transfer_params {key} must be a string of 1 to {limit} characters, "
            f"not {_show(value)}"
        )


def _integer(key: str, value: Any, low: int, high: int) -> None:
    if type(value) is not int or not low <= value <= high:  # (bool is an int subclass)
        raise BadParams(
            f"kv_transfer_params {key} must be an integer in [{low}, {high}], not {_show(value)}"
        )


def _other(key: str, value: Any) -> None:
    """A key kvpush does not read (another connector's: remote_block_ids, dcp_size, ...):
    left alone when it is a bounded scalar, or a bounded list of them or of such lists."""
    if _scalar(value):
        return
    if isinstance(value, list) and len(value) <= MAX_OTHER_ITEMS:
        budget = MAX_OTHER_ITEMS
        for item in value:
            if isinstance(item, list):
                budget -= len(item)
                if budget < 0 or not all(_scalar(x) for x in item):
                    break
            elif not _scalar(item):
                break
        else:
            return
    raise BadParams(f"kv_transfer_params {key}: {type(value).__name__} value too large or nested")


def _scalar(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) <= MAX_OTHER_CHARS
    return value is None or isinstance(value, (bool, int, float))


def _show(value: Any) -> str:
    """A short description of an untrusted value for an error message (never its whole)."""
    if isinstance(value, int) and value.bit_length() > 64:  # (no repr of a huge int)
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, (bool, int, float)) or value is None:
        return repr(value)
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else f"a string of {len(value)} characters"
    return f"a {type(value).__name__}"
