"""vLLM's words on kvpager's command line: `serve MODEL`, --host/--port, the gateway on by
default, --max-logprobs, --gpu-memory-utilization, --chat-template, --tokenizer, the flags that
mean nothing here (a warning, not a refusal), and a model folder without tokenizer files (one
`kvpager: ...` line from every door)."""

import asyncio
import shutil
import socket
import time

import pytest
import torch
from kvpager.engine import LLM
from kvpager.engine.config import ExecutorConfig, host_memory_bytes
from kvpager.engine.frontend.tokenizer_files import TOKENIZER_FILES, load_tokenizer
from kvpager.engine.kv.kv_size import weight_bytes_per_rank
from kvpager.engine.memory import blocks_that_fit, kv_bytes_per_block
from kvpager.engine.model_config import ModelConfig
from kvpager.schemas.errors import ConfigError, InvalidRequestError
from kvpager.schemas.public import GenerateRequest
from kvpager.schemas.sampling import SamplingParams, StructuredOutputsParams
from kvpager.services import cli
from kvpager.services.client import Client, NoKvpagerError
from kvpager.services.http.settings import HttpSettings
from kvpager.services.settings import ServeSettings, Settings
from kvpager.services.tokenizer.limits import RequestLimits

from tests.services.conftest import start_services

TEMPLATE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"


pytestmark = pytest.mark.usefixtures("restore_logging")


def _serve_args(*argv: str):
    parser, _ = cli.build_parser()
    args = parser.parse_args(["serve", *argv])
    cli._take_positional_model(args)
    return args


def test_serve_takes_the_model_as_vllm_does():
    args = _serve_args("/models/a")
    assert args.model == "/models/a"
    assert _serve_args("--model", "/models/b").model == "/models/b"
    assert _serve_args("/models/a", "--model", "/models/a").model == "/models/a"
    with pytest.raises(ConfigError, match="model: given twice"):
        _serve_args("/models/a", "--model", "/models/b")


def test_the_gateway_is_on_by_default_and_host_port_are_aliases():
    args = _serve_args("m")
    http, options = HttpSettings.from_args(args), ServeSettings.from_args(args)
    assert (http.http_host, http.http_port, options.http) == ("127.0.0.1", 8000, True)
    args = _serve_args("m", "--host", "0.0.0.0", "--port", "9123", "--allowed-origins", "a")
    http = HttpSettings.from_args(args)
    assert (http.http_host, http.http_port, http.origins) == ("0.0.0.0", 9123, ("a",))
    assert ServeSettings.from_args(_serve_args("m", "--no-http")).http is False


def test_a_taken_gateway_port_says_how_to_move(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "m", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvpager: cannot listen on 127.0.0.1:{port}") and "--no-http" in err


def test_flags_that_cannot_apply_warn(capsys, tmp_path):
    missing = str(tmp_path / "missing")
    code = cli.main(
        ["serve", missing, "--no-http", "--trust-remote-code", "--disable-log-requests"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "kvpager: warning: --trust-remote-code is ignored" in err
    assert "kvpager: warning: --disable-log-requests is ignored" in err
    assert missing in err  # the positional model is the one looked for


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--max-logprobs", "0", "max_logprobs: must be in [1, 20]"),
        ("--max-logprobs", "21", "max_logprobs: must be in [1, 20]"),
        ("--gpu-memory-utilization", "1.5", "gpu_memory_utilization: 1.5 is not in (0, 1]"),
    ],
)
def test_bad_values_are_one_line(capsys, flag, value, message):
    assert cli.main(["serve", "m", "--no-http", flag, value]) == 2
    err = capsys.readouterr().err
    assert err == f"kvpager: {message}\n", err


def test_max_logprobs_caps_a_request():
    limits = RequestLimits.from_settings(Settings(max_logprobs=3))
    limits.check_fields(GenerateRequest(prompt="x", logprobs=3, prompt_logprobs=3))
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidRequestError, match=r"over this server's limit \(3\)") as err:
            limits.check_fields(GenerateRequest(prompt="x", **{field: 4}))
        assert err.value.param == field


