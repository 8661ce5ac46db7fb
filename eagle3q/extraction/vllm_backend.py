"""Hidden states from the serving engine: a vLLM started with `extract_hidden_states` and the
`ExampleHiddenStatesConnector` (docs/deployment.md, "The GPU hand-off"), the path that scales to Kimi-K2.5.

Per sample: POST `/v1/completions` with the sample's token ids as the prompt, `max_tokens=1`,
`return_token_ids=true` (speculators' `generate_hidden_states` sends the same); the reply's
`choices[0].prompt_token_ids` must equal the sample's ids; the connector's file (`kv_transfer_params.
hidden_states_path`) is complete once its `.lock` can be taken; it holds `token_ids` [T] and `hidden_states`
[T, n_aux + 1, H], the aux layers in the server's configured order and last the final state before the norm. The
file is read, checked and removed; the stage writes our own file from it.

The connector's directory and our store must be on the same machine or a shared filesystem (the server writes,
the worker reads). Samples of a batch are sent concurrently (`EAGLE3Q_HS_VLLM_CONCURRENCY`).
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from eagle3q.extraction.transformers_backend import Extracted, check_aux_ids, default_aux_ids
from eagle3q.generate.endpoints import ServerTooOld, parse_version
from eagle3q.target import resolve_model_dir, target_config

# vLLM's `deepseek_v2` backbone (DeepSeek-V3, Kimi-K2.x) captured aux states only at decoder-layer inputs, so the
# final layer's output (id = num_hidden_layers) was dropped and the server returned one state fewer than configured
# (vLLM PR #46973, issue #48124). Read from the wheels: `vllm/model_executor/models/deepseek_v2.py` of 0.24.0 has no
# `if self.end_layer in self.aux_hidden_state_layers: aux_hidden_states.append(hidden_states + residual)`, 0.25.0 is
# the first release that has it (0.17.0 ... 0.24.0 all lack it).
DEEPSEEK_FINAL_LAYER_VLLM = (0, 25, 0)
_DEEPSEEK_FAMILY = ("deepseek_v2", "deepseek_v3", "deepseekv2", "deepseekv3", "kimi")


def final_layer_floor(model_dir: str) -> tuple[int, int, int] | None:
    """The oldest vLLM whose extraction returns this target's final layer, where that is not every release: the
    DeepSeek-V2/V3 backbone (DeepSeek-V3, Kimi-K2, Kimi-K2.5 and its multimodal wrapper)."""
    import json

    raw = json.loads((resolve_model_dir(model_dir) / "config.json").read_text())
    names = []
    for cfg in (raw, raw.get("text_config") or {}):
        names += [str(cfg.get("model_type", "")), *map(str, cfg.get("architectures") or [])]
    lowered = " ".join(names).lower()
    return DEEPSEEK_FINAL_LAYER_VLLM if any(f in lowered for f in _DEEPSEEK_FAMILY) else None


class ServerError(Exception):
    """The extraction server failed or is unreachable: infrastructure, retried by the task."""


def wait_for_lock(lock_path: str, timeout_s: float, poll_s: float = 0.02) -> None:
    """The connector holds an exclusive flock on `<file>.lock` while it writes; taking it means the file is whole.
    The lock file is removed after (as speculators' reader does)."""
    if not os.path.exists(lock_path):
        return
    fd = os.open(lock_path, os.O_RDWR)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ServerError(f"the connector still holds {lock_path} after {timeout_s:.0f}s") from None
                time.sleep(poll_s)
    finally:
        os.close(fd)
    Path(lock_path).unlink(missing_ok=True)


class Breaker:
    """After `threshold` server failures in a row, fail fast for `cooldown_s` (the task retries with backoff)
    instead of sending every sample of every batch to a server that is down."""

    def __init__(self, threshold: int = 3, cooldown_s: float = 10.0, clock=time.monotonic):  # noqa: ANN001
        self.threshold, self.cooldown_s, self.clock = threshold, cooldown_s, clock
        self.failures, self.opened_at = 0, None

    def check(self) -> None:
        if self.opened_at is not None and self.clock() - self.opened_at < self.cooldown_s:
            raise ServerError(f"extraction server failed {self.failures} times in a row: not calling it for "
                              f"{self.cooldown_s:.0f}s")

    def record(self, ok: bool) -> None:
        if ok:
            self.failures, self.opened_at = 0, None
            return
        self.failures += 1
        if self.failures >= self.threshold:
            self.opened_at = self.clock()


class VllmExtractor:
    """The hidden-state stage's backend for `EAGLE3Q_HS_BACKEND=vllm` (same interface as TransformersExtractor)."""

    backend = "vllm"
    final_state = "pre_norm"  # vLLM captures the last layer's output before the final norm

    def __init__(self, base_url: str, model: str, target_dir: str, aux_ids: Sequence[int] | None,
                 concurrency: int = 8, timeout_s: float = 600.0, api_key: str | None = None):
        cfg = target_config(target_dir)
        self.num_layers = int(cfg["num_hidden_layers"])
        self.hidden_size = int(cfg["hidden_size"])
        self.max_positions = int(cfg.get("max_position_embeddings", 1 << 30))
        self.aux_ids = check_aux_ids(aux_ids or default_aux_ids(self.num_layers), self.num_layers)
        self.model, self.timeout_s = model, timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s, headers=headers)
        self.pool = ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="eagle3q-hs-vllm")
        self.breaker = Breaker()
        self.floor = final_layer_floor(target_dir)
        self.server_version: str | None = None  # checked once the server answers /version

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.client.close()

    def extract(self, batch: Sequence[Sequence[int]]) -> list[Extracted]:
        self.check_server()
        return list(self.pool.map(self._one, [list(ids) for ids in batch]))

    def check_server(self) -> None:
        """Refuse (ServerTooOld, before any sample is sent) a vLLM that drops this target's final layer. Unreachable
        or without a version: no verdict yet (the requests say what is wrong), asked again with the next batch."""
        if self.floor is None or self.server_version is not None:
            return
        root = str(self.client.base_url).rstrip("/").removesuffix("/v1")
        try:
            r = self.client.get(f"{root}/version", timeout=10)
            version = str(r.json().get("version", "")) if r.status_code == 200 else ""
        except (httpx.HTTPError, ValueError, AttributeError):
            return
        parsed = parse_version(version)
        if parsed is not None and parsed < self.floor:
            need = ".".join(map(str, self.floor))
            raise ServerTooOld(f"vLLM {version} at {root} drops this target's final layer from extract_hidden_states "
                               f"(the deepseek_v2 backbone of DeepSeek-V3 / Kimi-K2.x before vLLM {need}): every "
                               f"sample would end hs_length_mismatch; run the extraction server on vLLM >= {need}")
        self.server_version = version

    def _one(self, ids: list[int]) -> Extracted:
        self.breaker.check()
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "return_token_ids": True}
        try:
            r = self.client.post("/completions", json=body)
        except httpx.HTTPError as e:
            self.breaker.record(False)
            raise ServerError(f"extraction server unreachable: {type(e).__name__}: {e}") from e
        if r.status_code >= 500 or r.status_code == 429:
            self.breaker.record(False)
            raise ServerError(f"extraction server answered {r.status_code}: {r.text[:200]}")
        self.breaker.record(True)
        if r.status_code >= 400:
            return _rejected("hs_request_refused", f"{r.status_code}: {r.text[:200]}")
        reply = r.json()
        choice = (reply.get("choices") or [{}])[0]
        if choice.get("prompt_token_ids") != ids:
            return _rejected("hs_prompt_mismatch", "the server tokenized the prompt differently")
        path = (reply.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise ServerError("no kv_transfer_params.hidden_states_path: is the server started with the "
                              "ExampleHiddenStatesConnector?")
        wait_for_lock(f"{path}.lock", self.timeout_s)
        if not os.path.exists(path):
            # The server answered, then wrote nothing: it died before its writer ran (the lock is free once its
            # process is gone), or its connector directory is not the one we read.
            self.breaker.record(False)
            raise ServerError(f"the server answered but {path} was never written ({self._health()})")
        from safetensors.torch import load_file

        try:
            data = load_file(path)
        finally:
            Path(path).unlink(missing_ok=True)
        return self._check(ids, data)

    def _health(self) -> str:
        root = str(self.client.base_url).rstrip("/").removesuffix("/v1")
        try:
            ok = self.client.get(f"{root}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return "the server is unreachable now: it died after answering"
        return ("the server is up: is EAGLE3Q_HS_CONNECTOR_DIR its shared_storage_path?" if ok
                else "its /health fails now: the engine died after answering")

    def _check(self, ids: list[int], data: dict[str, torch.Tensor]) -> Extracted:
        return connector_states(data, ids, self.aux_ids, self.num_layers, self.hidden_size)


def connector_states(data: dict[str, torch.Tensor], ids: list[int], aux_ids: list[int], num_layers: int,
                     hidden_size: int) -> Extracted:
    """A connector file's tensors as (aux [T, 3H], final [T, H]) float32, or a named rejection. Reads vLLM's
    ExampleHiddenStatesConnector (bf16 `hidden_states` [T, 4, H]) and hs_connectors' FP8HiddenStatesConnector
    (e4m3 with `hidden_states_scales` [T, 1, 1]: half the bytes through the shared directory)."""
    if data.get("token_ids") is None or data["token_ids"].tolist() != ids:
        return _rejected("hs_prompt_mismatch", "the connector's token_ids are not the sample's")
    hs = data.get("hidden_states")
    want = (len(ids), len(aux_ids) + 1, hidden_size)
    if hs is None or tuple(hs.shape) != want:
        return _rejected("hs_length_mismatch", f"hidden_states {None if hs is None else tuple(hs.shape)}, "
                         f"expected {want} (the server's layer ids must be {[*aux_ids, num_layers]})")
    t = len(ids)
    scales = data.get("hidden_states_scales")
    hs = hs.float() * scales.float() if scales is not None else hs.float()
    return Extracted(hs[:, :-1].reshape(t, -1), hs[:, -1])


def _rejected(reason: str, detail: str) -> Extracted:
    return Extracted(torch.empty(0), torch.empty(0), reason=reason, detail=detail)
