"""`vllm serve` with the engine core swapped for the test double (tests/conformance/engine_double.py).

Run with the conformance venv's python: `.venv-vllm/bin/python tests/conformance/serve.py MODEL_DIR [vllm serve
flags]`. Everything but the engine core is vLLM's own, argument parsing included.
"""

import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import engine_double  # noqa: E402

engine_double.install()

from vllm.entrypoints.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    main()
