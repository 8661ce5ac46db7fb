"""The simulator's HTTP server: vLLM's OpenAI-compatible wire format, field for field.

Latency model after llm-d-inference-sim: a request holds one of `max_num_seqs` slots for TTFT + (n-1)·ITL; requests
beyond the limit wait (and show in `vllm:num_requests_waiting`). Faults are injected by rate: transient ones
(5xx, 429, timeouts, dropped connections) drawn per attempt, so a retry can succeed; output faults (truncation,
missing `</think>`, reasoning leaked into content, null token ids) drawn per prompt, so they are as deterministic as a
greedy model and a retry gives the same answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from eagle3q.profiles import ResolvedProfile, get_profile, resolve
from eagle3q.sim.templates import render_prompt
from eagle3q.sim.textgen import output_lengths, words_for
from eagle3q.tokenizer import load_tokenizer

TRANSIENT_FAULTS = ("5xx", "429", "timeout", "drop")
OUTPUT_FAULTS = ("truncate", "missing_close", "leak", "null_ids")
FAULTS = TRANSIENT_FAULTS + OUTPUT_FAULTS


def parse_faults(spec: str) -> dict[str, float]:
    """`"5xx=0.1,missing_close=0.05"` -> {"5xx": 0.1, "missing_close": 0.05}."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, rate = part.partition("=")
        if name not in FAULTS:
            raise ValueError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
        value = float(rate)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"fault rate for {name} must be within [0, 1], got {value}")
        out[name] = value
    return out


@dataclass
class SimConfig:
    tokenizer: str
    profile: str = "kimi_k2"
    model: str = "moonshotai/Kimi-K2.5"
    ttft_s: float = 0.05
    itl_s: float = 0.002
    max_num_seqs: int = 256
    mean_output_tokens: int = 200
    max_model_len: int = 32768
    faults: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    expose_reasoning_content: bool = False
    hang_s: float = 3600.0  # how long a "timeout" fault holds the request open
    # A local transformers model to generate with (greedy), instead of text from the word bank: the samples are then
    # the target's own generations, as when vLLM serves the target (the demo trains a draft on them).
    target_model: str = ""


@dataclass
class Generation:
    prompt_ids: list[int]
    gen_ids: list[int] | None
    reasoning: str | None
    content: str | None
    finish_reason: str
    n_tokens: int


