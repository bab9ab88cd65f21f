"""The NATS subject map: the public API under a prefix, internals under a named instance.

llm.generate                          client -> tokenizer (queue group), reply: events
llm.abort                             client -> every tokenizer (the owner acts)
llm.health | llm.models               client -> tokenizer (queue group), request-reply
llm.tokenize | llm.detokenize         client -> tokenizer (queue group), request-reply
llm.stats                             client -> scheduler, request-reply
llm.internal.<instance>.scheduler.requests   tokenizer -> scheduler: AddRequest (reply:
                                      AddResult), PromptPiece, FinishRequest
llm.internal.<instance>.scheduler.info       tokenizers, executor -> scheduler: SchedulerInfo,
                                      request-reply (their liveness ping too)
llm.internal.<instance>.scheduler.attach     executor -> scheduler: ExecutorReady
llm.internal.<instance>.scheduler.outputs    executor -> scheduler: StepDone, StepFailed
llm.internal.<instance>.executor.steps       scheduler -> executor: StepPiece, RunStep
llm.internal.<instance>.executor.<id>.ping   scheduler -> one executor: liveness, request-reply
llm.internal.<instance>.tokens.<replica>     scheduler -> one tokenizer: TokenBatch; empty
                                      request: liveness ping
llm.internal.<instance>.kv.events     scheduler -> every tokenizer's router: KvEvents
llm.internal.<instance>.scheduler.drain      `kvpager drain` -> scheduler: DrainInstance,
                                      request-reply (DrainResult)
llm.internal.kv.agents                executor -> every executor: its KvAgent (at attach);
                                      `.ask`: every executor publishes its card again
llm.internal.kv.agent.<name>          executor -> one executor (NATS fallback): KvReadRequest,
                                      KvWriteRequest, KvTransferDone
llm.internal.kv.xfer.<transfer id>    the NATS fallback's block bytes (KvChunk), one subject a
                                      transfer: KV bytes never share the scheduler's subjects
$SRV.STATS.kvpager-scheduler          tokenizers -> every scheduler (nats.micro): its
                                      instance (metadata) and InstanceLoad (endpoint data)
"""

import re
from dataclasses import dataclass

TOKENIZER_QUEUE = "kvpager-tokenizer"
INBOX = "_INBOX"  # nats-py's inbox prefix; client identities have `_INBOX_<name>`


# a KV transfer's id: one subject token (no dots, no wildcards), as kv_transfer() needs
TRANSFER_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")


def is_inbox(subject: str) -> bool:
    """A reply subject the services may answer on: a client's inbox (`_INBOX.<id>...`, or
    `_INBOX_<name>.<id>...` under an identity's prefix), never a service subject.

    Clients choose their reply subjects, and the services may publish anywhere: answering on
    `llm.internal.>` or `$SRV.>` would let a client forge internal messages through them.
    Whose inbox it is, NATS does not say; the server lets only that identity subscribe there.
    """
    first, _, rest = subject.partition(".")
    if not rest or not (first == INBOX or first.startswith(INBOX + "_")):
        return False
    return all(token and token not in ("*", ">") for token in subject.split("."))


@dataclass(frozen=True)
class Subjects:
    prefix: str = "llm"
    instance: str = "default"

    @property
    def generate(self) -> str:
        return f"{self.prefix}.generate"

    @property
    def abort(self) -> str:
        return f"{self.prefix}.abort"

    @property
    def health(self) -> str:
        return f"{self.prefix}.health"

    @property
    def stats(self) -> str:
        return f"{self.prefix}.stats"

    @property
    def models(self) -> str:
        return f"{self.prefix}.models"

    @property
    def tokenize(self) -> str:
        return f"{self.prefix}.tokenize"

    @property
    def detokenize(self) -> str:
        return f"{self.prefix}.detokenize"

    @property
    def _internal(self) -> str:
        return f"{self.prefix}.internal.{self.instance}"

    @property
    def scheduler_requests(self) -> str:
        return f"{self._internal}.scheduler.requests"

    @property
    def scheduler_info(self) -> str:
        return f"{self._internal}.scheduler.info"

    @property
    def scheduler_attach(self) -> str:
        return f"{self._internal}.scheduler.attach"

    @property
    def scheduler_outputs(self) -> str:
        return f"{self._internal}.scheduler.outputs"

    @property
    def executor_steps(self) -> str:
        return f"{self._internal}.executor.steps"

    def executor_ping(self, executor_id: str) -> str:
        return f"{self._internal}.executor.{executor_id}.ping"

    def tokens(self, replica_id: str) -> str:
        return f"{self._internal}.tokens.{replica_id}"

    @property
    def kv_events(self) -> str:
        return f"{self._internal}.kv.events"

    @property
    def scheduler_drain(self) -> str:
        return f"{self._internal}.scheduler.drain"

    @property
    def kv_agents(self) -> str:
        return f"{self.prefix}.internal.kv.agents"

    @property
    def kv_agents_ask(self) -> str:
        return f"{self.prefix}.internal.kv.agents.ask"

    def kv_agent(self, name: str) -> str:
        return f"{self.prefix}.internal.kv.agent.{name}"

    def kv_transfer(self, transfer_id: str) -> str:
        return f"{self.prefix}.internal.kv.xfer.{transfer_id}"

    @property
    def all_kv_events(self) -> str:
        """Every instance's KV events (a wildcard subscription)."""
        return f"{self.prefix}.internal.*.kv.events"

    def all_tokens(self, replica_id: str) -> str:
        """One tokenizer replica's token batches from every instance."""
        return f"{self.prefix}.internal.*.tokens.{replica_id}"

    def for_instance(self, instance: str) -> "Subjects":
        return Subjects(self.prefix, instance)


def responses_bucket(prefix: str) -> str:
    """The JetStream key-value bucket of the gateway's stored responses
    (services/http/response_store_nats.py): `$KV.<bucket>.<id>`, stream `KV_<bucket>`."""
    return re.sub(r"[^a-zA-Z0-9_-]", "_", prefix) + "_responses"


def responses_bucket_subjects(prefix: str) -> list[str]:
    """What a gateway publishes to use that bucket, and nothing else of JetStream's."""
    bucket = responses_bucket(prefix)
    stream = f"KV_{bucket}"
    api = "$JS.API.STREAM"
    return [
        f"{api}.INFO.{stream}",
        f"{api}.CREATE.{stream}",
        f"{api}.UPDATE.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
        f"$KV.{bucket}.>",
    ]
