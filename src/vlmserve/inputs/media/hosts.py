"""Which host an image URL is fetched from, and how many fetches each host may hold at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


def remote_host(url: str) -> str | None:
    """The host of an http(s) image URL, lower-cased; None for anything read locally (data:
    URIs, bare base64, file://)."""
    if not isinstance(url, str):
        return None
    head = url.lstrip()[:8].lower()
    if not head.startswith(("http://", "https://")):
        return None
    try:
        return (urlsplit(url.strip()).hostname or "").lower()
    except ValueError:  # a malformed URL: the fetch itself reports it
        return ""


class HostSlots:
    """At most `per_host` fetches in flight per host (the event loop's; no locks needed).

    A host's entry lives only while it has fetches in flight or waiting, so the table holds
    only the hosts being fetched from, not every host ever seen."""

    def __init__(self, per_host: int):
        self.per_host = per_host
        self._hosts: dict[str, list] = {}  # host -> [semaphore, users]

    @contextlib.asynccontextmanager
    async def slot(self, host: str) -> AsyncIterator[None]:
        entry = self._hosts.setdefault(host, [asyncio.Semaphore(self.per_host), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._hosts[host]

    def in_use(self) -> int:
        """Hosts with fetches in flight or waiting."""
        return len(self._hosts)
