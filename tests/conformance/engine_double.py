"""A test double of vLLM's GPU engine core, for running vLLM's own OpenAI server on a CPU.

It replaces only `EngineCoreClient.make_async_mp_client` (the seam between vLLM's frontend and its engine process):
everything from `AsyncLLM` up stays vLLM's own (argument parsing, the chat template, the input processor, the
detokenizer, the reasoning parsers, `OpenAIServingChat`, the FastAPI routes, admission control, Prometheus
metrics). The double admits requests into `max_num_seqs` running slots (the rest wait, and are reported as
waiting in the scheduler stats vLLM's `/metrics` shows), generates greedily from the tiny local target, and lets
vLLM's own `check_stop` decide every stop.

Where the reasoning markers fall is scripted, since a random tiny model never emits `</think>` by itself: the
structure follows the prompt (an open `<think>` at the prompt's end starts inside the reasoning; a closed one
starts in the answer; none: the model opens it), and a directive in the prompt text, `[[e3q key=value ...]]`,
changes it for a request:

    reason=N answer=N   tokens of reasoning / answer (default: what the simulator generates for the prompt)
    sample=1            sample the free text (seeded by the prompt) instead of greedy decoding
    close=N             how many `</think>` to emit (default 1; 0 = missing, 2 = twice)
    open=1              emit `<think>` first even where the prompt already opened it
    text=STRING         the answer's tokens are STRING's (URL-style %XX escapes allowed), instead of the model's
    cut=N               drop the last N tokens of the answer (e.g. cut an emoji's bytes in two)
    eos=0               never end the turn (the request runs into max_tokens or the context)
    end=TOKEN           end the turn with TOKEN instead of the eos (another stop token of the model's)
    think=1             a reasoning block even where the prompt closed it (thinking off)
    finish=abort|error  end with that finish reason after `at=K` tokens (default: half the generation)
    itl=S ttft=S        inter-token latency / time to first token of this request, seconds

Without a directive the double generates exactly what `eagle3q sim --target-model` generates for the same prompt
(greedy, the same lengths, the same suppressed tokens), so the simulator and vLLM's real frontend can be compared
response for response (tests/conformance/test_sim_agrees.py).

Environment: E3Q_DOUBLE_ITL_S (default 0.002), E3Q_DOUBLE_TTFT_S (0.01), E3Q_DOUBLE_MEAN_TOKENS (16: the
simulator's --mean-output-tokens).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import sys
import time
import urllib.parse
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM
from vllm.v1.core.sched.utils import check_stop
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.request import Request, RequestStatus

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from eagle3q.sim.textgen import output_lengths  # noqa: E402 - pure Python: the simulator's own lengths

log = logging.getLogger("engine_double")
DIRECTIVE = re.compile(r"\[\[e3q ([^\]]*)\]\]")


@dataclass
class Plan:
    tokens: list[int]  # the whole generation, before vLLM's stop checks cut it
    finish_at: int | None = None  # a scripted abort/error after this many tokens
    finish: FinishReason | None = None
    itl_s: float = 0.002
    ttft_s: float = 0.01


@dataclass
class Running:
    request: Request
    plan: Plan
    task: asyncio.Task | None = None


class EngineDouble:
    """Duck-types vLLM's AsyncMPClient for one in-process engine."""

    def __init__(self, vllm_config, executor_class=None, log_stats: bool = True, client_addresses=None,  # noqa: ANN001
                 client_count: int = 1, client_index: int = 0, renderer=None, **_: Any):  # noqa: ANN001
        self.vllm_config = vllm_config
        self.max_model_len = vllm_config.model_config.max_model_len
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        vllm_config.cache_config.num_gpu_blocks = 4096
        self.engine_ranks_managed = [0]
        self.resources = type("Resources", (), {"engine_dead": False})()
        path = vllm_config.model_config.model
        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        added = self.tok.get_added_tokens_decoder()
        self.special_ids = sorted(added)
        self.mean_tokens = int(os.environ.get("E3Q_DOUBLE_MEAN_TOKENS", "16"))
        self.id_of = {t.content: i for i, t in added.items()}
        self.open_id, self.close_id = self.id_of["<think>"], self.id_of["</think>"]
        self.itl_s = float(os.environ.get("E3Q_DOUBLE_ITL_S", "0.002"))
        self.ttft_s = float(os.environ.get("E3Q_DOUBLE_TTFT_S", "0.01"))
        self.outputs: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
        self.waiting: deque[Running] = deque()
        self.running: dict[str, Running] = {}
        self.all: dict[str, Running] = {}
        self.generated: dict[tuple, list[int]] = {}  # the tiny target's continuations, per prefix
        self.step = 0
        log.warning("engine double: %s, max_model_len %d, max_num_seqs %d", path, self.max_model_len,
                    self.max_num_seqs)

    # --- what AsyncLLM calls ---
    async def get_supported_tasks_async(self) -> tuple[str, ...]:
        return ("generate",)

    async def add_request_async(self, request) -> None:  # noqa: ANN001
        # The plan (the tiny target's forward passes) is made here, on the event loop: milliseconds for the tests'
        # short generations, and the order of requests stays the order they came in.
        req = Request.from_engine_core_request(request, None)
        run = Running(req, self._plan(req))
        self.all[req.request_id] = run
        self.waiting.append(run)
        self._schedule()

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            run = self.all.pop(rid, None)
            if run is None:
                continue
            if run in self.waiting:
                self.waiting.remove(run)
            if self.running.pop(rid, None) is not None and run.task is not None:
                run.task.cancel()
        self._schedule()

    async def get_output_async(self) -> EngineCoreOutputs:
        first = await self.outputs.get()
        batch = [first]
        while not self.outputs.empty():
            batch.append(self.outputs.get_nowait())
        self.step += 1
        stats = SchedulerStats(num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
                               step_counter=self.step)
        return EngineCoreOutputs(outputs=batch, scheduler_stats=stats, timestamp=time.monotonic())

    def shutdown(self, timeout: float | None = None) -> None:
        for run in list(self.running.values()):
            if run.task is not None:
                run.task.cancel()

    def dp_engines_running(self) -> bool:
        return bool(self.running or self.waiting)

    def get_kv_event_sources(self) -> list:
        return []

    def __getattr__(self, name: str):  # noqa: ANN204 - every other utility call (sleep, lora, profile...) is a no-op
        if name.endswith("_async") or name in ("get_status", "handle_fault"):
            async def noop(*args: Any, **kwargs: Any) -> Any:
                return False if name.startswith("is_") else None

            return noop
        raise AttributeError(name)

    # --- scheduling and generation ---
    def _schedule(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            run = self.waiting.popleft()
            run.request.status = RequestStatus.RUNNING
            self.running[run.request.request_id] = run
            run.task = asyncio.get_running_loop().create_task(self._generate(run))

    async def _generate(self, run: Running) -> None:
        req, plan = run.request, run.plan
        rid = req.request_id
        try:
            await asyncio.sleep(plan.ttft_s)
            for i, tid in enumerate(self._tokens(req, plan)):
                if plan.finish is not None and i == plan.finish_at:
                    req.status = RequestStatus.FINISHED_ABORTED if plan.finish == FinishReason.ABORT \
                        else RequestStatus.FINISHED_ERROR
                    self._emit(EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason=plan.finish))
                    return
                req.append_output_token_ids(tid)
                if check_stop(req, self.max_model_len):  # vLLM's own stop decision
                    self._emit(EngineCoreOutput(request_id=rid, new_token_ids=[tid],
                                                finish_reason=req.get_finished_reason(),
                                                stop_reason=req.stop_reason))
                    return
                self._emit(EngineCoreOutput(request_id=rid, new_token_ids=[tid]))
                await asyncio.sleep(plan.itl_s)
        finally:
            self.running.pop(rid, None)
            self.all.pop(rid, None)
            self._schedule()

    def _tokens(self, req: Request, plan: Plan):  # noqa: ANN202 - an endless iterator of token ids
        yield from plan.tokens
        while True:  # the plan ran out without a stop (eos=0, a long max_tokens): keep generating from the model,
            # on the last 64 tokens (a full forward a token over a 1k context took ~25 s, near the tests' timeout)
            yield self._next_free_token(list(req.all_token_ids)[-64:])

    def _emit(self, out: EngineCoreOutput) -> None:
        self.outputs.put_nowait(out)

    def _plan(self, req: Request) -> Plan:
        prompt = list(req.prompt_token_ids or [])
        text = self.tok.decode(prompt, skip_special_tokens=False)
        found = DIRECTIVE.findall(text)
        d = dict(kv.split("=", 1) for kv in found[-1].split() if "=" in kv) if found else {}
        n_reason, n_answer = output_lengths(text, self.mean_tokens)
        n_reason, n_answer = int(d.get("reason", n_reason)), int(d.get("answer", n_answer))
        eos_id = req.sampling_params.eos_token_id
        eos = eos_id if d.get("eos", "1") != "0" else None
        if "end" in d:
            eos = self.id_of[urllib.parse.unquote(d["end"])]
        # The simulator's greedy decoding never emits the markers, the end of turn or id 0; sampling avoids them all.
        suppress = self.special_ids if d.get("sample") == "1" else sorted(
            {self.open_id, self.close_id, 0} | ({eos_id} if eos_id is not None else set()))
        sample = d.get("sample") == "1"

        # Where the stream starts: inside the reasoning when the prompt's last marker is an open <think>, in the
        # answer when it is a </think> (thinking off), and the model opens <think> itself when there is none.
        last = next((t for t in reversed(prompt[-4:]) if t in (self.open_id, self.close_id)), None)
        tokens: list[int] = []
        think = d.get("think") == "1"  # a reasoning block even where the prompt closed it (thinking off)
        if last != self.close_id or think:
            if last is None or d.get("open") == "1" or (think and last == self.close_id):
                tokens.append(self.open_id)
            tokens += self._free(prompt + tokens, n_reason, suppress, sample)
            tokens += [self.close_id] * int(d.get("close", 1))
        if "text" in d:
            answer = self.tok.encode(urllib.parse.unquote(d["text"]), add_special_tokens=False).ids
        else:
            answer = self._free(prompt + tokens, n_answer, suppress, sample)
        cut = int(d.get("cut", 0))
        tokens += answer[: len(answer) - cut] if cut else answer
        if eos is not None:
            tokens.append(eos)
        plan = Plan(tokens, itl_s=float(d.get("itl", self.itl_s)), ttft_s=float(d.get("ttft", self.ttft_s)))
        if d.get("finish") in ("abort", "error"):
            plan.finish = FinishReason.ABORT if d["finish"] == "abort" else FinishReason.ERROR
            plan.finish_at = int(d.get("at", len(tokens) // 2))
        return plan

    def _free(self, prefix: list[int], n: int, suppress: list[int], sample: bool) -> list[int]:
        """n tokens from the tiny target, greedy or sampled (seeded by the prefix), never a suppressed one; the same
        prompt gives the same generation (cached)."""
        key = (tuple(prefix), n, tuple(suppress), sample)
        if key not in self.generated:
            seed = int(hashlib.sha256(str(key[:2]).encode()).hexdigest()[:8], 16)
            gen = torch.Generator().manual_seed(seed) if sample else None
            out: list[int] = []
            for _ in range(n):
                out.append(self._next_free_token(prefix + out, suppress, gen))
            self.generated[key] = out
        return self.generated[key]

    @torch.inference_mode()
    def _next_free_token(self, ids: list[int], suppress: list[int] | None = None,
                         gen: torch.Generator | None = None) -> int:
        logits = self.model(torch.tensor([ids])).logits[0, -1]
        logits[suppress if suppress is not None else self.special_ids] = float("-inf")
        if gen is None:
            return int(logits.argmax())
        return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))


def install() -> None:
    """Swap the engine core: the one seam this double replaces."""
    from vllm.v1.engine import core_client

    core_client.EngineCoreClient.make_async_mp_client = staticmethod(
        lambda *args, **kwargs: EngineDouble(*args, **kwargs))
