"""OpenAI's error object, `{"error": {"message", "type", "param", "code"}}`, with its status.

kvpager's error types (ErrorInfo.type) become the `code`; the status says who is to blame:
400 bad input (naming the field), 404 unknown model, 503 overloaded or no executor, 504 past
the request's deadline, 502 when the gateway lost its NATS stream.
"""

from typing import Any

from kvpager.schemas.public import ErrorInfo

STATUS_OF_TYPE = {
    "invalid_request": 400,
    "request_too_long": 400,
    "model_not_found": 404,
    "overloaded": 503,
    "unavailable": 503,
    "executor_unavailable": 503,
    "deadline_exceeded": 504,
    "connection_lost": 502,
    "internal_error": 500,
}
OPENAI_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # OpenAI's, for a missing or wrong API key
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class HttpError(Exception):
    """A request that gets an OpenAI error object instead of a completion."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    @classmethod
    def from_info(cls, error: ErrorInfo) -> "HttpError":
        status = STATUS_OF_TYPE.get(error.type, 500)
        param, message = error.param, error.message
        if param == "prompt_token_ids":  # OpenAI's token-id prompts are `prompt`
            param, message = "prompt", message.replace("prompt_token_ids", "prompt")
        return cls(status, message, error.type, param)

    @classmethod
    def invalid(cls, message: str, param: str | None) -> "HttpError":
        return cls(400, message, "invalid_request", param)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.code, self.param)


def error_body(
    status: int, message: str, code: str | None, param: str | None = None
) -> dict[str, Any]:
    kind = OPENAI_TYPE_OF_STATUS.get(status, "invalid_request_error" if status < 500 else "")
    error = {"message": message, "type": kind or "server_error", "param": param, "code": code}
    return {"error": error}
