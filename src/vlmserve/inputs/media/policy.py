"""Operator-tunable limits for image ingest (immutable, safe to share across threads)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MediaPolicy:
    fetch_timeout: float = 10.0  # seconds; bounds connect AND the whole fetch incl. redirects/body
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 50_000_000
    max_redirects: int = 5
    # Hostnames (exact, case-insensitive) or IPs/CIDRs that may be non-public, e.g.
    # ("127.0.0.1/32", "localhost"). Everything else must resolve to public addresses only.
    allowed_hosts: tuple[str, ...] = ()
    # file:// URLs are refused unless this is set; then only files under its resolved path.
    local_files_root: str | None = None
    # When set, http(s) images come only from these domains or their subdomains (every hop).
    allowed_domains: tuple[str, ...] = ()

    def domain_allowed(self, host: str) -> bool:
        if not self.allowed_domains:
            return True
        host = host.lower().rstrip(".")
        return any(host == d or host.endswith("." + d) for d in (d.lower().strip(".") for d in self.allowed_domains))

    def __post_init__(self) -> None:
        if self.fetch_timeout <= 0 or self.max_image_bytes <= 0 or self.max_image_pixels <= 0:
            raise ValueError("MediaPolicy limits must be positive")
        if self.max_redirects < 0:
            raise ValueError("max_redirects must be >= 0")
        if isinstance(self.allowed_hosts, str):  # a bare string would be iterated per character
            raise TypeError("allowed_hosts must be a tuple of strings")