def test_gpu_memory_utilization_sizes_the_cache_on_cpu(tiny_llama):
    """vLLM's meaning: the share of all memory for weights plus KV (on CPU, of RAM)."""
    model_config = ModelConfig.from_path(tiny_llama)
    config = ExecutorConfig(tiny_llama, dtype="float32", gpu_memory_utilization=0.01)
    per_block = kv_bytes_per_block(config, model_config, torch.float32)
    weights = weight_bytes_per_rank(model_config, torch.float32)
    want = (int(0.01 * host_memory_bytes()) - weights) // per_block
    assert blocks_that_fit(config, model_config, torch.float32, torch.device("cpu")) == want
    tiny = ExecutorConfig(tiny_llama, dtype="float32", gpu_memory_utilization=weights / 2**50)
    with pytest.raises(ConfigError, match="gpu_memory_utilization: 0 bytes are left"):
        blocks_that_fit(tiny, model_config, torch.float32, torch.device("cpu"))


def _without_tokenizer(tiny_llama, folder):
    shutil.copytree(tiny_llama, folder)
    for path in folder.iterdir():
        if path.name in TOKENIZER_FILES or "token" in path.name or "template" in path.name:
            path.unlink()
    return folder


def test_a_model_without_tokenizer_files_is_one_line(capsys, tiny_llama, tmp_path):
    folder = _without_tokenizer(tiny_llama, tmp_path / "bare")
    for argv in (
        ["serve", str(folder), "--no-http"],
        ["offline", "Hello", "--model", str(folder)],
        ["tokenizer", "--model", str(folder)],
    ):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"kvpager: {folder} has no tokenizer files"), (argv, err)
        assert "--tokenizer FOLDER" in err and err.count("\n") == 1, err
        assert "sentencepiece" not in err.lower()


def test_tokenizer_and_chat_template_flags(tiny_llama, tmp_path):
    folder = _without_tokenizer(tiny_llama, tmp_path / "bare")
    messages = [{"role": "user", "content": "Hi"}]
    inline = load_tokenizer(folder, tokenizer=str(tiny_llama), chat_template=TEMPLATE)
    assert inline.apply_chat_template(messages, tokenize=False) == "[Hi]"
    (tmp_path / "t.jinja").write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    from_file = load_tokenizer(tiny_llama, chat_template=str(tmp_path / "t.jinja"))
    assert from_file.apply_chat_template(messages, tokenize=False) == "<Hi>"
    with pytest.raises(ConfigError, match="neither a file nor a Jinja template"):
        load_tokenizer(tiny_llama, chat_template=str(tmp_path / "nothing.jinja"))


def test_offline_llm_with_a_tokenizer_folder_and_a_template(tiny_llama, tmp_path):
    """The model folder has no tokenizer: --tokenizer's serves the prompts, the chat template
    and the executor's grammar compiler alike."""
    folder = _without_tokenizer(tiny_llama, tmp_path / "bare")
    llm = LLM(str(folder), tokenizer=str(tiny_llama), chat_template=TEMPLATE, dtype="float32")
    assert llm.apply_chat_template([{"role": "user", "content": "Hi"}]) == llm.tokenizer.encode(
        "[Hi]", add_special_tokens=False
    )
    choice = StructuredOutputsParams(choice=["alpha beta", "gamma"])
    params = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=choice)
    assert llm.generate("Pick:", params, use_tqdm=False)[0].outputs[0].text in choice.choice
    llm.check_invariants()


async def test_max_logprobs_is_a_typed_error_from_the_service(nats_server, tiny_llama, tmp_path):
    """--max-logprobs 2 on the tokenizer service: a request past it gets one invalid_request
    event naming the field (the gateway answers it with a 400)."""
    services = start_services(
        nats_server.url, tiny_llama, tmp_path, "caps", ("tokenizer",), KVPAGER_MAX_LOGPROBS="2"
    )
    client = await Client.connect(nats_server.url, "caps")
    try:
        for field in ("logprobs", "prompt_logprobs"):
            events = await _refused(client, {"prompt": "Hello", field: 3})
            assert len(events) == 1 and events[0].error.type == "invalid_request", events
            assert events[0].error.param == field and "limit (2)" in events[0].error.message
    finally:
        await client.close()
        services.stop()


async def _refused(client: Client, fields: dict, timeout_s: float = 120.0) -> list:
    """The events of a request once the tokenizer has subscribed."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return [event async for event in client.generate(**fields)]
        except NoKvpagerError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)
