"""vLLM's own ExampleHiddenStatesConnector file code, run with the conformance venv's python.

    connector_files.py write PATH T N H DELAY_S   write a file the way the connector's writer thread does: the
                                                  `.lock` created and held (LOCK_EX) first, as `wait_for_save` does
                                                  before the response leaves; then `_write_tensors` (the DtoH copy's
                                                  event, here DELAY_S of sleep, then `save_file`, then the lock
                                                  released). Prints "locked" once the lock is held.
    connector_files.py read PATH                  vLLM's `load_hidden_states` and `cleanup_hidden_states` on a file
                                                  (the simulator's): prints the tensors' names, shapes and dtypes.

The tensors written are deterministic (`expected(T, N, H)`), so the reader on the other side can check every value.
"""

import fcntl
import json
import os
import sys
import threading
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (  # noqa: E402
    ExampleHiddenStatesConnector,
    cleanup_hidden_states,
    load_hidden_states,
)


def expected(t: int, n: int, h: int) -> dict[str, torch.Tensor]:
    hs = (torch.arange(t * n * h, dtype=torch.float32).reshape(t, n, h) / 97.0).to(torch.bfloat16)
    return {"hidden_states": hs, "token_ids": torch.arange(3, 3 + t, dtype=torch.long)}


class _CopyDone:
    """Stands for the CUDA event of the device-to-host copy the writer waits on."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    def synchronize(self) -> None:
        time.sleep(self.delay_s)


def write(path: str, t: int, n: int, h: int, delay_s: float) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lock_fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    print("locked", flush=True)
    writer = threading.Thread(target=ExampleHiddenStatesConnector._write_tensors,
                              args=(expected(t, n, h), _CopyDone(delay_s), path, lock_fd))
    writer.start()
    writer.join()


def read(path: str) -> None:
    data = load_hidden_states(path)
    print(json.dumps({k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in data.items()}))
    cleanup_hidden_states(path)


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]))
    else:
        read(sys.argv[2])
