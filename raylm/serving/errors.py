"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the matching HTTP status.

A server error (5xx) tells the client what failed and a request id, nothing more: its cause can name Ray actors,
processes, namespaces and node addresses, which go to the server's log under that id.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi.responses import JSONResponse

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 409: "invalid_request_error", 429: "rate_limit_error"}


class OpenAIError(Exception):
    """An error the server answers with; raised anywhere below a route, rendered by the app's handler."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})  # e.g. a 405's Allow

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def server_error(status: int, message: str, cause: BaseException | str, request_id: str | None = None,
                 code: str | None = None) -> OpenAIError:
    """A 5xx whose body holds `message` and the request id (a new one unless given); `cause`, with its traceback
    when it is an exception, goes to the server log under the same id."""
    request_id = request_id or f"req_{uuid.uuid4().hex}"
    if isinstance(cause, BaseException):
        logger.error("%s [request id %s]", message, request_id, exc_info=cause)
    else:
        logger.error("%s [request id %s]: %s", message, request_id, cause)
    return OpenAIError(status, f"{message} (request id {request_id}; the server log has the details)", code=code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param, code)


def from_engine_error(exc: ValueError | TypeError, fields: Sequence[str] = ()) -> OpenAIError:
    """A 400 for a ValueError/TypeError raised by raylm; its messages start with the field they are about."""
    message = str(exc)
    first_word = message.split(" ", 1)[0]
    return bad_request(message, param=first_word if first_word in fields else None)


def from_validation_errors(errors: Sequence[dict[str, Any]]) -> OpenAIError:
    """A 400 for the first pydantic error of a request body (FastAPI's RequestValidationError)."""
    if not errors:
        return bad_request("invalid request")
    error = errors[0]
    kind = error.get("type", "")
    location = [str(part) for part in error.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    message = str(error.get("msg", "invalid value"))
    if kind == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {error.get('ctx', {}).get('error', message)}",
                           code="invalid_json")
    if not location and kind == "missing":
        return bad_request("the request body is empty: send a JSON object of the request's fields",
                           code="invalid_json")
    if not location and kind in ("model_type", "model_attributes_type", "dict_type"):
        return bad_request(f"the request body must be a JSON object, got {_json_type(error.get('input'))}",
                           code="invalid_value")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, code="unknown_parameter")
    if kind == "missing":
        return bad_request(f"{param} is required", param, code="missing_required_parameter")
    message = message.removeprefix("Value error, ")
    if message.startswith("raylm does not support"):
        return bad_request(message, param, code="unsupported_parameter")
    return bad_request(f"{param}: {message}" if param else message, param, code="invalid_value")


def _json_type(value: Any) -> str:
    for kind, name in ((bool, "a boolean"), (str, "a string"), (int, "a number"), (float, "a number"),
                       (list, "an array"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return "null"
