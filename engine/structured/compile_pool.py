"""Compile-checks in worker processes, so that a grammar that crashes or floods llguidance
takes down a worker and fails its own request, never the gateway or the tokenizer.

    front door --check / check_async--> CompilePool --spec (msgpack)--> worker process
        worker: RLIMIT_AS = compile_memory, llguidance's LLParserLimits; answers None or
        (message, param); a crash (SIGSEGV: llguidance's stack) breaks the pool

A worker that dies, or a compile past `compile_timeout`, fails that request with a typed 400
and the pool is rebuilt (its workers killed); the next compile gets fresh workers. Workers
start by `spawn` (the parents run NATS threads, which fork would copy mid-flight) and import
no torch. Specs that compiled are remembered by sha256, so a repeated spec costs nothing.
"""

import asyncio
import ctypes
import multiprocessing
import resource
import signal
from collections import OrderedDict
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool

import msgspec
import structlog
from kvpager.engine.structured.grammar import GrammarCompiler, spec_key, validate
from kvpager.engine.structured.limits import GrammarLimits
from kvpager.schemas.errors import InvalidRequestError
from kvpager.schemas.sampling import StructuredOutputsParams

log = structlog.get_logger(__name__)
NUM_REMEMBERED = 1024  # sha256 of specs that compiled
PR_SET_PDEATHSIG = 1  # linux/prctl.h

# --- in the worker process ---------------------------------------------------------------

_compiler: GrammarCompiler | None = None  # the worker's own (None: a check without tokenizer)


def _start_worker(memory: int, tokenizer_json: str | None, vocab_size: int, eos: int) -> None:
    global _compiler
    _die_with_parent()
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    if tokenizer_json is not None:
        _compiler = GrammarCompiler.from_tokenizer_json(tokenizer_json, vocab_size, eos)


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when its parent dies (a killed tokenizer or gateway would
    otherwise leave its workers waiting on their queue forever)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # not glibc Linux: the pool's own shutdown is all there is
        return
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _compile(data: bytes) -> tuple[str, str | None] | None:
    """In a worker: None when the spec compiles, else (message, param)."""
    spec = msgspec.msgpack.decode(data, type=StructuredOutputsParams)
    try:
        if _compiler is not None:
            _compiler.check(spec)
        else:
            validate(spec)
    except InvalidRequestError as exc:
        return str(exc), exc.param
    except MemoryError:
        return f"structured_outputs.{spec.kind}: needs more memory than allowed to compile", None
    return None


# --- in the front door -------------------------------------------------------------------


class CompilePool:
    """Worker processes that compile specs: against a tokenizer (its `tokenizer.json` text:
    the same view the executor builds) or, without one, a tokenizer-free validation."""

    def __init__(
        self,
        limits: GrammarLimits,
        tokenizer_json: str | None = None,
        vocab_size: int = 0,
        eos_token_id: int = 0,
    ) -> None:
        self.limits = limits
        self._init_args = (limits.compile_memory, tokenizer_json, vocab_size, eos_token_id)
        self._pool: ProcessPoolExecutor | None = None
        self._compiled: OrderedDict[bytes, None] = OrderedDict()
        self.num_restarts = 0

    def check(self, spec: StructuredOutputsParams) -> None:
        """Blocking: raise InvalidRequestError if `spec` does not compile in time."""
        if self._known(spec):
            return
        for attempt in range(2):
            pool = self._current()
            future = pool.submit(_compile, msgspec.msgpack.encode(spec))
            try:
                return self._finish(spec, future.result(self.limits.compile_timeout))
            except FutureTimeout:
                raise self._failed(pool, spec, "took longer than allowed") from None
            except BrokenProcessPool:
                if attempt or pool is self._pool:
                    raise self._failed(pool, spec, "crashed the compiler") from None
                # another compile broke this pool: ours gets a second try on the new one

    async def check_async(self, spec: StructuredOutputsParams) -> None:
        """As `check`, awaited: the event loop runs on while a worker compiles."""
        if self._known(spec):
            return
        for attempt in range(2):
            pool = self._current()
            future = pool.submit(_compile, msgspec.msgpack.encode(spec))
            try:
                outcome = await asyncio.wait_for(
                    asyncio.wrap_future(future), self.limits.compile_timeout
                )
                return self._finish(spec, outcome)
            except TimeoutError:
                raise self._failed(pool, spec, "took longer than allowed") from None
            except BrokenProcessPool:
                if attempt or pool is self._pool:
                    raise self._failed(pool, spec, "crashed the compiler") from None

    def close(self) -> None:
        if self._pool is not None:
            _kill(self._pool)
            self._pool = None

    def _known(self, spec: StructuredOutputsParams) -> bool:
        key = spec_key(spec)
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return True
        return False

    def _finish(self, spec: StructuredOutputsParams, outcome) -> None:
        if outcome is not None:
            message, param = outcome
            raise InvalidRequestError(message, param=param or f"structured_outputs.{spec.kind}")
        self._compiled[spec_key(spec)] = None
        if len(self._compiled) > NUM_REMEMBERED:
            self._compiled.popitem(last=False)

    def _current(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=self.limits.compile_workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker,
                initargs=self._init_args,
            )
        return self._pool

    def _failed(
        self, pool: ProcessPoolExecutor, spec: StructuredOutputsParams, why: str
    ) -> InvalidRequestError:
        """Kill the pool (once, by whoever sees it fail first); the next call makes a new one."""
        if pool is self._pool:
            _kill(pool)
            self._pool = None
            self.num_restarts += 1
        log.warning("grammar compile failed", kind=spec.kind, why=why)
        param = f"structured_outputs.{spec.kind}"
        timeout = self.limits.compile_timeout
        message = (
            f"{param}: the grammar {why} (limits: {timeout:g} s, "
            f"{self.limits.compile_memory >> 20} MiB; --grammar-compile-timeout, "
            "--grammar-compile-memory)"
        )
        return InvalidRequestError(message, param=param)


def _kill(pool: ProcessPoolExecutor) -> None:
    """Stop a pool now, its workers killed mid-compile (shutdown alone waits for them)."""
    for process in list((pool._processes or {}).values()):  # no public way to kill them
        if process.is_alive():
            process.kill()
    pool.shutdown(wait=False, cancel_futures=True)
