"""What every route of the gateway shares: the NATS client, the settings, the model list, and
the token texts of logprobs."""

from dataclasses import dataclass, field

from kvpager.engine.structured.compile_pool import CompilePool
from kvpager.services.client import Client
from kvpager.services.http.models import Models
from kvpager.services.http.settings import HttpSettings
from kvpager.services.http.tokens import TokenTexts
from kvpager.services.inflight import Journal
from kvpager.services.settings import Settings


@dataclass
class Gateway:
    client: Client
    settings: Settings
    http: HttpSettings
    models: Models
    tokens: TokenTexts
    grammars: CompilePool  # structured specs' compile checks, in worker processes
    journal: Journal = field(default_factory=lambda: Journal(None))  # what serve reads if we crash

    @classmethod
    def create(cls, client: Client, settings: Settings, http: HttpSettings) -> "Gateway":
        models = Models(client, http.served_model_name)
        tokens, journal = (
            TokenTexts(settings.tokenizer or settings.model),
            Journal(settings.journal_dir),
        )
        grammars = CompilePool(settings.grammar_limits)
        return cls(client, settings, http, models, tokens, grammars, journal)
