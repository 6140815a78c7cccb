"""The one exception type the media layer raises.

`message` is written for the client: it never carries resolved IPs, server paths or exception
text, so the API layer may echo it verbatim. The underlying cause (if any) is chained on
`__cause__` for server-side logs only.
"""

from __future__ import annotations

INVALID_IMAGE_URL = "invalid_image_url"  # could not get the bytes (scheme, host, network, size)
INVALID_IMAGE = "invalid_image"  # got bytes, but they are not an acceptable image


class MediaError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"MediaError({self.code!r}, {self.message!r})"


def url_error(message: str) -> MediaError:
    return MediaError(INVALID_IMAGE_URL, message)


def image_error(message: str) -> MediaError:
    return MediaError(INVALID_IMAGE, message)
