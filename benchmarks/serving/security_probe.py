"""Issue #43's "done when", against a running default `kvpager serve` (SmolLM2, HTTP on 8000).

kvpager serve &   then   python -m benchmarks.serving.security_probe
"""

import asyncio
import json
import socket
import sys
import time

import httpx
import psutil
from kvpager.services.client import Client

HTTP = "http://127.0.0.1:8000"
NATS_URL = "nats://127.0.0.1:4222"
VICTIM = dict(prompt="Write a long story about a cat.", max_tokens=48, temperature=0)
results: list[tuple[str, bool, str]] = []


def record(name: str, ok: bool, detail: str) -> None:
    results.append((name, ok, detail))
    print(("PASS " if ok else "FAIL ") + name + ": " + detail, flush=True)


def pids() -> dict[str, int]:
    found = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        for name in ("tokenizer", "scheduler", "executor", "http"):
            if "services.cli" in cmd and cmd.rstrip().endswith(name):
                found[name] = p.info["pid"]
    return found


def lark_chain(n: int) -> str:
    rules = [f'r{i}: r{i + 1} | "a"' for i in range(n)]
    return "start: r0\n" + "\n".join(rules) + f'\nr{n}: "b"\n'


def gbnf_chain(n: int) -> str:
    rules = [f'r{i} ::= r{i + 1} | "a"' for i in range(n)]
    return "root ::= r0\n" + "\n".join(rules) + f'\nr{n} ::= "b"\n'


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


ALLOF = {
    "type": "string",
    "allOf": [{"pattern": f"^(a|b|c)*{'x' * (i % 7)}(d|e)+$"} for i in range(40)],
}


async def victim_text(client: Client) -> tuple[str, str | None]:
    text, error = "", None
    async for event in client.generate(**VICTIM):
        text += event.text
        if event.error:
            error = event.error.type
    return text, error


async def nats_attack(client: Client, structured: dict) -> str:
    kinds = []
    async for event in client.generate(prompt="x", max_tokens=4, structured_outputs=structured):
        if event.error:
            kinds.append(event.error.type)
    return ",".join(kinds) or "no error"


async def main() -> None:
    client = await Client.connect(NATS_URL)
    http = httpx.AsyncClient(timeout=120)
    before = pids()
    print("pids", before)
    expected, _ = await victim_text(client)

    # 1. six 3,000-rule grammars, HTTP and NATS, a victim stream beside them
    victim = asyncio.create_task(victim_text(client))
    start = time.monotonic()
    attacks = [
        ("lark", {"grammar": lark_chain(3000)}),
        ("gbnf", {"grammar": gbnf_chain(3000)}),
        ("json $ref", {"json": json.dumps(ref_chain(3000))}),
    ]
    for name, spec in attacks:
        t0 = time.monotonic()
        body = {
            "model": "smollm2-135m-instruct",
            "prompt": "x",
            "max_tokens": 4,
            "structured_outputs": spec,
        }
        r = await http.post(f"{HTTP}/v1/completions", json=body)
        record(
            f"HTTP {name} 3,000 rules",
            r.status_code == 400,
            f"{r.status_code} {r.text[:120]} in {time.monotonic() - t0:.2f} s",
        )
        t0 = time.monotonic()
        kind = await nats_attack(client, spec)
        record(
            f"NATS {name} 3,000 rules",
            kind.startswith("invalid_request"),
            f"{kind} in {time.monotonic() - t0:.2f} s",
        )
    text, error = await victim
    record(
        "victim beside grammars",
        text == expected and error is None,
        f"equal={text == expected} error={error} ({time.monotonic() - start:.1f} s)",
    )
    record("pids kept after grammars", pids() == before, str(pids()))

    # 2. allOf of 40 patterns
    gateway = psutil.Process(before["http"]) if "http" in before else None
    rss0 = gateway.memory_info().rss if gateway else 0
    t0 = time.monotonic()
    r = await http.post(
        f"{HTTP}/v1/completions",
        json={
            "model": "smollm2-135m-instruct",
            "prompt": "x",
            "max_tokens": 4,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": ALLOF},
            },
        },
    )
    took = time.monotonic() - t0
    grew = (gateway.memory_info().rss - rss0) / 2**20 if gateway else float("nan")
    record(
        "allOf schema",
        r.status_code == 400 and took < 1.0 and grew < 100,
        f"{r.status_code} in {took:.2f} s, gateway RSS +{grew:.0f} MB: {r.text[:100]}",
    )

    # 3. oversized internal messages, a victim beside each
    stops = [f"stop-string-{j:02d}" for j in range(16)]
    schema = {
        "type": "object",
        "properties": {
            f"field_{i}": {"type": "string", "description": "d" * 60} for i in range(60)
        },
    }
    cases = [
        (
            "256 prompts x 16 stop strings",
            {"prompt": [f"prompt {i}" for i in range(256)], "max_tokens": 4, "stop": stops},
        ),
        (
            "256 prompts + schema",
            {
                "prompt": [f"prompt {i}" for i in range(256)],
                "max_tokens": 4,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": schema},
                },
            },
        ),
        (
            "prompt_logprobs 20 on 4,500 tokens",
            {"prompt": [list(range(100, 4600))], "max_tokens": 1, "prompt_logprobs": 20},
        ),
    ]
    for name, body in cases:
        victim = asyncio.create_task(victim_text(client))
        t0 = time.monotonic()
        r = await http.post(
            f"{HTTP}/v1/completions", json={"model": "smollm2-135m-instruct", **body}, timeout=300
        )
        took = time.monotonic() - t0
        text, error = await victim
        typed = r.status_code == 200 or (400 <= r.status_code < 500 and "error" in r.text)
        record(
            name,
            typed and took < 120 and text == expected and error is None,
            f"{r.status_code} in {took:.1f} s ({r.text[:90]!r}); victim equal={text == expected}",
        )
    victim = asyncio.create_task(victim_text(client))
    t0 = time.monotonic()
    kinds, finals = [], 0
    async for event in client.generate(
        prompt="Hello",
        max_tokens=8,
        beam_width=16,
        n=16,
        temperature=0,
        stop_token_ids=list(range(1000, 4152)),
    ):
        finals += event.is_final
        if event.error:
            kinds.append(event.error.type)
    took = time.monotonic() - t0
    text, error = await victim
    record(
        "NATS 16 beams x 3,152 stop_token_ids",
        took < 120 and text == expected and not error,
        f"{finals} finals, errors {kinds[:2]} in {took:.1f} s; victim equal={text == expected}",
    )
    record("pids kept after messages", pids() == before, str(pids()))

    # 4. 1,100 idle connections
    socks = []
    for _ in range(1100):
        s = socket.create_connection(("127.0.0.1", 8000))
        socks.append(s)
    r = await http.post(
        f"{HTTP}/v1/completions",
        json={"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 4},
    )
    record("1,100 idle connections", r.status_code == 200, f"{r.status_code}")
    for s in socks:
        s.close()
    await http.aclose()
    await client.close()
    print(f"{sum(ok for _, ok, _ in results)} passed, {sum(not ok for _, ok, _ in results)} failed")


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
