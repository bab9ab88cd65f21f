"""Peers from transformers, on the same checkpoint folder kvpager loads.

- `generate` on left-padded static batches: the "traditional" system. A batch runs until its
  longest request is done; shorter rows keep computing (wasted work, counted in `extra`), and
  the batch's results come back together when `generate` returns. Token times come from a
  stopping criterion called once per decoding step: what a streaming server would see.
- continuous batching (`ContinuousBatchingManager`, what `generate_batch` drives) with its paged
  cache sized explicitly: `num_blocks` from the same KV budget and `max_batch_tokens` equal to
  kvpager's token budget. Its default sizing takes most of the RAM and warms up for long.
"""

import time

import torch
from kvpager.services.bench.metrics import EngineResult, SequenceTimes
from kvpager.services.bench.workloads import Workload
from transformers import (
    AutoModelForCausalLM,
    ContinuousBatchingConfig,
    GenerationConfig,
    StoppingCriteria,
    StoppingCriteriaList,
)

from benchmarks.common.config import BenchConfig, kv_bytes_per_token

CB_PAGE_SIZE = 256  # transformers' default page size (tokens per page and layer)


def load_model(cfg: BenchConfig):
    model = AutoModelForCausalLM.from_pretrained(str(cfg.model_path), dtype=cfg.torch_dtype)
    return model.eval()


class _StepClock(StoppingCriteria):
    """Records the time each decoding step ends; never stops generation."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.times.append(time.perf_counter() - self.start)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _static_batches(workload: Workload, batch_rows: int) -> list[list[int]]:
    """Request indices per batch, in arrival order; a batch holds `batch_rows` sequences."""
    n = workload.requests[0].n
    per_batch = max(1, batch_rows // n)
    idx = list(range(len(workload.requests)))
    return [idx[i : i + per_batch] for i in range(0, len(idx), per_batch)]


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def _generate_config(model, max_new_tokens: int, n: int, temperature: float) -> GenerationConfig:
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,  # EOS is masked until then: transformers' ignore_eos
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_k=None,
        top_p=None,
        num_return_sequences=n,
        pad_token_id=pad_id,
    )


@torch.inference_mode()
def run_static(model, workload: Workload, cfg: BenchConfig, warm: bool = True) -> EngineResult:
    if warm:
        model.generate(torch.tensor([[100] * 8]), max_new_tokens=4, min_new_tokens=4)
    n, temperature = workload.requests[0].n, workload.requests[0].temperature
    assert all(r.n == n and r.temperature == temperature for r in workload.requests)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    sequences, finish_times = {}, [0.0] * len(workload.requests)
    computed = 0
    start = time.perf_counter()
    for batch in _static_batches(workload, cfg.hf_batch_size):
        requests = [workload.requests[i] for i in batch]
        ids, mask = _left_pad([r.prompt_token_ids for r in requests], pad_id)
        longest = max(r.max_tokens for r in requests)
        if requests[0].seed is not None:
            torch.manual_seed(requests[0].seed)
        clock = _StepClock(start)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            generation_config=_generate_config(model, longest, n, temperature),
            stopping_criteria=StoppingCriteriaList([clock]),
        )
        assert out.shape[1] - ids.shape[1] == longest, "static batch stopped early"
        done = time.perf_counter() - start
        computed += longest * len(requests) * n
        for i, request in zip(batch, requests):
            sequences[i] = [SequenceTimes(clock.times[: request.max_tokens]) for _ in range(n)]
            finish_times[i] = done  # the batch's results return together
    elapsed = time.perf_counter() - start
    return EngineResult(
        f"transformers generate (static batch {cfg.hf_batch_size})",
        workload.name,
        cfg.dtype,
        elapsed_s=elapsed,
        num_requests=len(workload.requests),
        num_prompt_tokens=workload.num_prompt_tokens,
        num_output_tokens=workload.num_output_tokens,
        sequences=sequences,
        finish_times=finish_times,
        latency_source="per decoding step of the static batch (results return at batch end)",
        extra={
            "computed_output_tokens": computed,
            "padding_waste": round(1 - workload.num_output_tokens / computed, 4),
        },
    )


def _cb_config(cfg: BenchConfig) -> ContinuousBatchingConfig:
    per_block = CB_PAGE_SIZE * kv_bytes_per_token(cfg.model_path, cfg.torch_dtype)
    return ContinuousBatchingConfig(
        page_size=CB_PAGE_SIZE,
        num_blocks=max(1, cfg.kv_cache_bytes // per_block),
        max_batch_tokens=cfg.max_num_batched_tokens,
        max_requests_per_batch=cfg.max_num_seqs,
        allow_block_sharing=cfg.enable_prefix_caching,
        seed=cfg.seed,
    )


@torch.inference_mode()
def run_continuous(model, workload: Workload, cfg: BenchConfig) -> EngineResult:
    n, temperature = workload.requests[0].n, workload.requests[0].temperature
    assert all(r.n == n and r.temperature == temperature for r in workload.requests)
    longest = max(r.max_tokens for r in workload.requests)
    gen_config = _generate_config(model, longest, n, temperature)
    gen_config.min_new_tokens = None
    gen_config.eos_token_id = -1  # no EOS: every request runs to its own max_new_tokens
    cb_config = _cb_config(cfg)
    with model.continuous_batching_context_manager(
        generation_config=gen_config,
        continuous_batching_config=cb_config,
        block=True,
        timeout=None,  # wait for the loop to stop before the next workload's manager
        warmup=True,
    ) as manager:
        _wait(manager, [manager.add_request([100] * 8, max_new_tokens=4, eos_token_id=-1)], n)
        start = time.perf_counter()
        ids = [
            manager.add_request(
                list(r.prompt_token_ids),
                request_id=f"bench-{i}",
                max_new_tokens=r.max_tokens,
                record_timestamps=True,
                eos_token_id=-1,
            )
            for i, r in enumerate(workload.requests)
        ]
        results = _wait(manager, ids, n)
        elapsed = time.perf_counter() - start
    sequences, finish_times = {}, []
    for i, request in enumerate(workload.requests):
        outs = results[ids[i]]
        assert all(len(o.generated_tokens) == request.max_tokens for o in outs), ids[i]
        sequences[i] = [SequenceTimes([t - start for t in o.timestamps]) for o in outs]
        finish_times.append(max(o.lifespan[1] for o in outs) - start)
    return EngineResult(
        "transformers continuous batching",
        workload.name,
        cfg.dtype,
        elapsed_s=elapsed,
        num_requests=len(workload.requests),
        num_prompt_tokens=workload.num_prompt_tokens,
        num_output_tokens=workload.num_output_tokens,
        sequences=sequences,
        finish_times=finish_times,
        latency_source="per token (transformers' record_timestamps)",
        extra={"num_blocks": cb_config.num_blocks, "page_size": CB_PAGE_SIZE},
    )


def _wait(manager, request_ids: list[str], n: int, timeout_s: float = 3600.0) -> dict:
    """Collect finished outputs: request id -> its n sequences (children are `<id>__child#k`)."""
    results: dict[str, list] = {rid: [] for rid in request_ids}
    deadline = time.monotonic() + timeout_s
    remaining = len(request_ids) * n
    while remaining:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running() or time.monotonic() > deadline:
                raise RuntimeError("transformers continuous batching stopped before finishing")
            continue
        if result.is_finished():
            assert result.error is None, result.error
            results[result.request_id.split("__child#")[0]].append(result)
            remaining -= 1
    return results
