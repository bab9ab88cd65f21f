"""TensorParallel: one rank's handle on its group, the collectives the decoder and executor run.

Three process groups, all with timeouts, so no rank ever waits for ever:

    world    gloo, START_TIMEOUT_S   start-up only: the config, the smallest cache, "all built"
    control  gloo, timeout_s         rank 0 -> all: steps as msgpack bytes (a length all-reduce,
                                     then a byte broadcast), keepalives while idle
    compute  gloo on CPU, NCCL on    the all-reduces after o/down and the embedding, the logits
             CUDA, timeout_s         all-gather (on CPU it is the control group)

The length travels as an all-reduce rather than a broadcast so every message, keepalives
included, needs every rank's part: a rank that died or hangs fails it within `timeout_s`.
"""

from datetime import timedelta

import msgspec
import structlog
import torch
import torch.distributed as dist
from kvpager.schemas.executor import RankMessage

log = structlog.get_logger(__name__)

START_TIMEOUT_S = 900.0  # loading a large checkpoint: the slowest rank's load and allocation
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RankMessage)


class TensorParallel:
    """Rank `rank` of `world_size`, joined through `init_method` (`env://`: the torchrun
    variables; rank 0's launcher passes `tcp://...`). `open(timeout_s, device)` follows once
    the executor config is shared."""

    def __init__(
        self, rank: int, world_size: int, local_rank: int, init_method: str = "env://"
    ) -> None:
        assert world_size > 1, "a group of one runs no collectives: use no TensorParallel"
        self.rank, self.world_size = rank, world_size
        self.local_rank = local_rank  # the device index on this node
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=START_TIMEOUT_S),
        )
        self.control = self.compute = None

    def open(self, timeout_s: float, device: torch.device) -> None:
        """The step groups, with the short timeout (every rank calls this, in the same order)."""
        timeout = timedelta(seconds=timeout_s)
        self.control = dist.new_group(backend="gloo", timeout=timeout)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            self.compute = dist.new_group(backend="nccl", timeout=timeout)
        else:
            self.compute = self.control
        log.info("tensor-parallel rank ready", rank=self.rank, world_size=self.world_size)

    # --- the decoder's collectives -----------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place; returns `x`."""
        dist.all_reduce(x, group=self.compute)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, cols] on each rank -> [rows, world_size * cols], rank order along the columns."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.compute)
        return torch.cat(parts, dim=-1)

    # --- start-up (the world group's long timeout) -------------------------------------------

    def smallest(self, value: int) -> int:
        """The minimum of `value` over the ranks (the cache every rank can hold)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    def barrier(self) -> None:
        """Every rank has built its executor; steps and keepalives may start."""
        dist.barrier()

    # --- rank 0 -> every rank ----------------------------------------------------------------

    def send(self, message: RankMessage, start_up: bool = False) -> None:
        """Rank 0: `message` to every other rank (each is in `receive`); `start_up`: on the
        world group (before `open`)."""
        assert self.rank == 0, "only rank 0 sends"
        group = None if start_up else self.control
        payload = _encoder.encode(message)
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.all_reduce(size, group=group)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=group)

    def receive(self, start_up: bool = False) -> RankMessage:
        """Ranks 1..N-1: the next message rank 0 sends."""
        group = None if start_up else self.control
        size = torch.zeros(1, dtype=torch.int64)
        dist.all_reduce(size, group=group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=group)
        return _decoder.decode(data.numpy().tobytes())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
