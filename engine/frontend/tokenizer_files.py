"""The tokenizer of a model folder, or of a folder of its own, with an optional chat template.

Every door loads it here (the offline LLM, the tokenizer service, `kvpager serve`'s checks), so a
folder without tokenizer files is one clear ConfigError, not transformers' traceback (which
suggests installing sentencepiece for a file that is simply missing).
"""

from pathlib import Path
from typing import Any

from kvpager.schemas.errors import ConfigError

# What transformers builds a tokenizer from: a fast tokenizer, a SentencePiece model, a BPE
# vocabulary (with merges.txt), a WordPiece vocabulary, or a tiktoken file
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")


def tokenizer_folder(model_path: Path, tokenizer: str | None = None) -> Path:
    """The folder to load the tokenizer from; ConfigError when it holds no tokenizer files."""
    folder = Path(tokenizer).expanduser() if tokenizer is not None else Path(model_path)
    if not folder.is_dir():
        raise ConfigError(f"tokenizer: {folder} is not a folder")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        hint = "" if tokenizer is not None else ", or give --tokenizer FOLDER"
        raise ConfigError(
            f"{folder} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}): copy them "
            f"from the model's repository{hint}"
        )
    return folder


def chat_template_text(chat_template: str) -> str:
    """`--chat-template`: a file's contents, or the Jinja template given inline."""
    path = Path(chat_template).expanduser()
    if "{" not in chat_template and path.is_file():
        return path.read_text()
    if "{{" in chat_template or "{%" in chat_template:
        return chat_template
    raise ConfigError(f"chat_template: {chat_template!r} is neither a file nor a Jinja template")


def load_tokenizer(
    model_path: Path, tokenizer: str | None = None, chat_template: str | None = None
) -> Any:
    """transformers' tokenizer of the model (or of `tokenizer`), with `chat_template` if given."""
    from transformers import AutoTokenizer  # slow to import

    folder = tokenizer_folder(model_path, tokenizer)
    template = None if chat_template is None else chat_template_text(chat_template)
    try:
        loaded = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:  # present but unreadable files
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        raise ConfigError(f"{folder}: its tokenizer does not load: {first}") from exc
    if template is not None:
        loaded.chat_template = template
    return loaded
