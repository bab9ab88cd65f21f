"""The gateway's door, through a `kvpager http` of its own in front of the `served` stack: API
keys (the official openai client, raw requests, the routes that stay open)."""

import httpx
import openai
import pytest

from services.cli import build_parser
from services.http.settings import HttpSettings
from tests.services.http_fixture import gateway, nats_client, served  # noqa: F401

KEYS = ("key-alpha", "key-beta")
PROMPT = "The paged cache"
GUARDED_ENV = {"KVPAGER_API_KEY": ",".join(KEYS)}


@pytest.fixture(scope="module")
def guarded(served, tiny_llama, tmp_path_factory):  # noqa: F811
    with gateway(served, tiny_llama, tmp_path_factory.mktemp("guarded"), **GUARDED_ENV) as found:
        yield found


def _api(guarded, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=guarded.api_url, api_key=key, max_retries=0)


def test_keys_come_comma_separated_or_repeated(monkeypatch):
    monkeypatch.setenv("KVPAGER_API_KEY", "from-env")
    parser, _ = build_parser()
    args = parser.parse_args(["http", "--api-key", "a", "--api-key", "b, c"])
    assert HttpSettings.from_args(args).api_keys == ("from-env", "a", "b", "c")
    monkeypatch.delenv("KVPAGER_API_KEY")
    parser, _ = build_parser()
    assert HttpSettings.from_args(parser.parse_args(["http"])).api_keys == ()


@pytest.mark.parametrize("key", KEYS)
async def test_a_good_key_is_served(guarded, tiny_llama, nats_client, key):  # noqa: F811
    async with _api(guarded, key) as api:
        assert [m.id for m in (await api.models.list()).data] == [tiny_llama.name]
        done = await api.completions.create(model=tiny_llama.name, prompt=PROMPT, max_tokens=4)
    assert done.usage.completion_tokens == 4


async def test_a_wrong_key_is_an_authentication_error(guarded, tiny_llama):
    async with _api(guarded, "key-alph") as api:
        with pytest.raises(openai.AuthenticationError) as caught:
            await api.completions.create(model=tiny_llama.name, prompt=PROMPT, max_tokens=4)
        assert caught.value.status_code == 401
        assert caught.value.body["code"] == "invalid_api_key"
        assert caught.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.AuthenticationError):
            await api.chat.completions.create(
                model=tiny_llama.name, messages=[{"role": "user", "content": "Hi"}]
            )
        with pytest.raises(openai.AuthenticationError):
            await api.models.retrieve(tiny_llama.name)


@pytest.mark.parametrize(
    "method, path, body",
    [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"model": "m", "prompt": "x"}),
        ("POST", "/tokenize", {"prompt": "x"}),
        ("POST", "/detokenize", {"tokens": [1]}),
    ],
)
def test_no_key_is_a_401_on_the_model_routes(guarded, method, path, body):
    for headers in ({}, {"Authorization": "Basic a2V5LWFscGhh"}, {"Authorization": "Bearer"}):
        response = httpx.request(method, guarded.base_url + path, json=body, headers=headers)
        assert response.status_code == 401, (headers, response.text)
        assert response.headers["www-authenticate"] == "Bearer"
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and "API key" in error["message"]
    good = {"Authorization": f"Bearer {KEYS[1]}"}
    response = httpx.request(method, guarded.base_url + path, json=body, headers=good)
    assert response.status_code != 401, response.text


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version"])
def test_health_metrics_and_version_stay_open(guarded, path):
    assert httpx.get(guarded.base_url + path, timeout=10).status_code == 200
