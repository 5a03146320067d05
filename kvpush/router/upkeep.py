"""The router's background work: probing every instance's /health, scraping its
/metrics, and re-reading the pools' config file (when it changes, or on SIGHUP).

None of it runs per request: requests read what these loops last learnt. Every loop
catches and logs its own errors, so none dies silently; each probe and scrape has a
timeout, so one slow instance delays nobody else's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.router import legs
from kvpush.router.config import CONFIG, POOL, SESSION
from kvpush.router.pool import Instance, Pool, parse_pools

log = logging.getLogger(__name__)

# The vLLM gauges load-aware choice reads; summed over their label sets (engines).
_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV_USAGE = "vllm:kv_cache_usage_perc"
_CONFIG_POLL_S = 1.0


async def upkeep_ctx(app: web.Application) -> AsyncIterator[None]:
    """Start the loops with the app, stop them with it."""
    cfg = app[CONFIG]
    if cfg.config_path:
        load_config(app)  # the first read must work: a bad file fails start-up
    tasks = [
        asyncio.create_task(_forever(app, "health", cfg.health_interval, check_health)),
        asyncio.create_task(_forever(app, "scrape", cfg.scrape_interval, scrape_all)),
    ]
    if cfg.config_path:
        tasks.append(asyncio.create_task(_watch_config(app)))
        _on_sighup(app)
    yield
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if cfg.config_path:
        _on_sighup(None)


async def _forever(app: web.Application, what: str, interval: float, step: Any) -> None:
    while True:
        try:
            await step(app)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("router %s loop: step failed (retried next round)", what)
        await asyncio.sleep(interval)


async def check_health(app: web.Application) -> None:
    """Probe every instance once; update who is healthy."""
    pool, cfg = app[POOL], app[CONFIG]
    instances = pool.all()
    results = await asyncio.gather(
        *(legs.probe_health(app[SESSION], i.url, cfg.health_timeout) for i in instances)
    )
    for inst, result in zip(instances, results, strict=True):
        record_health(inst, result, cfg.health_fails, cfg.health_passes)


def record_health(inst: Instance, result: dict[str, Any], fails: int, passes: int) -> None:
    inst.last_health = result
    if result["ok"]:
        inst.health_fails, inst.health_passes = 0, inst.health_passes + 1
        if not inst.healthy and inst.health_passes >= passes:
            inst.healthy = True
            log.warning("%s %s healthy again: back in the pool", inst.role, inst.url)
    else:
        inst.health_passes, inst.health_fails = 0, inst.health_fails + 1
        if inst.healthy and inst.health_fails >= fails:
            inst.healthy = False
            log.warning("%s %s out of the pool: %s", inst.role, inst.url, result)


async def scrape_all(app: web.Application) -> None:
    pool, cfg = app[POOL], app[CONFIG]
    await asyncio.gather(*(_scrape(app, i, cfg.health_timeout) for i in pool.all()))


async def _scrape(app: web.Application, inst: Instance, timeout: float) -> None:
    try:
        async with asyncio.timeout(timeout):
            async with app[SESSION].get(inst.url + "/metrics") as resp:
                if resp.status != 200:
                    return
                text = await resp.text()
    except (TimeoutError, aiohttp.ClientError, OSError, UnicodeDecodeError):
        return  # the health probe decides whether it is gone; the last values stay
    values = parse_load(text)
    inst.running, inst.waiting, inst.kv_usage = values
    inst.scraped_at = asyncio.get_running_loop().time()


def parse_load(text: str) -> tuple[float, float, float]:
    """(running, waiting, kv usage) from a vLLM /metrics page; 0 for what it lacks."""
    sums = {_RUNNING: 0.0, _WAITING: 0.0, _KV_USAGE: 0.0}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            try:
                sums[name] += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return sums[_RUNNING], sums[_WAITING], min(sums[_KV_USAGE], 1.0)


def load_config(app: web.Application) -> None:
    """Read the config file and make the pools what it says plus the instances given on
    the command line; a file that cannot be read or parsed changes nothing."""
    cfg, pool = app[CONFIG], app[POOL]
    assert cfg.config_path
    with open(cfg.config_path, encoding="utf-8") as f:
        data = json.load(f)
    specs = parse_pools(data)
    given = cfg.specs()
    taken = {(s.role, s.url) for s in specs}
    pool.replace([*specs, *(s for s in given if (s.role, s.url) not in taken)])
    log.info("router pools from %s: %s", cfg.config_path, _summary(pool))


def reload_config(app: web.Application) -> bool:
    try:
        load_config(app)
        return True
    except (OSError, ValueError) as exc:
        log.error(
            "router config %s not applied (pools unchanged): %s", app[CONFIG].config_path, exc
        )
        return False


def _summary(pool: Pool) -> str:
    return ", ".join(f"{i.role} {i.url}{' (draining)' if i.draining else ''}" for i in pool.all())


async def _watch_config(app: web.Application) -> None:
    path = app[CONFIG].config_path
    assert path
    seen = _stamp(path)
    while True:
        await asyncio.sleep(_CONFIG_POLL_S)
        now = _stamp(path)
        if now != seen:
            seen = now
            reload_config(app)


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _on_sighup(app: web.Application | None) -> None:
    # Only the main thread's loop may handle signals (not so in some test set-ups).
    loop = asyncio.get_running_loop()
    try:
        if app is None:
            loop.remove_signal_handler(signal.SIGHUP)
        else:
            loop.add_signal_handler(signal.SIGHUP, reload_config, app)
    except (RuntimeError, NotImplementedError, ValueError):
        log.info("router: SIGHUP not handled here; the config file is still polled")
