"""Where kvpager keeps files between runs (converted models, NATS identities); no torch, so
client commands can ask cheaply."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$KVPAGER_CACHE_DIR`, else `$XDG_CACHE_HOME/kvpager`, else `~/.cache/kvpager`."""
    # TODO(config): environment variables are to be read in one module; move this there.
    if explicit := os.environ.get("KVPAGER_CACHE_DIR"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvpager"


def kv_disk_key_file() -> Path:
    """The disk tier's MAC key (engine/worker/disk/files.py), beside the NATS identities: the
    same for every instance of this cache dir, so instances sharing a folder read each other's
    files, and outside the folder, so write access to it is not enough to forge one."""
    return cache_dir() / "nats" / "kv-disk.key"
