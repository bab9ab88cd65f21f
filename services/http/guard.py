"""The gateway's door, an ASGI middleware in front of every route, in this order:
- requests in flight, at most `--http-max-concurrency` (a 503 past it): requests, not
  connections (those have their own bound, services/http/protocol.py), so idle sockets take
  no request's slot;
- the Host header, against `--allowed-hosts` when given (a 400 otherwise: a DNS-rebinding
  page cannot reach a gateway on loopback under its own name);
- API keys on the model routes (/v1/*, /tokenize, /detokenize), while /health, /metrics and
  /version stay open (401 with OpenAI's error object); a key comes as `Authorization: Bearer`
  or as Anthropic's `x-api-key`, and the refusals of /v1/messages are in Anthropic's error
  shape;
- `Content-Type: application/json` on every POST (a 415 otherwise: a web page can send
  text/plain or a form across origins without asking, never JSON).

Keys are compared in constant time: the sha256 of what the client sent against the sha256 of
every key, each compared with `hmac.compare_digest`, all of them whatever matched. The key
that matched gives the request its prefix-cache salt (`scope["state"]["key_salt"]`), so that
prefix-cache hits never cross API keys.
"""

import hashlib
import hmac

from kvpager.services.http import anthropic_shapes
from kvpager.services.http.errors import error_body
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

GUARDED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
ANTHROPIC_PREFIX = "/v1/messages"  # its refusals in Anthropic's error shape
_MISSING = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY), or an x-api-key header."
)


def key_salt(key: str) -> str:
    """The prefix-cache salt of one API key: derived, so the key itself never travels."""
    return hashlib.sha256(b"kvpager-cache-salt\0" + key.encode()).hexdigest()[:32]


class Guard:
    def __init__(
        self,
        app: ASGIApp,
        api_keys: tuple[str, ...] = (),
        hosts: tuple[str, ...] = (),
        max_in_flight: int | None = None,
    ) -> None:
        self.app = app
        self._digests = [(hashlib.sha256(key.encode()).digest(), key_salt(key)) for key in api_keys]
        self._hosts = hosts
        self._max_in_flight = max_in_flight
        self.num_in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._max_in_flight is not None and self.num_in_flight >= self._max_in_flight:
            message = f"the gateway has {self.num_in_flight} requests in flight; retry later"
            await _refuse(scope, 503, message, "overloaded")(scope, receive, send)
            return
        self.num_in_flight += 1
        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
            await self.app(scope, receive, send)
        finally:
            self.num_in_flight -= 1

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        if self._hosts and not host_allowed(_header(scope, b"host"), self._hosts):
            message = "Host: not a name this server answers to"
            return _refuse(scope, 400, message, "invalid_host")
        if self._digests and _guarded(scope["path"]):
            refusal = self._key_refusal(scope)
            if refusal is not None:
                return refusal
        if scope["method"] == "POST":
            media_type = (_header(scope, b"content-type") or "").split(";")[0].strip().lower()
            if media_type != "application/json":
                message = f"Content-Type: {media_type or 'none'}; expected application/json"
                return _refuse(scope, 415, message, "unsupported_media_type")
        return None

    def _key_refusal(self, scope: Scope) -> JSONResponse | None:
        token = _api_key(scope)
        if token is None:
            return _unauthorized(scope, _MISSING, None)
        salt = self._match(token)
        if salt is None:
            return _unauthorized(scope, "Incorrect API key provided.", "invalid_api_key")
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


def host_allowed(host: str | None, allowed: tuple[str, ...]) -> bool:
    """`host` (a Host header, port and all) is one of `allowed`: a name or address, `*.domain`
    (the domain's subdomains), or `*`."""
    if host is None:
        return False
    name = host.strip().lower()
    if name.startswith("["):  # [IPv6]:port
        name = name[1 : name.find("]")] if "]" in name else name
    elif name.count(":") == 1:
        name = name.split(":")[0]
    for pattern in allowed:
        if pattern == "*" or name == pattern:
            return True
        if pattern.startswith("*.") and name.endswith(pattern[1:]):
            return True
    return False


def _guarded(path: str) -> bool:
    return path == "/v1" or path.startswith(GUARDED_PREFIXES)


def _api_key(scope: Scope) -> str | None:
    """The key of `Authorization: Bearer KEY`, else of Anthropic's `x-api-key: KEY`."""
    header = _header(scope, b"authorization")
    if header:
        scheme, _, token = header.partition(" ")
        return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return (_header(scope, b"x-api-key") or "").strip() or None


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _unauthorized(scope: Scope, message: str, code: str | None) -> JSONResponse:
    return _refuse(scope, 401, message, code, {"WWW-Authenticate": "Bearer"})


def _refuse(
    scope: Scope,
    status: int,
    message: str,
    code: str | None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    if scope["path"].startswith(ANTHROPIC_PREFIX):
        body = anthropic_shapes.error_body(status, message)
    else:
        body = error_body(status, message, code)
    return JSONResponse(body, status_code=status, headers=headers)
