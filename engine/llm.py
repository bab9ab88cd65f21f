"""LLM: the offline API. One process, no NATS, the same engine core the services drive.

prompts -> InputProcessor.process (token ids, chat template, checks) -> EngineCore.add
-> EngineCore.run_step() until done (executor in-process, on its own thread, `plan_ahead`
   steps ahead as served) -> SampleDeltas -> SampleOutput per sample -> RequestOutputs
"""

import itertools
import sys
import threading
import weakref
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from kvpager.engine.config import EngineConfig
from kvpager.engine.core import EngineCore, build_scheduler
from kvpager.engine.download import resolve_model
from kvpager.engine.frontend.event_loop import LoopThread
from kvpager.engine.frontend.inputs import InputProcessor
from kvpager.engine.frontend.output_processor import SampleOutput
from kvpager.engine.frontend.outputs import (
    CompletionOutput,
    RequestOutput,
    prompt_logprob_list,
    sample_logprob_list,
)
from kvpager.engine.frontend.tokenizer_files import load_tokenizer
from kvpager.engine.logs import ensure_logging
from kvpager.engine.memory import resolve_device
from kvpager.engine.model_config import ModelConfig
from kvpager.engine.request import Request
from kvpager.engine.worker.step_runner import InProcessExecutor
from kvpager.engine.worker.tensor_parallel import build_executor
from kvpager.schemas.errors import InvalidRequestError
from kvpager.schemas.public_requests import PromptCache
from kvpager.schemas.sampling import SamplingParams
from kvpager.schemas.tokenizer import SampleDelta
from tqdm import tqdm

Prompt = str | list[int]
T = TypeVar("T")
MAX_IDLE_STEPS = 3  # steps in a row that compute nothing while nothing runs: a stall


@dataclass
class _Tracked:
    """An in-flight request (all its samples) with its output being assembled."""

    request: Request
    output: RequestOutput
    samples: list[SampleOutput]
    num_finished: int = 0


