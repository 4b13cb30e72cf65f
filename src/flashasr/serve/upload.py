"""Streaming multipart/form-data upload with the size limit enforced as the body arrives.

The request body is fed chunk by chunk to python-multipart's push parser; the file part
goes to an anonymous ``SpooledTemporaryFile`` (memory up to 32 MiB, then an unlinked temp
file in the system temp dir, never a client-chosen path or name), so a 1 GB upload is
never held in memory and is rejected with 413 the moment it passes the limit.
"""

from __future__ import annotations

import asyncio
import tempfile

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect

from .errors import APIError

SPOOL_BYTES = 32 << 20
MAX_FIELD_BYTES = 64 << 10
MAX_FIELDS = 64


class ClientGone(ClientDisconnect):
    """The client closed the connection before its body ended; ``received``: the body bytes that
    arrived. Not an error of the server: the app logs one INFO line (no traceback)."""

    def __init__(self, received: int):
        super().__init__(f"client disconnected during upload ({received} bytes received)")
        self.received = received


class Upload:
    """Parsed form: ``fields`` (name -> list of str values) and the ``file`` part.

    ``file`` is a binary file object positioned at 0 (or None), ``file_size`` its bytes,
    ``filename`` the client's name (informational only: never used as a path).
    Call :meth:`close` (or use as a context manager) to drop the temp data.
    """

    def __init__(self):
        self.fields: dict[str, list[str]] = {}
        self.file = None
        self.file_size = 0
        self.filename: str | None = None
        self.body_bytes = 0

    def get(self, name: str, default=None):
        v = self.fields.get(name)
        return v[-1] if v else default

    def getlist(self, name: str) -> list[str]:
        return list(self.fields.get(name, []))

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _PartCollector:
    """python-multipart callbacks that fill an :class:`Upload`: the ``file_field`` part with a
    filename goes to a spooled temp file, every other part is a text field (bounded)."""

    def __init__(self, up: Upload, file_field: str):
        self.up = up
        self.file_field = file_field
        self.name: str | None = None     # current part's field name
        self.headers: dict = {}          # current part's headers
        self.hname = self.hval = b""     # header being read
        self.buf: bytearray | None = None  # current text field (None: the file part)
        self.nfields = 0

    def callbacks(self) -> dict:
        return {"on_part_begin": self.on_part_begin, "on_header_field": self.on_header_field,
                "on_header_value": self.on_header_value, "on_header_end": self.on_header_end,
                "on_headers_finished": self.on_headers_finished, "on_part_data": self.on_part_data,
                "on_part_end": self.on_part_end}

    def on_part_begin(self):
        self.headers = {}
        self.name = None

    def on_header_field(self, data, start, end):
        self.hname += data[start:end]

    def on_header_value(self, data, start, end):
        self.hval += data[start:end]

    def on_header_end(self):
        self.headers[self.hname.decode("latin-1").lower()] = self.hval
        self.hname = self.hval = b""

    def on_headers_finished(self):
        _, opts = parse_options_header(self.headers.get("content-disposition", b""))
        self.name = opts.get(b"name", b"").decode("utf-8", "replace")
        fname = opts.get(b"filename")
        up = self.up
        if self.name == self.file_field and fname is not None:
            if up.file is not None:
                raise APIError("more than one 'file' part", code="invalid_request", param="file")
            up.filename = fname.decode("utf-8", "replace")
            up.file = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)
            self.buf = None
        else:
            self.nfields += 1
            if self.nfields > MAX_FIELDS:
                raise APIError("too many form fields", code="invalid_request")
            self.buf = bytearray()

    def on_part_data(self, data, start, end):
        if self.buf is None:
            self.up.file.write(data[start:end])
            self.up.file_size += end - start
        else:
            self.buf += data[start:end]
            if len(self.buf) > MAX_FIELD_BYTES:
                raise APIError(f"form field {self.name!r} is too long", code="invalid_request", param=self.name)

    def on_part_end(self):
        if self.buf is not None:
            self.up.fields.setdefault(self.name, []).append(bytes(self.buf).decode("utf-8", "replace"))
        self.buf = None


async def read_multipart(request, *, max_bytes: int, body_timeout: float, file_field: str = "file") -> Upload:
    """Parse a multipart/form-data request body.

    Args:
        request: a Starlette ``Request``.
        max_bytes: body limit; more raises 413 ``file_too_large`` without reading the rest.
        body_timeout: longest wait for the next body chunk (slow clients) -> 408 ``timeout``.
    Raises:
        APIError: 400 ``invalid_request`` (not multipart, malformed body, too many fields),
        413 ``file_too_large``, 408 ``timeout``.
        ClientGone: the client disconnected before the body ended.
    """
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or b"boundary" not in params:
        raise APIError("expected a multipart/form-data body with a 'file' part", code="invalid_request")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(f"request body of {int(declared)} bytes exceeds the limit of {max_bytes} bytes",
                       status=413, code="file_too_large")

    up = Upload()
    parser = MultipartParser(params[b"boundary"], _PartCollector(up, file_field).callbacks())
    stream = request.stream().__aiter__()
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(stream.__anext__(), body_timeout)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise APIError(f"no request body data for {body_timeout:g} s", status=408,
                               code="timeout") from None
            except ClientDisconnect:
                raise ClientGone(up.body_bytes) from None
            if not chunk:
                continue
            up.body_bytes += len(chunk)
            if up.body_bytes > max_bytes:
                raise APIError(f"request body exceeds the limit of {max_bytes} bytes", status=413,
                               code="file_too_large")
            parser.write(chunk)
        parser.finalize()
    except FormParserError as e:
        up.close()
        raise APIError(f"malformed multipart body: {e}", code="invalid_request") from None
    except BaseException:
        up.close()
        raise
    if up.file is not None:
        up.file.seek(0)
    return up
