"""Every engine behind the same three calls: build (load, warm up), `run(workload)`, `close()`.

All peers of a dtype stay loaded together, so the runner can interleave them workload by
workload: engines measured minutes apart on a shared machine see different background load.
"""

import gc
from pathlib import Path

from kvpager.services.bench.metrics import EngineResult
from kvpager.services.bench.offline import warm_up
from kvpager.services.bench.workloads import Workload

from benchmarks.common.config import BenchConfig
from benchmarks.engine import kvpager_offline
from benchmarks.peers import hf_peers
from benchmarks.peers.vllm_peer import VllmPeer
from benchmarks.serving.nats_peer import NatsPeer

ENGINES = ("kvpager", "nats", "hf-static", "hf-cb", "vllm", "vllm-eager")


class KvpagerPeer:
    def __init__(self, cfg: BenchConfig, plain_generate: bool) -> None:
        self.cfg = cfg
        self.plain_generate = plain_generate
        self.llm = kvpager_offline.build_llm(cfg)
        warm_up(self.llm)

    def run(self, workload: Workload) -> list[EngineResult]:
        results = [kvpager_offline.drive(self.llm, workload, "kvpager offline", self.cfg.dtype)]
        if self.plain_generate:
            results.append(kvpager_offline.run_generate(self.llm, workload, self.cfg.dtype))
        return results

    def close(self) -> None:
        self.llm.check_invariants()
        del self.llm


class HfStaticPeer:
    def __init__(self, cfg: BenchConfig, model) -> None:
        self.cfg, self.model = cfg, model

    def run(self, workload: Workload) -> list[EngineResult]:
        return [hf_peers.run_static(self.model, workload, self.cfg)]

    def close(self) -> None:
        pass


class HfContinuousPeer(HfStaticPeer):
    def run(self, workload: Workload) -> list[EngineResult]:
        return [hf_peers.run_continuous(self.model, workload, self.cfg)]


def build_peers(engines, cfg: BenchConfig, out_dir: Path, plain_generate: bool) -> list:
    """Peers in a fixed order; the transformers peers share one model."""
    peers = []
    if "kvpager" in engines:
        peers.append(KvpagerPeer(cfg, plain_generate))
    if "nats" in engines:
        peers.append(NatsPeer(cfg))
    if {"hf-static", "hf-cb"} & set(engines):
        model = hf_peers.load_model(cfg)
        if "hf-static" in engines:
            peers.append(HfStaticPeer(cfg, model))
        if "hf-cb" in engines:
            peers.append(HfContinuousPeer(cfg, model))
    if "vllm" in engines:  # the default, compiled mode
        peers.append(VllmPeer(cfg, out_dir / f"vllm-{cfg.dtype}.log", plain_generate))
    if "vllm-eager" in engines:
        log_path = out_dir / f"vllm-eager-{cfg.dtype}.log"
        peers.append(VllmPeer(cfg, log_path, plain_generate, eager=True))
    return peers


def close_peers(peers: list) -> None:
    for peer in peers:
        peer.close()
    peers.clear()
    gc.collect()
