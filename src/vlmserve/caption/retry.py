"""What is worth retrying, and how long to wait: exponential backoff with jitter, honouring Retry-After."""

from __future__ import annotations

import email.utils
import random
import time

# 408 request timeout, 409 conflict, 425 too early, 429 rate limited / queue full, any 5xx.
RETRY_STATUSES = frozenset({408, 409, 425, 429})
# The whole run is misconfigured (bad key, wrong model/URL): stop instead of failing every image.
FATAL_STATUSES = frozenset({401, 403, 404})


def is_retriable_status(status: int) -> bool:
    return status in RETRY_STATUSES or status >= 500


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date); None if absent/invalid."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def backoff_delay(
    attempt: int, base: float, cap: float, retry_after: float | None = None, rng: random.Random | None = None
) -> float:
    """Delay before retry number `attempt` (1-based): a random 50-100% of base*2^(attempt-1), capped;
    never less than the server's Retry-After (which is itself capped at 10*cap against silly values)."""
    rng = rng or random
    delay = rng.uniform(0.5, 1.0) * min(cap, base * (2 ** (attempt - 1)))
    if retry_after is not None:
        delay = max(delay, min(retry_after, 10 * cap))
    return delay