class LLM:
    """Generate from a checkpoint folder or a known model name, vLLM style:

    llm = LLM("smollm2-135m-instruct", dtype="float32")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=32))

    `tokenizer`: a tokenizer folder other than the model's; `chat_template`: a Jinja file or
    template for `chat` (vLLM's names). Other keyword arguments are EngineConfig's fields
    (`plan_ahead=0` runs in lockstep; `tensor_parallel_size=N` shards the model over N ranks,
    one process and device each: this process is rank 0 and starts the others). `close()` (or
    `with LLM(...)`) stops them.
    """

    def __init__(
        self,
        model: str,
        tokenizer: str | None = None,
        chat_template: str | None = None,
        **engine_args: Any,
    ) -> None:
        ensure_logging()
        path = resolve_model(model, progress=sys.stderr.isatty())
        self.config = EngineConfig(tokenizer=tokenizer, **engine_args)
        self.model_config = ModelConfig.from_path(path)
        self.tokenizer = load_tokenizer(path, self.config.tokenizer, chat_template)
        self.inputs = InputProcessor(
            self.tokenizer,
            self.model_config.vocab_size,
            allow_special_tokens_in_content=self.config.allow_special_tokens_in_content,
        )
        executor_config = self.config.executor_config(path, self.model_config)
        self.runner = InProcessExecutor(
            lambda: build_executor(executor_config, self.model_config),
            resolve_device(executor_config.device),
        )
        self.executor = self.runner.executor
        self.scheduler = build_scheduler(self.config, self.executor.ready("in-process", str(path)))
        self.core = EngineCore(self.scheduler, self.runner, self._on_deltas, self.config.plan_ahead)
        self._loop = LoopThread()
        weakref.finalize(self, _end_dropped, self._loop, self.runner)
        self._tracked: dict[str, _Tracked] = {}
        self._bar: tqdm | None = None
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the executor's thread and, under tensor parallelism, its other ranks (also when
        the LLM is dropped)."""
        self.runner.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | dict[str, Any] | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        cache: PromptCache | dict | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. As
        GenerateRequest's: `cache` (a PromptCache, or its fields: pin the prompt's prefix),
        `priority` and `cache_salt` (whose pin quota the pins count against)."""
        retention = _retention(cache, priority, cache_salt)
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = self._params_per_prompt(sampling_params, len(prompts))
        tracked = [self._prepare(sp, retention, prompt=p) for p, sp in zip(prompts, params)]
        return self._run(tracked, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        use_tqdm: bool = True,
        tools: list[dict[str, Any]] | None = None,
        *,
        cache: PromptCache | dict | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation (with `tools`, OpenAI's
        definitions, for templates that render them), then generate (`cache`, `priority`,
        `cache_salt`: as generate's; `cache.prefix_messages` counts messages)."""
        retention = _retention(cache, priority, cache_salt)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params = self._params_per_prompt(sampling_params, len(conversations))
        tracked = [
            self._prepare(sp, retention, messages=c, tools=tools)
            for c, sp in zip(conversations, params)
        ]
        return self._run(tracked, use_tqdm)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self.inputs.chat_ids(messages)

    def stats(self) -> dict[str, Any]:
        """The engine's Stats (the same as `llm.stats` over NATS) as a dict."""
        return msgspec.structs.asdict(self.core.stats("offline"))

    def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the engine's loop thread (where the core runs) and wait."""
        return self._loop.run(coro)

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    def _params_per_prompt(self, sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, dict):
            return [SamplingParams.from_dict(sampling_params)] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if len(sampling_params) != count:
            raise InvalidRequestError("sampling_params: one per prompt", "sampling_params")
        return list(sampling_params)

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | dict[str, Any],
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Beam search (`beam_width` > 1): each output holds the best `n` beams, best first."""
        params = self._params_per_prompt(sampling_params, 1)[0]
        if not params.is_beam_search:
            raise InvalidRequestError("beam_width: must be > 1 for beam search", "beam_width")
        return self.generate(prompts, params, use_tqdm)

    def _prepare(self, params: SamplingParams, retention: "_Retention", **prompt: Any) -> _Tracked:
        """One request down the input path (as the tokenizer service sends one), its prompt
        checked against the scheduler's limits before its grammar compiles."""
        eos_token_ids = self.model_config.eos_token_ids
        cache, priority, salt = retention
        request = Request(str(next(self._ids)), [], params, eos_token_ids, cache_salt=salt)
        request.priority = priority

        def fits(token_ids: list[int], param: str) -> None:
            request.prompt_token_ids = token_ids
            self.scheduler.check_request(request)

        processed = self.run_async(self.inputs.process(params, check=fits, cache=cache, **prompt))
        if cache is not None:
            request.pin_tokens, request.pin_ttl = processed.num_pinned_tokens, cache.ttl
        return self._track(request, prompt.get("prompt"))

    def _track(self, request: Request, prompt: Prompt | None) -> _Tracked:
        token_ids, params = request.prompt_token_ids, request.sampling_params
        output = RequestOutput(
            request_id=request.request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=token_ids,
            outputs=[CompletionOutput(index=i, text="", token_ids=[]) for i in range(params.n)],
        )
        samples = [SampleOutput(self.tokenizer, token_ids, params) for _ in range(params.n)]
        return _Tracked(request, output, samples)

    def _run(self, tracked: list[_Tracked], use_tqdm: bool) -> list[RequestOutput]:
        for item in tracked:  # everything was validated (_prepare) before anything is queued
            self.core.add(item.request)
            self._tracked[item.request.request_id] = item
        show = use_tqdm and sys.stderr.isatty()
        with tqdm(total=len(tracked), disable=not show, desc="generate") as self._bar:
            self.run_async(self._drive())
        return [item.output for item in tracked]

    async def _drive(self) -> None:
        """Steps until every request has finished and the executor has dropped its rows."""
        core, idle_steps = self.core, 0
        while core.has_work:
            await core.run_step()
            scheduler = self.scheduler
            stalled = core.is_spinning and not (
                scheduler.running or scheduler.block_manager.disk.busy
            )
            idle_steps = idle_steps + 1 if stalled else 0
            if idle_steps > MAX_IDLE_STEPS:
                raise RuntimeError("scheduler stalled: nothing runs and nothing is admitted")
        await core.publish()

    async def _on_deltas(self, deltas: list[SampleDelta], step_id: int) -> None:
        """The output path: each sample's text, stop strings ended through the core."""
        for delta in deltas:
            item = self._tracked[delta.request_id]
            sample = item.samples[delta.index]
            if delta.prompt_logprobs is not None:
                item.output.prompt_logprobs = prompt_logprob_list(
                    item.output.prompt_token_ids, delta.prompt_logprobs, self._decode_one
                )
            update = sample.add(delta)
            if update is None:
                continue
            completion = item.output.outputs[delta.index]
            completion.text += update.text
            completion.token_ids += update.token_ids
            if update.logprobs is not None:
                shaped = sample_logprob_list(update.token_ids, update.logprobs, self._decode_one)
                completion.logprobs = (completion.logprobs or []) + shaped
            if update.stop_matched:
                self.core.finish_early(delta.request_id, "stop", delta.index, sample.stop_string)
            if sample.finished:
                self._finish(item, completion, sample)

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _finish(self, item: _Tracked, completion: CompletionOutput, sample: SampleOutput) -> None:
        completion.finish_reason = sample.finish_reason
        completion.stop_reason = sample.stop_reason
        completion.cumulative_score = sample.cumulative_score
        completion.error = sample.error
        output = item.output
        if sample.num_cached_tokens >= output.num_cached_tokens:
            output.cached_tokens_by_tier = dict(sample.cached_tokens_by_tier)
        output.num_cached_tokens = max(output.num_cached_tokens, sample.num_cached_tokens)
        output.num_cache_write_tokens = max(
            output.num_cache_write_tokens, sample.num_cache_write_tokens
        )
        item.num_finished += 1
        if item.num_finished == len(item.samples):
            del self._tracked[item.request.request_id]
            self._bar.update(1)


_Retention = tuple[PromptCache | None, int, str | None]


def _retention(
    cache: PromptCache | dict | None, priority: int, cache_salt: str | None
) -> _Retention:
    """generate's and chat's `cache`, `priority` and `cache_salt`, checked as over NATS."""
    if cache is not None:  # a PromptCache made in Python is not checked against its bounds
        fields = cache if isinstance(cache, dict) else msgspec.to_builtins(cache)
        try:
            cache = msgspec.convert(fields, PromptCache)
        except msgspec.ValidationError as exc:
            raise InvalidRequestError(f"cache: {exc}", "cache") from exc
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError("priority: must be an integer", "priority")
    return cache, priority, cache_salt


def _end_dropped(loop: LoopThread, runner: InProcessExecutor) -> None:
    """An LLM dropped without close(): its step thread, any other ranks and its loop thread
    end too, here, unless joining a thread here could deadlock; then the loop's thread closes
    the runner (and the interpreter's exit waits for it)."""
    if _inside_a_thread_start():
        loop.stop_after(runner.close)
    else:
        runner.close()
        loop.close()


def _inside_a_thread_start() -> bool:
    """A collection may run finalizers on whatever thread it interrupts. A new thread holds
    threading's lock of locks while it boots, and a join waits for that lock: a CI run hung
    so, a disk reader thread's start collecting an older LLM whose close joined its step
    thread. Held by another thread, the lock only costs a deferred close."""
    lock = getattr(threading, "_shutdown_locks_lock", None)  # CPython <= 3.12
    return lock is not None and lock.locked()
