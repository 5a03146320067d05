"""Pools of prefill and decode instances, and how the router picks one of each.

Each instance carries what the background upkeep learnt of it (`upkeep.py`: /health and
/metrics) and what the router saw itself (its own in-flight legs, a circuit breaker over
consecutive leg failures). The choice:

- an instance is *available* when it is healthy (its last /health probes passed), not
  draining, and its breaker lets a request through (closed, or half-open with no probe
  request out yet);
- decoders: the least loaded available one (when none is available: the least loaded
  one not drained, so that one pair keeps working as before pools, see `Pool.choose`);
- prefillers: prefix affinity first. Rendezvous hashing (consistent hashing: each
  instance's rank for a key is a hash of key and URL, so adding or removing one instance
  moves only the keys it wins or held) on the prompt's first characters or token ids
  sends equal prefixes to the same prefiller, whose prefix cache then hits; the first
  available instance in that order is taken unless it is overloaded (its load more than
  `slack` above the least loaded one's, or its KV cache nearly full), then the least
  loaded one.

Load is `max(running + waiting, own in-flight) + kv_weight * kv_usage`: the scraped
counts include other routers' requests, the router's own in-flight legs are fresher than
a scrape.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, Role] = ("prefill", "decode")


@dataclass(frozen=True)
class InstanceSpec:
    """An instance as configured: its base URL, and for a prefiller its side channel
    (sent to D as remote_host/remote_port; None: D's connector default)."""

    role: Role
    url: str
    side_channel: tuple[str, int] | None = None
    drain: bool = False


@dataclass
class Breaker:
    """Consecutive leg failures open it for `cooldown` seconds; then one request may go
    (half-open): its success closes the breaker, its failure opens it again."""

    threshold: int = 3
    cooldown: float = 5.0
    failures: int = 0
    opened_at: float | None = None
    probing: bool = False  # the half-open request is out

    def state(self, now: float | None = None) -> str:
        if self.opened_at is None:
            return "closed"
        now = time.monotonic() if now is None else now
        return "half_open" if now - self.opened_at >= self.cooldown else "open"

    def allows(self) -> bool:
        state = self.state()
        return state == "closed" or (state == "half_open" and not self.probing)

    def started(self) -> None:
        if self.state() == "half_open":
            self.probing = True

    def success(self) -> None:
        self.failures, self.opened_at, self.probing = 0, None, False

    def released(self) -> None:
        """The request ended without a verdict on the instance (cancelled)."""
        self.probing = False

    def failure(self) -> None:
        self.failures += 1
        if self.opened_at is not None or self.failures >= self.threshold:
            self.opened_at = time.monotonic()
        self.probing = False


@dataclass
class Instance:
    spec: InstanceSpec
    breaker: Breaker
    healthy: bool = True  # optimistic until the first probe says otherwise
    health_fails: int = 0
    health_passes: int = 0
    last_health: dict[str, Any] = field(default_factory=dict)
    draining: bool = False
    in_flight: int = 0
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    scraped_at: float | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def role(self) -> Role:
        return self.spec.role

    def available(self) -> bool:
        return self.healthy and not self.draining and self.breaker.allows()

    def load(self, kv_weight: float) -> float:
        return max(self.running + self.waiting, self.in_flight) + kv_weight * self.kv_usage

    def describe(self) -> dict[str, Any]:
        side = self.spec.side_channel
        return {
            "role": self.role,
            "url": self.url,
            "side_channel": f"{side[0]}:{side[1]}" if side else None,
            "available": self.available(),
            "healthy": self.healthy,
            "draining": self.draining,
            "breaker": self.breaker.state(),
            "in_flight": self.in_flight,
            "running": self.running,
            "waiting": self.waiting,
            "kv_usage": self.kv_usage,
            "last_health": self.last_health,
        }


@dataclass(frozen=True)
class Policy:
    breaker_failures: int = 3
    breaker_cooldown: float = 5.0
    kv_weight: float = 4.0
    slack: float = 4.0  # how much busier than the least loaded the affine prefiller may be
    kv_full: float = 0.95  # a KV cache this full counts as overloaded
    affinity_chars: int = 256  # prompt characters (or a tenth of that in token ids) hashed


class Pool:
    """Both roles' instances by URL; changed by config reloads and the admin endpoints."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.instances: dict[Role, dict[str, Instance]] = {"prefill": {}, "decode": {}}
        self._turn = {"prefill": 0, "decode": 0}  # breaks ties between equally loaded ones

    def all(self) -> list[Instance]:
        return [i for role in ROLES for i in self.instances[role].values()]

    def get(self, role: Role, url: str) -> Instance | None:
        return self.instances[role].get(url)

    def add(self, spec: InstanceSpec) -> Instance:
        """Add an instance, or update the side channel / drain flag of the one at its URL
        (keeping what was learnt of it)."""
        old = self.instances[spec.role].get(spec.url)
        breaker = Breaker(self.policy.breaker_failures, self.policy.breaker_cooldown)
        inst = Instance(spec, breaker) if old is None else old
        inst.spec = spec
        inst.draining = spec.drain
        self.instances[spec.role][spec.url] = inst
        return inst

    def remove(self, role: Role, url: str) -> Instance | None:
        """Take an instance out of the pool; requests already on it finish there."""
        return self.instances[role].pop(url, None)

    def replace(self, specs: Iterable[InstanceSpec]) -> None:
        """Make the pool exactly `specs` (a reloaded config file)."""
        wanted = {(s.role, s.url) for s in specs}
        for inst in self.all():
            if (inst.role, inst.url) not in wanted:
                self.remove(inst.role, inst.url)
        for spec in specs:
            self.add(spec)

    def spare(self, role: Role, exclude: set[str]) -> bool:
        """Whether an instance of `role` outside `exclude` could take a retry."""
        return any(not i.draining and i.url not in exclude for i in self.instances[role].values())

    def choose(
        self, role: Role, key: bytes | None = None, exclude: frozenset[str] = frozenset()
    ) -> Instance | None:
        """The instance for the next leg of `role`, or None when none is available."""
        left = [i for i in self.instances[role].values() if i.url not in exclude]
        ready = [i for i in left if i.available()]
        if not ready:
            # None healthy with a closed breaker: try those not drained anyway rather than
            # refuse (one pair then behaves as without pools: a dead instance's leg fails
            # at once with 502; one just back needs no probe round to be used).
            ready = [i for i in left if not i.draining]
        if not ready:
            return None
        weight = self.policy.kv_weight
        least = min(i.load(weight) for i in ready)
        if key is not None:
            for inst in sorted(ready, key=lambda i: _rank(key, i.url)):
                if inst.load(weight) <= least + self.policy.slack and (
                    inst.kv_usage < self.policy.kv_full
                ):
                    return inst
        best = [i for i in ready if i.load(weight) == least]
        self._turn[role] += 1
        return best[self._turn[role] % len(best)]


def _rank(key: bytes, url: str) -> bytes:
    # Highest random weight first: sorting by the negated hash is sorting by the hash.
    digest = hashlib.blake2b(key + b"\0" + url.encode(), digest_size=8).digest()
    return bytes(255 - b for b in digest)


def affinity_key(body: dict[str, Any], chat: bool, chars: int) -> bytes | None:
    """The prompt's beginning, which prefix caching can reuse: the first `chars`
    characters of the prompt (or of the chat messages as JSON), or the first
    `chars // 10` token ids of a token-id prompt. None when there is no prompt."""
    if chars <= 0:
        return None
    if chat:
        messages = body.get("messages")
        if not messages:
            return None
        return _json_prefix(messages, chars).encode()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # several prompts: the first one's beginning
    if isinstance(prompt, str):  # (a lone surrogate is D's to refuse, as a plain server does)
        return prompt[:chars].encode("utf-8", "surrogatepass")
    if isinstance(prompt, list) and prompt:
        return json.dumps(prompt[: max(1, chars // 10)]).encode()
    return None


def _json_prefix(value: Any, chars: int) -> str:
    """The first `chars` characters of ``json.dumps(value, sort_keys=True, default=str)``;
    a list is written item by item only until there are enough (a long chat's every
    message was written for its first 256 characters)."""
    if not isinstance(value, list):
        return json.dumps(value, sort_keys=True, default=str)[:chars]
    parts, size = ["["], 1
    for item in value:
        if size > 1:
            parts.append(", ")  # json.dumps's item separator
            size += 2
        parts.append(json.dumps(item, sort_keys=True, default=str))
        size += len(parts[-1])
        if size >= chars:
            break
    else:
        parts.append("]")
    return "".join(parts)[:chars]


def parse_spec(role: Role, entry: Any) -> InstanceSpec:
    """An instance from a config file or admin request: a URL string, or an object with
    `url` and optionally `side_channel` ("HOST:PORT") and `drain` (bool)."""
    if isinstance(entry, str):
        entry = {"url": entry}
    if not isinstance(entry, dict):
        raise ValueError(f"{role} instance: expected a URL or an object, got {entry!r}")
    unknown = set(entry) - {"url", "side_channel", "drain", "role"}
    if unknown:
        raise ValueError(f"{role} instance: unknown keys {sorted(unknown)}")
    url = entry.get("url")
    if not isinstance(url, str) or not _usable_url(url):
        shown = repr(url)[:200]
        raise ValueError(f"{role} instance: url must be an http(s) URL with a host, got {shown}")
    side = entry.get("side_channel")
    channel = parse_host_port(side) if side is not None else None
    drain = entry.get("drain", False)
    if not isinstance(drain, bool):
        raise ValueError(f"{role} instance {url}: drain must be true or false")
    return InstanceSpec(role, url.rstrip("/"), channel, drain)


def _usable_url(url: str) -> bool:
    """An http(s) URL of printable ASCII with a host and a valid port: anything else would
    fail every request sent to it (a lone surrogate failed the router's own ranking)."""
    if len(url) > 2048 or not url.isascii() or not url.isprintable() or " " in url:
        return False
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError when out of range)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def parse_host_port(value: Any) -> tuple[str, int]:
    """'HOST:PORT' -> (host, port); ValueError otherwise."""
    if not isinstance(value, str):
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    host, sep, port = value.rpartition(":")
    host_ok = bool(host.strip("[]")) and host.isascii() and host.isprintable() and " " not in host
    if not sep or not host_ok or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {value[:200]!r}")
    return host.strip("[]"), int(port)


def parse_pools(data: Any) -> list[InstanceSpec]:
    """A config file's content: {"prefill": [...], "decode": [...]}; ValueError if bad."""
    if not isinstance(data, dict) or set(data) - set(ROLES):
        raise ValueError('expected an object with the keys "prefill" and "decode"')
    specs: list[InstanceSpec] = []
    for role in ROLES:
        entries = data.get(role, [])
        if not isinstance(entries, list):
            raise ValueError(f"{role}: expected a list")
        specs += [parse_spec(role, e) for e in entries]
        urls = [s.url for s in specs if s.role == role]
        if len(urls) != len(set(urls)):
            raise ValueError(f"{role}: the same URL twice")
    return specs
