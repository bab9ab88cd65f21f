"""What `kvpager serve` prints: where the API is, its subjects, and how to try it."""

import json

from kvpager.schemas.public import Stats
from kvpager.services.http.settings import HttpSettings
from kvpager.services.settings import Settings
from kvpager.services.subjects import Subjects

EXAMPLE_REQUEST = {"prompt": "Hello", "max_tokens": 32, "stream": False}


def starting_lines(settings: Settings, server_pid: int | None) -> list[str]:
    where = f"embedded nats-server, pid {server_pid}" if server_pid else "external server"
    return [
        f"kvpager: NATS {settings.nats_url} ({where})",
        f"kvpager: starting executor, scheduler and tokenizer for {settings.model}",
    ]


def ready_banner(
    settings: Settings, stats: Stats, max_model_len: int, http: HttpSettings | None = None
) -> list[str]:
    subjects, url = Subjects(settings.prefix), settings.nats_url
    request = json.dumps(EXAMPLE_REQUEST)
    lines = [
        f"  subjects: {subjects.generate} (request, streamed events), {subjects.abort}, "
        f"{subjects.health}, {subjects.models}, {subjects.stats}",
        f'  try:      kvpager generate "Hello" --nats-url {url}',
        f"            nats req {subjects.generate} '{request}' --server {url}",
        "            kvpager stats   (KV cache and queues)",
    ]
    if settings.nats_identity is not None:
        lines.append(
            "  auth:     on; clients on this host use the default identity by themselves; "
            "`kvpager credentials add NAME` issues another (nats CLI: --user default "
            "--password <identities/default.json's> --inbox-prefix _INBOX_default)"
        )
    elif settings.has_nats_auth:
        lines.append("  clients need the same NATS credentials (KVPAGER_NATS_* or --nats-* flags)")
    else:
        lines.append("  auth:     OFF: every local process can read and forge every stream")
    return (
        lines
        + http_lines(http or HttpSettings())
        + [
            f"kvpager: ready on {url}: {stats.num_blocks} KV blocks of {stats.block_size} tokens, "
            f"max_model_len {max_model_len} (Ctrl-C to stop)"
        ]
    )


def http_lines(http: HttpSettings) -> list[str]:
    lines = []
    if http.http_port is not None:
        url = f"http://{http.http_host}:{http.http_port}"
        lines.append(
            f"  http:     {url}/v1 (OpenAI API: /v1/completions, /v1/chat/completions, "
            f"/v1/responses, /v1/models), {url}/metrics, {url}/health"
        )
    if http.metrics_port is not None:
        lines.append(f"  metrics:  http://{http.http_host}:{http.metrics_port}/metrics")
    return lines
