"""The few text fields of a ``multipart/form-data`` body the gateway routes by.

vLLM's audio endpoints (``/v1/audio/transcriptions``, ``/translations``) take a form
with the audio file and fields such as ``model`` and ``stream``. The body is
forwarded untouched; only the parts named here are read, by scanning for the
boundary, so a large file part is never copied or decoded.
"""

from __future__ import annotations

import re

_BOUNDARY = re.compile(r'boundary="?([^";]+)"?', re.IGNORECASE)
_NAME = re.compile(rb'name="([^"]*)"', re.IGNORECASE)
MAX_FIELD_BYTES = 1024  # a model name or a flag; longer values are not routing fields


class FormError(ValueError):
    """The body is not the multipart form its content type announces."""


def form_fields(raw: bytes, content_type: str, names: frozenset[str]) -> dict[str, str]:
    """The values of the plain (non-file) parts called one of ``names``."""
    found = _BOUNDARY.search(content_type)
    if not found:
        raise FormError("multipart content type without a boundary")
    delimiter = b"--" + found.group(1).encode("latin-1")
    fields: dict[str, str] = {}
    pos = raw.find(delimiter)
    if pos < 0:
        raise FormError("the body does not contain its multipart boundary")
    while pos >= 0:
        start = pos + len(delimiter)
        if raw[start : start + 2] == b"--":  # the closing delimiter
            break
        end = raw.find(delimiter, start)
        stop = end if end >= 0 else len(raw)
        head_end = raw.find(b"\r\n\r\n", start, stop)
        if head_end < 0:
            raise FormError("a multipart part without headers")
        head = raw[start:head_end]
        name = _NAME.search(head)
        if name and b"filename=" not in head.lower():
            key = name.group(1).decode("utf-8", "replace")
            value = raw[head_end + 4 : stop].removesuffix(b"\r\n")
            if key in names and len(value) <= MAX_FIELD_BYTES:
                fields[key] = value.decode("utf-8", "replace")
        pos = end
    return fields
