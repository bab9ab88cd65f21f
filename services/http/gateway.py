"""What every route of the gateway shares: the NATS client, the settings, the model list, and
the token texts of logprobs."""

from dataclasses import dataclass

from engine.structured.compile_pool import CompilePool
from services.client import Client
from services.http.models import Models
from services.http.settings import HttpSettings
from services.http.tokens import TokenTexts
from services.settings import Settings


@dataclass
class Gateway:
    client: Client
    settings: Settings
    http: HttpSettings
    models: Models
    tokens: TokenTexts
    grammars: CompilePool  # structured specs' compile checks, in worker processes

    @classmethod
    def create(cls, client: Client, settings: Settings, http: HttpSettings) -> "Gateway":
        models = Models(client, http.served_model_name)
        grammars = CompilePool(settings.grammar_limits)
        return cls(client, settings, http, models, TokenTexts(settings.model), grammars)
