"""The edge that reads: each pod's (and each router's) ``/metrics``, over HTTP, with a deadline.

Every GET has a total deadline (``SCRAPE_TIMEOUT_S``: connect, headers and body together) and a
size bound, and at most ``MAX_PARALLEL`` run at once; a pod that does not answer in time, answers an
error or unreadable text is left out of this scrape (``inputs`` then counts only the pods that
answered; a role none of whose pods answered reports nothing and holds). Nothing here decides.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping

import aiohttp

from pdfleet_operator.autoscale.sources import PodSample, parse_sample

__all__ = ["MAX_BODY_BYTES", "MAX_PARALLEL", "SCRAPE_TIMEOUT_S", "Scraper"]

SCRAPE_TIMEOUT_S = 2.0
MAX_BODY_BYTES = 4 << 20
MAX_PARALLEL = 32


class Scraper:
    """One HTTP session for the operator's scrapes (made on first use, on the running loop)."""

    def __init__(self, timeout_s: float = SCRAPE_TIMEOUT_S, parallel: int = MAX_PARALLEL) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._slots = asyncio.Semaphore(parallel)
        self._session: aiohttp.ClientSession | None = None

    async def _get(self, url: str) -> PodSample | None:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        async with self._slots:
            try:
                async with self._session.get(url, allow_redirects=False) as resp:
                    if resp.status != 200:
                        return None
                    body = await resp.content.read(MAX_BODY_BYTES + 1)
                    if len(body) > MAX_BODY_BYTES:
                        return None
                return parse_sample(body.decode("utf-8", errors="replace"))
            except (aiohttp.ClientError, TimeoutError, ValueError, UnicodeError):
                return None

    async def scrape(self, targets: Iterable[tuple[str, str]]) -> Mapping[str, PodSample]:
        """``(name, url)`` pairs -> the samples of those that answered in time."""
        pairs = list(targets)
        got = await asyncio.gather(*(self._get(url) for _, url in pairs))
        return {name: s for (name, _), s in zip(pairs, got, strict=True) if s is not None}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
