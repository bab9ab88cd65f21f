"""`X-Request-Id` echoed back: a client's (or its proxy's) id for a request comes back on the
response, as vLLM and most API gateways do, so that logs on both sides can be joined. Only an
id the routes accept (services/http/app.py's pattern) is echoed; a bad one gets their 400."""

import re

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,200}$")


class EchoRequestId:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = _request_id(scope) if scope["type"] == "http" else None
        if request_id is None:
            await self.app(scope, receive, send)
            return

        async def echoing(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("X-Request-Id", request_id)
            await send(message)

        await self.app(scope, receive, echoing)


def _request_id(scope: Scope) -> str | None:
    for key, value in scope["headers"]:
        if key == b"x-request-id":
            text = value.decode("latin-1")
            return text if REQUEST_ID.match(text) else None
    return None
