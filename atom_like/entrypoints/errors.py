"""The one error type handlers raise: the client gets it as an OpenAI-style JSON body."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from atom_like.entrypoints.protocol import ErrorInfo, ErrorResponse


class OpenAIError(Exception):
    def __init__(self, status_code: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status_code)


def engine_failure(message: str) -> OpenAIError:
    # 503, not 500: the server is healthy and keeps serving; this request hit an engine fault.
    return OpenAIError(503, message, type="server_error", code="engine_error")


def internal_error(request_id: str) -> OpenAIError:
    """Our own bug: the details are in the server log under this id, not in the response."""
    return OpenAIError(500, f"internal server error (request id {request_id}; the server log has the details)",
                       type="server_error", code="internal_error")
