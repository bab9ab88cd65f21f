"""Run one workload on vLLM (CPU build), inside vLLM's own virtualenv; print results as JSON.

    <vllm-venv>/bin/python benchmarks/peers/vllm_worker.py CONFIG.json  < one Workload JSON a line

Started by benchmarks/peers/vllm_peer.py, which sets VLLM_CPU_* in the environment. It loads the
model once, prints READY_MARKER, then runs each workload read from stdin and prints one
RESULT_MARKER line for it (vLLM logs to stdout as well, so markers tell the lines apart). The
requests go through `LLMEngine.add_request` / `step()` with DELTA outputs, which is what
`LLM.generate` does internally, so each token gets the time its step's output reached this
process.
"""

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

READY_MARKER = "KVPAGER_BENCH_READY "
RESULT_MARKER = "KVPAGER_BENCH_RESULT "


def read_workload(line: str) -> SimpleNamespace:
    """One Workload's JSON (kvpager.services.bench.workloads), read without kvpager, which this
    virtualenv lacks: its requests' fields as attributes."""
    raw = json.loads(line)
    return SimpleNamespace(requests=[SimpleNamespace(**r) for r in raw["requests"]])


def sampling_params(request, kind):
    from vllm import SamplingParams

    return SamplingParams(
        n=request.n,
        temperature=request.temperature,
        max_tokens=request.max_tokens,
        ignore_eos=True,
        seed=request.seed,
        output_kind=kind,
    )


def build_llm(config: dict):
    from vllm import LLM

    return LLM(
        model=config["model_path"],
        dtype=config["dtype"],
        max_model_len=config["max_model_len"],
        max_num_seqs=config["max_num_seqs"],
        max_num_batched_tokens=config["max_num_batched_tokens"],
        enable_prefix_caching=config["enable_prefix_caching"],
        enforce_eager=config.get("enforce_eager", False),  # default: vLLM's compiled mode
        seed=config["seed"],
        kv_cache_memory_bytes=config.get("kv_cache_memory_bytes"),  # kvpager's budget, exactly
    )


def warm_up(llm) -> None:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=[100 + i] * (8 + 8 * i)) for i in range(4)]
    llm.generate(prompts, params, use_tqdm=False)
    llm.reset_prefix_cache()


def run_stepped(llm, workload: SimpleNamespace) -> dict:
    """Token times per sequence, through the engine's add_request / step loop."""
    from vllm import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    times = [[[] for _ in range(r.n)] for r in workload.requests]
    finish = [0.0] * len(workload.requests)
    start = time.perf_counter()
    for idx, request in enumerate(workload.requests):
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        engine.add_request(
            f"bench-{idx}", prompt, sampling_params(request, RequestOutputKind.DELTA)
        )
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter() - start
        for output in outputs:
            idx = int(output.request_id.split("-")[1])
            for completion in output.outputs:
                times[idx][completion.index].extend([now] * len(completion.token_ids))
            if output.finished:
                finish[idx] = now
    elapsed = time.perf_counter() - start
    llm.reset_prefix_cache()
    return {"elapsed_s": elapsed, "token_times": times, "finish_times": finish}


def run_generate(llm, workload: SimpleNamespace) -> dict:
    """Plain `LLM.generate`: throughput only."""
    from vllm import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for r in workload.requests]
    params = [sampling_params(r, RequestOutputKind.FINAL_ONLY) for r in workload.requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    llm.reset_prefix_cache()
    return {"elapsed_s": elapsed, "num_output_tokens": produced}


def main(argv: list[str]) -> None:
    """Load once, then answer one workload per stdin line until stdin closes."""
    config = json.loads(Path(argv[0]).read_text())
    import torch
    import vllm

    torch.set_num_threads(config["num_threads"])
    started = time.perf_counter()
    llm = build_llm(config)
    warm_up(llm)
    info = {
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "load_s": round(time.perf_counter() - started, 2),
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
    }
    print(READY_MARKER + json.dumps(info), flush=True)
    for line in sys.stdin:
        workload = read_workload(line)
        result = {"stepped": run_stepped(llm, workload)}
        if config.get("plain_generate"):
            result["generate"] = run_generate(llm, workload)
        print(RESULT_MARKER + json.dumps(result), flush=True)


if __name__ == "__main__":  # vLLM starts its engine core in a subprocess: keep the guard
    main(sys.argv[1:])