class Simulator:
    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.tok = load_tokenizer(cfg.tokenizer)
        self.profile = get_profile(cfg.profile)
        self.ids = resolve(self.profile, self.tok.token_to_id, self.tok.vocab_size)
        self.rng = random.Random(cfg.seed)
        self.slots = asyncio.Semaphore(cfg.max_num_seqs)
        self.running = 0
        self.peak_running = 0
        self.waiting = 0
        self.counters = {"requests": 0, "success": 0, "prompt_tokens": 0, "generation_tokens": 0}
        self.counters.update({f"fault_{f}": 0 for f in FAULTS})
        self.lm = _GreedyLM(cfg.target_model, self.ids) if cfg.target_model else None
        self._gen_cache: dict[tuple, Generation] = {}
        self._executor = None

    # --- deterministic generation -------------------------------------------------------------------------------
    def _prompt_fault(self, prompt: str, name: str) -> bool:
        rate = self.cfg.faults.get(name, 0.0)
        if rate <= 0:
            return False
        h = int.from_bytes(hashlib.sha256(f"{name}|{self.cfg.seed}|{prompt}".encode()).digest()[:8], "big")
        return h / 2**64 < rate

    def _text_tokens(self, prompt: str, n_tokens: int, salt: str) -> list[int]:
        ids: list[int] = []
        words = n_tokens
        while len(ids) < n_tokens:  # words are >= 1 token each; grow until long enough, then cut at tokens
            ids = self.tok.encode(" " + words_for(prompt, words, salt))
            words *= 2
        return ids[:n_tokens]

    def generate(self, messages: list[dict[str, str]], thinking: bool, max_tokens: int) -> Generation:
        p, ids = self.profile, self.ids
        prompt_text = render_prompt(p, messages, thinking)
        prompt_ids = self.tok.encode(prompt_text)
        n_reason, n_answer = output_lengths(prompt_text, self.cfg.mean_output_tokens)
        if self.lm is not None:
            lead = prompt_ids + ([] if p.prompt_opens_think or not thinking else [ids.open_id])
            reason_ids = self.lm.continue_(lead, n_reason) if thinking else []
            answer_ids = self.lm.continue_(lead + reason_ids + ([ids.close_id] if thinking else []), n_answer)
        else:
            reason_ids = self._text_tokens(prompt_text, n_reason, "reasoning") if thinking else []
            answer_ids = self._text_tokens(prompt_text, n_answer, "answer")
        faults = {f for f in OUTPUT_FAULTS if self._prompt_fault(prompt_text, f)}
        for f in faults:
            self.counters[f"fault_{f}"] += 1

        gen: list[int] = []
        if thinking:
            if not p.prompt_opens_think:
                gen.append(ids.open_id)
            gen += reason_ids
            if "missing_close" not in faults:
                gen.append(ids.close_id)
        gen += answer_ids + [ids.end_id]

        finish = "stop"
        limit = max_tokens
        if "truncate" in faults:
            limit = min(limit, max(1, len(gen) // 2))
        if len(gen) > limit:
            gen, finish = gen[:limit], "length"

        reasoning, content = self._parse(gen, thinking)
        if "leak" in faults and reasoning is not None:
            # A broken reasoning parser: everything lands in content, markers included.
            content = self.tok.decode([t for t in gen if t != ids.end_id])
            reasoning = None
        n = len(gen)
        return Generation(prompt_ids, None if "null_ids" in faults else gen, reasoning, content, finish, n)

    async def _generate(self, messages: list[dict[str, str]], thinking: bool, max_tokens: int) -> Generation:
        if self.lm is None:
            return self.generate(messages, thinking, max_tokens)
        # Model-backed generation is slow and blocking: off the event loop, one at a time, cached per prompt.
        key = (json.dumps(messages), thinking, max_tokens)
        if key not in self._gen_cache:
            if self._executor is None:
                from concurrent.futures import ThreadPoolExecutor

                self._executor = ThreadPoolExecutor(max_workers=1)
            loop = asyncio.get_running_loop()
            self._gen_cache[key] = await loop.run_in_executor(
                self._executor, self.generate, messages, thinking, max_tokens
            )
        return self._gen_cache[key]

    def _parse(self, gen: list[int], thinking: bool) -> tuple[str | None, str | None]:
        """What vLLM's reasoning parser returns: text before `</think>` is reasoning; no close marker means the
        whole output is reasoning. Special tokens are skipped in text, as with skip_special_tokens=True."""
        ids = self.ids
        specials = {ids.open_id, ids.close_id, ids.end_id}

        def text(part: list[int]) -> str:
            return self.tok.decode([t for t in part if t not in specials])

        if not thinking:
            return None, text(gen)
        if ids.close_id in gen:
            cut = gen.index(ids.close_id)
            return text(gen[:cut]), text(gen[cut + 1 :])
        return text(gen), None

    # --- HTTP ---------------------------------------------------------------------------------------------------
    def _error(self, status: int, message: str, kind: str) -> web.Response:
        body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
        return web.json_response(body, status=status)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.counters["requests"] += 1
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self._error(400, "request body is not valid JSON", "BadRequestError")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            return self._error(400, "'messages' must be a non-empty list", "BadRequestError")
        if body.get("model") != self.cfg.model:
            return self._error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")

        for name in TRANSIENT_FAULTS:
            rate = self.cfg.faults.get(name, 0.0)
            if rate and self.rng.random() < rate:
                self.counters[f"fault_{name}"] += 1
                return await self._transient(name, request)

        try:
            messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in body["messages"]]
        except (KeyError, TypeError):
            return self._error(400, "each message needs 'role' and 'content'", "BadRequestError")
        kwargs = body.get("chat_template_kwargs") or {}
        kw = self.profile.thinking_kwarg
        thinking = bool(kwargs.get(kw, True)) if kw else True
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)

        gen = await self._generate(messages, thinking, max_tokens)
        n_prompt = len(gen.prompt_ids)
        if n_prompt >= self.cfg.max_model_len:
            return self._error(
                400,
                f"This model's maximum context length is {self.cfg.max_model_len} tokens. However, your request has "
                f"{n_prompt} input tokens. Please reduce the length of the input messages.",
                "BadRequestError",
            )
        if n_prompt + gen.n_tokens > self.cfg.max_model_len:  # vLLM caps the output at the context length
            gen = await self._generate(messages, thinking, self.cfg.max_model_len - n_prompt)

        self.waiting += 1
        async with self.slots:
            self.waiting -= 1
            self.running += 1
            self.peak_running = max(self.peak_running, self.running)
            try:
                if body.get("stream"):
                    return await self._stream(request, body, gen)
                await asyncio.sleep(self.cfg.ttft_s + max(gen.n_tokens - 1, 0) * self.cfg.itl_s)
            finally:
                self.running -= 1
        self._count(gen)
        return web.json_response(self._response(body, gen))

    def _count(self, gen: Generation) -> None:
        self.counters["success"] += 1
        self.counters["prompt_tokens"] += len(gen.prompt_ids)
        self.counters["generation_tokens"] += gen.n_tokens

    def _message(self, reasoning: str | None, content: str | None) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None, "annotations": None,
                               "audio": None, "function_call": None, "tool_calls": [], "reasoning": reasoning}
        if self.cfg.expose_reasoning_content:
            msg["reasoning_content"] = reasoning
        return msg

    def _response(self, body: dict[str, Any], gen: Generation) -> dict[str, Any]:
        want_ids = bool(body.get("return_token_ids"))
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.cfg.model,
            "choices": [
                {
                    "index": 0,
                    "message": self._message(gen.reasoning, gen.content),
                    "logprobs": None,
                    "finish_reason": gen.finish_reason,
                    "stop_reason": None,
                    "token_ids": gen.gen_ids if want_ids else None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {
                "prompt_tokens": len(gen.prompt_ids),
                "total_tokens": len(gen.prompt_ids) + gen.n_tokens,
                "completion_tokens": gen.n_tokens,
                "prompt_tokens_details": None,
            },
            "prompt_logprobs": None,
            "prompt_token_ids": gen.prompt_ids if want_ids else None,
            "kv_transfer_params": None,
        }

    async def _stream(self, request: web.Request, body: dict[str, Any], gen: Generation) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        want_ids = bool(body.get("return_token_ids"))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        async def send(choice: dict[str, Any], **top: Any) -> None:
            chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.cfg.model,
                     "choices": [choice] if choice else [], **top}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())

        first_top = {"prompt_token_ids": gen.prompt_ids} if want_ids else {}
        await send({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}, **first_top)
        await asyncio.sleep(self.cfg.ttft_s)
        ids = gen.gen_ids or []
        in_reasoning = bool(gen.reasoning is not None) and self.profile.prompt_opens_think
        specials = {self.ids.open_id, self.ids.close_id, self.ids.end_id}
        for i, tid in enumerate(ids):
            if tid == self.ids.open_id:
                in_reasoning = True
            text = "" if tid in specials else self.tok.decode([tid])
            delta = {"reasoning": text} if in_reasoning else {"content": text}
            if tid == self.ids.close_id:
                in_reasoning = False
            last = i == len(ids) - 1
            finish = gen.finish_reason if last else None
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            if want_ids:
                choice["token_ids"] = [tid]
            await send(choice)
            if not last:
                await asyncio.sleep(self.cfg.itl_s)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(gen.prompt_ids), "completion_tokens": gen.n_tokens,
                     "total_tokens": len(gen.prompt_ids) + gen.n_tokens}
            await send({}, usage=usage)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        self._count(gen)
        return resp

    async def _transient(self, name: str, request: web.Request) -> web.StreamResponse:
        if name == "5xx":
            return self._error(503, "Service temporarily unavailable (simulated)", "ServiceUnavailableError")
        if name == "429":
            return self._error(429, "Too many requests (simulated)", "RateLimitError")
        if name == "drop":
            if request.transport is not None:
                request.transport.abort()  # the client sees the connection closed without a response
            raise asyncio.CancelledError
        await asyncio.sleep(self.cfg.hang_s)  # "timeout": hold the request until the client gives up
        return self._error(504, "gateway timeout (simulated)", "TimeoutError")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.cfg.model, "object": "model", "created": 0, "owned_by": "vllm",
                                         "root": self.cfg.model, "parent": None,
                                         "max_model_len": self.cfg.max_model_len}]}
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        name = self.cfg.model
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f'vllm:num_requests_running{{model_name="{name}"}} {self.running}',
            "# TYPE vllm:num_requests_waiting gauge",
            f'vllm:num_requests_waiting{{model_name="{name}"}} {self.waiting}',
            "# TYPE vllm:prompt_tokens_total counter",
            f'vllm:prompt_tokens_total{{model_name="{name}"}} {self.counters["prompt_tokens"]}',
            "# TYPE vllm:generation_tokens_total counter",
            f'vllm:generation_tokens_total{{model_name="{name}"}} {self.counters["generation_tokens"]}',
            "# TYPE vllm:request_success_total counter",
            f'vllm:request_success_total{{model_name="{name}",finished_reason="stop"}} {self.counters["success"]}',
        ]
        lines.append(f"eagle3q_sim_peak_running {self.peak_running}")
        for f in FAULTS:
            lines.append(f'eagle3q_sim_faults_total{{fault="{f}"}} {self.counters[f"fault_{f}"]}')
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app


class _GreedyLM:
    """Greedy continuation with a local transformers model, never emitting the template's special tokens."""

    def __init__(self, path: str, ids: ResolvedProfile):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        torch.set_num_threads(1)  # the simulator shares the machine with the workers it serves
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.suppress = sorted({ids.open_id, ids.close_id, ids.end_id, 0})

    def continue_(self, prefix: list[int], n: int) -> list[int]:
        torch = self.torch
        out: list[int] = []
        with torch.inference_mode():
            res = self.model(torch.tensor([prefix]), use_cache=True)
            for _ in range(n):
                logits = res.logits[0, -1]
                logits[self.suppress] = float("-inf")
                nxt = int(logits.argmax())
                out.append(nxt)
                res = self.model(torch.tensor([[nxt]]), cache=res.past_key_values, use_cache=True)
        return out


def serve(cfg: SimConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    async def make() -> web.Application:
        return Simulator(cfg).app()

    web.run_app(make(), host=host, port=port, access_log=None, print=None)
