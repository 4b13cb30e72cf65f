"""HTTP-facing errors in OpenAI's JSON error shape.

``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`` with the HTTP status.
"""

from __future__ import annotations

from ..errors import FlashASRError


class APIError(FlashASRError):
    """An error returned to an API client.

    Args:
        message: human text naming the problem.
        status: HTTP status code (400, 401, 404, 408, 413, 503, ...).
        code: stable snake_case code (``file_too_large``, ``invalid_request``, ...).
        param: the request parameter at fault, if any.
    """

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_request",
                 param: str | None = None, type: str | None = None):
        super().__init__(message, code=code)
        self.status = status
        self.param = param
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")


class EngineUnavailable(APIError):
    """The engine process is down or restarting (HTTP 503)."""

    def __init__(self, message: str = "the transcription engine is restarting; retry shortly"):
        super().__init__(message, status=503, code="engine_unavailable")


SHUTTING_DOWN = "the server is shutting down"  # the message of every request the stop cuts short


def shutting_down() -> EngineUnavailable:
    """The error of a request the server's stop cuts short (503 ``engine_unavailable``, the same in
    single and multi mode: an upload's reply, a stream final's ``...failed``)."""
    return EngineUnavailable(SHUTTING_DOWN)


_PARAM_OF_CODE = {"unsupported_language": "language"}  # errors raised without naming the request field


def error_body(err: BaseException) -> tuple[int, dict]:
    """Map any exception to ``(http_status, openai_error_body)``.

    FlashASRError subclasses keep their ``code``/``status`` (audio errors are 400) and ``param``
    (``unsupported_language`` names ``language``);
    anything else is a 500 ``internal_error`` whose message does not leak internals.
    """
    if isinstance(err, APIError):
        return err.status, {"error": {"message": err.message, "type": err.type, "param": err.param,
                                      "code": err.code}}
    if isinstance(err, FlashASRError):
        status = int(getattr(err, "status", 500) or 500)
        typ = "invalid_request_error" if status < 500 else "server_error"
        param = getattr(err, "param", None) or _PARAM_OF_CODE.get(err.code)
        return status, {"error": {"message": err.message, "type": typ, "param": param, "code": err.code}}
    return 500, {"error": {"message": f"internal error ({type(err).__name__})", "type": "server_error",
                           "param": None, "code": "internal_error"}}
