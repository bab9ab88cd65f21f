"""Tensor-parallel executors: rank 0 as the LLM and the executor service see it, and the loop
the other ranks run.

    build_executor(config)   size 1 and no torchrun: a plain Executor, no collectives at all.
                             Otherwise rank 0: start ranks 1..N-1 here (or, under torchrun, join
                             the ones it started), send them its ExecutorConfig, build its shard;
                             the group's smallest cache sizes everyone's; then keepalives.
    python -m engine.worker.tensor_parallel     ranks 1..N-1 (started here, or by torchrun): join,
                             take rank 0's config, build the shard, run every step rank 0 sends
                             until it says stop or the group fails (exit status 1).

Ranks 1..N-1 receive their steps from rank 0 over torch.distributed (docs/user/
tensor-parallelism.md says why, not from NATS). The torch.distributed variables (`RANK`,
`WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`) are read here and by torch's `env://`.
"""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import structlog
import torch
from kvpager.engine.config import ExecutorConfig
from kvpager.engine.logs import ensure_logging
from kvpager.engine.memory import resolve_device
from kvpager.engine.model_config import ModelConfig
from kvpager.engine.parallel.group import TensorParallel
from kvpager.engine.parallel.ranks import Ranks
from kvpager.engine.parallel.spawn import check_devices, free_port, spawn_ranks, threads_per_rank
from kvpager.engine.worker.executor import Executor, rank_device
from kvpager.schemas.errors import ConfigError
from kvpager.schemas.executor import RankConfig, RankReset, RankShutdown, RankStep

log = structlog.get_logger(__name__)


def torchrun_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when started by torchrun (or alike) into a group > 1."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    rank = int(os.environ["RANK"])
    return rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", rank))


def build_executor(config: ExecutorConfig, model_config: ModelConfig) -> Executor:
    """The executor the rest of the system drives: alone, or rank 0 of its group."""
    joined = torchrun_rank()
    if joined is None and config.tensor_parallel_size == 1:
        return Executor(config, model_config)
    if joined is not None:
        if config.tensor_parallel_size not in (1, joined[1]):
            raise ConfigError(
                f"tensor_parallel_size: {config.tensor_parallel_size}, but WORLD_SIZE is "
                f"{joined[1]}"
            )
        assert joined[0] == 0, "ranks other than 0 run run_rank()"
        config = dataclasses.replace(config, tensor_parallel_size=joined[1])
    model_config.check_tensor_parallel(config.tensor_parallel_size)
    check_devices(resolve_device(config.device), config.tensor_parallel_size)
    return _join_or_start(config, model_config, joined)


def _join_or_start(
    config: ExecutorConfig, model_config: ModelConfig, joined: tuple[int, int, int] | None
) -> Executor:
    size = config.tensor_parallel_size
    processes: list[subprocess.Popen] = []
    if joined is not None:
        group = TensorParallel(0, size, joined[2])
    else:
        port, device = free_port(), resolve_device(config.device)
        threads = threads_per_rank(device, size)
        processes = spawn_ranks(size, port, threads)
        if device.type == "cpu":  # the ranks share the cores this process had
            torch.set_num_threads(threads)
        group = TensorParallel(0, size, 0, f"tcp://127.0.0.1:{port}")
    try:
        return _rank_zero(group, config, model_config, processes)
    except BaseException:
        for process in processes:
            process.kill()
            process.wait()
        group.close()
        raise


def _rank_zero(
    group: TensorParallel,
    config: ExecutorConfig,
    model_config: ModelConfig,
    processes: list[subprocess.Popen],
) -> Executor:
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    if config.speculative_config is not None:  # msgpack-friendly: as JSON
        fields["speculative_config"] = config.speculative_config.to_json()
    group.send(RankConfig({**fields, "model_path": str(config.model_path)}), start_up=True)
    group.open(config.tensor_parallel_timeout, rank_device(config.device, group))
    ranks = Ranks(group, processes, keepalive_interval(config))
    executor = Executor(config, model_config, group, ranks)
    group.barrier()
    ranks.start()
    return executor


def keepalive_interval(config: ExecutorConfig) -> float:
    return min(1.0, config.tensor_parallel_timeout / 4)


def run_rank(rank: int, world_size: int, local_rank: int) -> int:
    """Ranks 1..N-1: 0 when rank 0 said stop, 1 when the group failed."""
    group = TensorParallel(rank, world_size, local_rank)
    try:
        message = group.receive(start_up=True)
        assert isinstance(message, RankConfig), f"expected the config first, got {message!r}"
        fields = {**message.fields, "model_path": Path(str(message.fields["model_path"]))}
        config = ExecutorConfig(**fields)
        group.open(config.tensor_parallel_timeout, rank_device(config.device, group))
        executor = Executor(config, ModelConfig.from_path(config.model_path), group)
        group.barrier()
        return _serve(group, executor)
    finally:
        group.close()


def _serve(group: TensorParallel, executor: Executor) -> int:
    while True:
        try:
            message = group.receive()
            if isinstance(message, RankStep):
                executor.execute(message.step)
            elif isinstance(message, RankReset):
                executor.reset()
            elif isinstance(message, RankShutdown):
                return 0
        except Exception as exc:  # noqa: BLE001  (rank 0 gone or hung, or a failed step)
            log.error("tensor-parallel rank leaves its group", rank=group.rank, error=repr(exc))
            return 1


def main() -> int:
    ensure_logging()
    joined = torchrun_rank()
    if joined is None or joined[0] == 0:
        print("run by rank 0 (or torchrun) with RANK > 0 and WORLD_SIZE > 1", file=sys.stderr)
        return 2
    return run_rank(*joined)


if __name__ == "__main__":
    sys.exit(main())
