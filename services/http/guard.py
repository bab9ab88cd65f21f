"""The gateway's door, an ASGI middleware in front of every route: API keys on the model
routes (/v1/*, /tokenize, /detokenize), while /health, /metrics and /version stay open.

Keys are compared in constant time: the sha256 of what the client sent against the sha256 of
every key, each compared with `hmac.compare_digest`, all of them whatever matched. The key
that matched gives the request its prefix-cache salt (`scope["state"]["key_salt"]`), so that
prefix-cache hits never cross API keys.
"""

import hashlib
import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from services.http.errors import error_body

GUARDED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
_MISSING = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)


def key_salt(key: str) -> str:
    """The prefix-cache salt of one API key: derived, so the key itself never travels."""
    return hashlib.sha256(b"kvpager-cache-salt\0" + key.encode()).hexdigest()[:32]


class Guard:
    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...] = ()) -> None:
        self.app = app
        self._digests = [(hashlib.sha256(key.encode()).digest(), key_salt(key)) for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._guarded(scope["path"]):
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _guarded(self, path: str) -> bool:
        return bool(self._digests) and (path == "/v1" or path.startswith(GUARDED_PREFIXES))

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        header = _header(scope, b"authorization")
        if not header:
            return _unauthorized(_MISSING, None)
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return _unauthorized(_MISSING, None)
        salt = self._match(token.strip())
        if salt is None:
            return _unauthorized("Incorrect API key provided.", "invalid_api_key")
        scope.setdefault("state", {})["key_salt"] = salt
        return None

    def _match(self, token: str) -> str | None:
        """The salt of the key `token` is, in time independent of which key (if any)."""
        sent = hashlib.sha256(token.encode()).digest()
        found = None
        for digest, salt in self._digests:
            if hmac.compare_digest(sent, digest):
                found = salt
        return found


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _unauthorized(message: str, code: str | None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(error_body(401, message, code), status_code=401, headers=headers)
