"""LLM: the offline API. One process, no NATS: schedule, execute, update, in a loop."""

import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm
from transformers import AutoTokenizer

from engine.config import CacheConfig, ModelConfig, SchedulerConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.download import resolve_model
from engine.executor import Executor, ExecutorConfig
from engine.logs import ensure_logging
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from schemas.errors import InvalidRequestError
from schemas.sampling import SamplingParams

Prompt = str | list[int]


@dataclass
class _Tracked:
    """An in-flight request (all its samples) with its output being assembled."""

    request: Request
    output: RequestOutput
    detokenizers: list[IncrementalDetokenizer]
    num_finished: int = 0


class LLM:
    """Generate from a checkpoint folder or a known model name, vLLM style:

    llm = LLM("smollm2-135m-instruct", dtype="float32")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=32))
    """

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "auto",
        device: str = "auto",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        attention_backend: str = "auto",
        seed: int = 0,
        swap_space: int | None = None,
        preemption_mode: str = "auto",
        kv_cache_dtype: str = "auto",
    ) -> None:
        ensure_logging()
        path = resolve_model(model, progress=sys.stderr.isatty())
        self.model_config = ModelConfig.from_path(path)
        max_model_len = max_model_len or min(self.model_config.max_position_embeddings, 8192)
        if self.model_config.sliding_window:  # full attention is exact up to the window
            max_model_len = min(max_model_len, self.model_config.sliding_window)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.executor = Executor(
            ExecutorConfig(
                model_path=path,
                dtype=dtype,
                device=device,
                block_size=block_size,
                num_blocks=num_blocks,
                kv_cache_memory=kv_cache_memory,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                attention_backend=attention_backend,
                seed=seed,
                swap_space=swap_space,
                kv_cache_dtype=kv_cache_dtype,
            ),
            self.model_config,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                enable_chunked_prefill=enable_chunked_prefill,
                preemption_mode=preemption_mode,
            ),
            CacheConfig(
                block_size,
                self.executor.num_blocks,
                enable_prefix_caching,
                self.executor.num_cpu_blocks,
                swap_is_cheap=self.executor.device.type == "cpu",
            ),
        )
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | dict[str, Any] | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = self._params_per_prompt(sampling_params, len(prompts))
        tracked = [self._track(p, sp) for p, sp in zip(prompts, params)]
        for item in tracked:  # everything is validated before anything is queued
            self.scheduler.check_request(item.request)
        for item in tracked:
            self.scheduler.add_request(item.request)
        self._run(tracked, use_tqdm and sys.stderr.isatty())
        return [item.output for item in tracked]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not self.tokenizer.chat_template:
            raise InvalidRequestError("messages: this model has no chat template", "messages")
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )

    def stats(self) -> dict[str, Any]:
        manager, stats = self.scheduler.block_manager, self.scheduler.stats
        return {
            "num_blocks": manager.num_blocks,
            "block_size": manager.block_size,
            "num_free_blocks": manager.num_free_blocks,
            "num_used_blocks": manager.num_used_blocks,
            "num_cached_blocks": manager.num_cached_blocks,
            "peak_used_blocks": stats.peak_used_blocks,
            "peak_running": stats.peak_running,
            "num_preemptions": stats.num_preemptions,
            "num_swap_preemptions": stats.num_swap_preemptions,
            "num_cpu_blocks": manager.cpu.num_blocks,
            "num_swapped_out_blocks": manager.num_swapped_out_blocks,
            "num_swapped_in_blocks": manager.num_swapped_in_blocks,
            "num_evictions": manager.num_evictions,
            "num_block_copies": manager.num_copies,
            "num_steps": stats.num_steps,
            "prefix_cache_queried_tokens": stats.prefix_queried_tokens,
            "prefix_cache_hit_tokens": stats.prefix_hit_tokens,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
        }

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

    def _token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
        if not token_ids:
            raise InvalidRequestError("prompt: must not be empty", "prompt")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"prompt: token ids must be in [0, {vocab})", "prompt")
        return token_ids

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

    def _track(self, prompt: Prompt, params: SamplingParams) -> _Tracked:
        token_ids = self._token_ids(prompt)
        request = Request(
            request_id=str(next(self._ids)),
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.model_config.eos_token_ids,
        )
        output = RequestOutput(
            request_id=request.request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=token_ids,
            outputs=[CompletionOutput(index=i, text="", token_ids=[]) for i in range(params.n)],
        )
        detokenizers = [
            IncrementalDetokenizer(self.tokenizer, token_ids, params) for _ in range(params.n)
        ]
        return _Tracked(request, output, detokenizers)

    def _run(self, tracked: list[_Tracked], show_progress: bool) -> None:
        by_group = {item.request.group_id: item for item in tracked}
        with tqdm(total=len(tracked), disable=not show_progress, desc="generate") as bar:
            while self.scheduler.has_unfinished:
                step = self.scheduler.schedule()
                if not step.num_scheduled_tokens and not self.scheduler.running:
                    raise RuntimeError("scheduler stalled: nothing runs and nothing is admitted")
                output = self.executor.execute(step)
                logprobs = dict(zip(output.req_ids, output.logprobs or ()))
                for request in self.scheduler.update_from_output(step, output):
                    item = by_group[request.group_id]
                    if self._absorb(item, request, logprobs.get(request.request_id)):
                        bar.update(1)
                for group_id, beams in self.scheduler.take_beam_results().items():
                    self._absorb_beams(by_group[group_id], beams)
                    bar.update(1)
            if self.scheduler.finished_req_ids:  # let the executor drop finished rows now
                self.executor.execute(self.scheduler.schedule())

    def _absorb_beams(self, item: _Tracked, beams) -> None:
        skip = item.request.sampling_params.skip_special_tokens
        for completion, beam in zip(item.output.outputs, beams):
            completion.token_ids = beam.token_ids
            completion.text = self.tokenizer.decode(beam.token_ids, skip_special_tokens=skip)
            completion.finish_reason = beam.finish_reason
            completion.cumulative_score = float(beam.score)

    def _absorb(self, item: _Tracked, request: Request, logprobs) -> bool:
        """Append a sample's newest token to its output; True once every sample finished."""
        completion = item.output.outputs[request.sample_index]
        detokenizer = item.detokenizers[request.sample_index]
        completion.token_ids.append(request.output_token_ids[-1])
        if logprobs is not None:
            completion.logprobs = (completion.logprobs or []) + [logprobs]
        completion.text += detokenizer.add_tokens(request.output_token_ids[-1:])
        if detokenizer.stopped is not None and not request.is_finished:
            request.stop_reason = detokenizer.stopped
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
        if not request.is_finished:
            return False
        completion.text += detokenizer.flush()
        completion.finish_reason = request.status.value
        completion.stop_reason = request.stop_reason
        item.output.num_cached_tokens = item.request.num_cached_tokens
        item.num_finished += 1
        return item.num_finished == len(item.output.outputs)
