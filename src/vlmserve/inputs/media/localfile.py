"""file:// image URLs: off unless the operator sets MediaPolicy.local_files_root.

The resolved path (symlinks followed) must stay inside the resolved root; `..` segments are
refused outright. Only regular files are read, and never more than max_image_bytes + 1 bytes.
"""

from __future__ import annotations

import os
import stat
from urllib.parse import unquote, urlsplit

from vlmserve.inputs.media.errors import url_error
from vlmserve.inputs.media.policy import MediaPolicy

_NOT_ALLOWED = "image file is not available"  # one message for every refusal: no path probing


def read_local_file(url: str, policy: MediaPolicy) -> bytes:
    if not policy.local_files_root:
        raise url_error("file:// image URLs are not enabled on this server")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise url_error(_NOT_ALLOWED)
    raw_path = unquote(parts.path)
    if "\x00" in raw_path or ".." in raw_path.replace("\\", "/").split("/"):
        raise url_error(_NOT_ALLOWED)
    root = os.path.realpath(policy.local_files_root)
    try:
        resolved = os.path.realpath(raw_path, strict=True)
    except OSError as exc:
        raise url_error(_NOT_ALLOWED) from exc
    if os.path.commonpath([root, resolved]) != root or resolved == root:
        raise url_error(_NOT_ALLOWED)
    try:
        # O_NONBLOCK: a FIFO swapped in after realpath must not hang open(); checked below.
        fd = os.open(resolved, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise url_error(_NOT_ALLOWED) from exc
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        regular = False
    if not regular:  # directories, FIFOs, devices
        os.close(fd)
        raise url_error(_NOT_ALLOWED)
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(policy.max_image_bytes + 1)
    if len(data) > policy.max_image_bytes:
        raise url_error(f"image exceeds {policy.max_image_bytes} bytes")
    return data
