"""The routing fields of a multipart form are read without touching its file part."""

import httpx
import pytest

from gateway.multipart import FormError, form_fields
from gateway.openai_body import parse_body

WANTED = frozenset({"model", "stream"})


def form(fields: dict, file: bytes) -> tuple[bytes, str]:
    """A body and content type exactly as httpx (the openai client's transport) sends them."""
    request = httpx.Request(
        "POST", "http://x/v1/audio/transcriptions", data=fields,
        files={"file": ("a.wav", file, "audio/wav")},
    )  # fmt: skip
    return request.read(), request.headers["content-type"]


def test_fields_are_read_and_the_file_part_is_skipped_even_when_it_looks_like_one():
    body, ctype = form({"model": "whisper", "stream": "true", "language": "en"},
                       b'RIFF\r\n\r\nname="model"\r\n\r\nfake')  # fmt: skip
    assert form_fields(body, ctype, WANTED) == {"model": "whisper", "stream": "true"}
    parsed = parse_body(body, "audio", ctype)
    assert (parsed.model, parsed.stream, parsed.content_type) == ("whisper", True, ctype)
    assert parsed.raw == body


def test_a_form_without_a_model_leaves_the_model_to_the_gateway():
    body, ctype = form({}, b"RIFF")
    parsed = parse_body(body, "audio", ctype)
    assert (parsed.model, parsed.stream) == (None, False)


@pytest.mark.parametrize(
    ("body", "ctype"),
    [(b"--x\r\nno headers end", "multipart/form-data; boundary=x"),
     (b"plain", "multipart/form-data; boundary=x"),
     (b"--x--", "multipart/form-data")],
)  # fmt: skip
def test_a_body_that_is_not_its_announced_form_is_refused(body, ctype):
    with pytest.raises(FormError):
        form_fields(body, ctype, WANTED)
