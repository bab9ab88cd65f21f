"""The served models, from `llm.models`, cached briefly; OpenAI's `model` field checked on them.

A model's OpenAI name is `--served-model-name`, or else its folder's name; its full path is
accepted too.
"""

import time
from pathlib import Path

import nats.errors
from kvpager.schemas.public import ModelCard
from kvpager.services.client import Client, ClientError
from kvpager.services.http.errors import HttpError

TTL_S = 5.0
QUERY_TIMEOUT_S = 3.0


class Models:
    def __init__(self, client: Client, served_name: str | None) -> None:
        self.client = client
        self.served_name = served_name
        self._cards: list[ModelCard] = []
        self._fetched_at = -TTL_S

    def name(self, card: ModelCard) -> str:
        return self.served_name or Path(card.id).name or card.id

    async def cards(self, fresh: bool = False) -> list[ModelCard]:
        if fresh or time.monotonic() - self._fetched_at > TTL_S:
            try:
                self._cards = (await self.client.models(timeout=QUERY_TIMEOUT_S)).models
            except (TimeoutError, ClientError, nats.errors.Error) as exc:
                raise HttpError(
                    503, f"no kvpager answers llm.models: {exc}", "unavailable"
                ) from exc
            self._fetched_at = time.monotonic()
        return self._cards

    async def resolve(self, model: str) -> ModelCard:
        """The card `model` names: 404 if none does, 503 if no model is served yet."""
        for fresh in (False, True):  # a cached list may predate a new executor
            cards = await self.cards(fresh)
            for card in cards:
                if model in (self.name(card), card.id):
                    return card
        if not cards:
            message = "no model is served yet: no executor is attached; retry soon"
            raise HttpError(503, message, "executor_unavailable")
        names = ", ".join(self.name(card) for card in cards)
        raise HttpError(
            404, f"model {model!r} does not exist; served: {names}", "model_not_found", "model"
        )
