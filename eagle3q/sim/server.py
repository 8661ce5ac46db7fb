"""The simulator's HTTP server: vLLM's OpenAI-compatible wire format, field for field (`/v1/chat/completions`
streaming and not, `/v1/models`, `/health`, `/metrics`). Generation and latency are the engine's
(`eagle3q.sim.engine`), fault draws `eagle3q.sim.faults`."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from aiohttp import web

from eagle3q.generate.templates import render_prompt
from eagle3q.sim.engine import Engine, Generation, SimConfig
from eagle3q.sim.faults import FAULTS, draw_transient, parse_faults

__all__ = ["SimConfig", "Simulator", "parse_faults", "serve"]


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)  # vLLM's compact JSON


class Simulator:
    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.engine = Engine(cfg)
        # What the wire needs of the engine (and what tests reach for): tokenizer, profile and its ids, counters.
        self.tok, self.profile, self.ids = self.engine.tok, self.engine.profile, self.engine.ids
        self.counters = self.engine.counters
        self.generate = self.engine.generate
        self._prompt_fault = self.engine._prompt_fault
        self._fingerprint = uuid.uuid4().hex[:8]
        self.connector = None
        if cfg.hs_dir:
            from eagle3q.sim.hidden_states import ConnectorWriter

            self.connector = ConnectorWriter(cfg.target_model or cfg.tokenizer, cfg.hs_dir, cfg.hs_layer_ids or None,
                                             cfg.hs_shift)

    def _error(self, status: int, message: str, kind: str, param: str | None = None) -> web.Response:
        body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
        return web.json_response(body, status=status, dumps=_dumps)

    @property
    def fingerprint(self) -> str:
        return f"vllm-{self.cfg.vllm_version}-{self._fingerprint}"

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.counters["requests"] += 1
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self._error(400, "request body is not valid JSON", "BadRequestError")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            return self._error(400, "'messages' must be a non-empty list", "BadRequestError")
        if body.get("model") != self.cfg.model:
            return self._error(404, f"The model `{body.get('model')}` does not exist. Valid aliases: "
                                    f"{self.cfg.model}.", "NotFoundError", "model")

        fault = draw_transient(self.cfg.faults, self.engine.rng)
        if fault is not None:
            self.counters[f"fault_{fault}"] += 1
            return await self._transient(fault, request)

        try:
            messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in body["messages"]]
        except (KeyError, TypeError):
            return self._error(400, "each message needs 'role' and 'content'", "BadRequestError")
        kwargs = body.get("chat_template_kwargs") or {}
        kw = self.profile.thinking_kwarg
        thinking = bool(kwargs.get(kw, True)) if kw else True
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        if max_tokens > self.cfg.max_model_len:  # vLLM refuses it outright, whatever the prompt
            return self._error(400, f"max_tokens={max_tokens} cannot be greater than max_model_len="
                                    f"{self.cfg.max_model_len}. Please request fewer output tokens. "
                                    f"(parameter=max_tokens, value={max_tokens})", "BadRequestError", "max_tokens")

        gen = await self.engine.generate_async(messages, thinking, max_tokens)
        n_prompt = len(gen.prompt_ids)
        if n_prompt >= self.cfg.max_model_len:
            over = self.cfg.max_model_len + 1  # vLLM counts no further than one over the limit
            return self._error(
                400,
                f"This model's maximum context length is {self.cfg.max_model_len} tokens. However, your prompt "
                f"contains at least {over} input tokens, which exceeds this limit even without any output tokens. "
                f"Please reduce the length of the input prompt. (parameter=input_tokens, value={over})",
                "BadRequestError", "input_tokens",
            )
        if n_prompt + gen.n_tokens > self.cfg.max_model_len:  # vLLM caps the output at the context length
            gen = await self.engine.generate_async(messages, thinking, self.cfg.max_model_len - n_prompt)

        async with self.engine.slot():
            if body.get("stream"):
                return await self._stream(request, body, gen)
            await asyncio.sleep(self.engine.duration_s(gen))
        self.engine.count(gen)
        return web.json_response(self._response(body, gen), dumps=_dumps)

    def _message(self, reasoning: str | None, content: str | None) -> dict[str, Any]:
        # vLLM 0.33 sends no `tool_calls` key when there are none, and `reasoning` only (the old `reasoning_content`
        # is an option, for clients of older servers).
        msg: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None, "annotations": None,
                               "audio": None, "function_call": None, "reasoning": reasoning}
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
                    "routed_experts": None,
                    "weight_versions": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": {
                "prompt_tokens": len(gen.prompt_ids),
                "total_tokens": len(gen.prompt_ids) + gen.n_tokens,
                "completion_tokens": gen.n_tokens,
                "prompt_tokens_details": None,
                "completion_tokens_details": {"reasoning_tokens": gen.reasoning_tokens},
            },
            "prompt_logprobs": None,
            "prompt_token_ids": gen.prompt_ids if want_ids else None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    async def _stream(self, request: web.Request, body: dict[str, Any], gen: Generation) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        want_ids = bool(body.get("return_token_ids"))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        async def send(choice: dict[str, Any], **top: Any) -> None:
            chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.cfg.model,
                     "choices": [choice] if choice else [], **top}
            await resp.write(f"data: {_dumps(chunk)}\n\n".encode())

        first_top = {"prompt_token_ids": gen.prompt_ids, "prompt_text": None} if want_ids else {}
        await send({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}, **first_top)
        await asyncio.sleep(self.cfg.ttft_s)
        ids = gen.gen_ids or []
        # As vLLM streams: the markers give an empty delta (the parser consumes them), so does a token whose text
        # the detokenizer holds back (an incomplete character); the last chunk carries the finish reason.
        in_reasoning = bool(gen.reasoning is not None) and self.profile.prompt_opens_think
        markers = {self.ids.open_id, self.ids.close_id}
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        streamed_reasoning = 0  # vLLM's streaming count: reasoning tokens that gave text (held-back ones do not)
        for i, tid in enumerate(ids):
            if tid == self.ids.open_id:
                in_reasoning = True
            piece = gen.pieces[i] if i < len(gen.pieces) else ""
            last = i == len(ids) - 1
            key = "reasoning" if in_reasoning else "content"
            if in_reasoning and piece and tid not in markers:
                streamed_reasoning += 1
            if tid in markers:
                delta = {}
            elif piece or key == "content":  # a held-back piece: an empty content delta, but no reasoning delta
                delta = {key: piece}
            else:
                delta = {}
            if tid == self.ids.close_id:
                in_reasoning = False
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": gen.finish_reason if last else None}
            if last:
                choice["stop_reason"] = None
            if want_ids:
                choice["token_ids"] = [tid]
            top: dict[str, Any] = {"kv_transfer_params": None}
            if last:
                choice["weight_versions"] = None
                if not include_usage:
                    top["system_fingerprint"] = self.fingerprint
            await send(choice, **top)
            if not last:
                await asyncio.sleep(self.cfg.itl_s)
        if include_usage:
            n_reasoning = gen.reasoning_tokens if self.profile.name == "deepseek_r1" else streamed_reasoning
            usage = {"prompt_tokens": len(gen.prompt_ids), "total_tokens": len(gen.prompt_ids) + gen.n_tokens,
                     "completion_tokens": gen.n_tokens, "completion_tokens_details": {"reasoning_tokens": n_reasoning}}
            await send({}, usage=usage, system_fingerprint=self.fingerprint)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        self.engine.count(gen)
        return resp

    async def _transient(self, name: str, request: web.Request) -> web.StreamResponse:
        if name == "5xx":
            # vLLM's answer when its queue is full (--max-num-queued-reqs): the one 5xx it sends under load.
            return self._error(503, "The engine is currently busy and cannot accept new requests. Please try again "
                                    "later or on a different instance.", "Service Unavailable")
        if name == "429":
            return self._error(429, "Too many requests (simulated)", "RateLimitError")
        if name == "drop":
            if request.transport is not None:
                request.transport.abort()  # the client sees the connection closed without a response
            raise asyncio.CancelledError
        await asyncio.sleep(self.cfg.hang_s)  # "timeout": hold the request until the client gives up
        return self._error(504, "gateway timeout (simulated)", "TimeoutError")

    async def completions(self, request: web.Request) -> web.Response:
        """`/v1/completions` for token-id prompts, `max_tokens=1`: the hidden-state extraction call."""
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self._error(400, "request body is not JSON", "BadRequestError")
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt = self.tok.encode(prompt)
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            return self._error(400, "prompt must be a string or a non-empty list of token ids", "BadRequestError")
        if any(t < 0 or t >= self.tok.vocab_size for t in prompt):
            return self._error(400, "Token id out of vocabulary", "BadRequestError")
        if len(prompt) + int(body.get("max_tokens") or 16) > self.cfg.max_model_len:
            return self._error(400, f"This model's maximum context length is {self.cfg.max_model_len} tokens",
                               "BadRequestError")
        reply: dict[str, Any] = {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": self.cfg.model,
            "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                         "token_ids": [0], "prompt_logprobs": None,
                         "prompt_token_ids": prompt if body.get("return_token_ids") else None,
                         "routed_experts": None, "weight_versions": None}],
            "service_tier": None, "system_fingerprint": self.fingerprint,
            "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + 1, "completion_tokens": 1,
                      "prompt_tokens_details": None, "completion_tokens_details": None},
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
        }
        if self.connector is not None:
            path = await asyncio.get_running_loop().run_in_executor(None, self.connector.write, prompt)
            reply["kv_transfer_params"] = {"hidden_states_path": path}
        self.counters["prompt_tokens"] += len(prompt)
        return web.json_response(reply)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.cfg.model, "object": "model", "created": 0, "owned_by": "vllm",
                                         "root": self.cfg.model, "parent": None,
                                         "max_model_len": self.cfg.max_model_len}]}
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's `/tokenize`: a plain `prompt`, or chat `messages` rendered through the chat template (with
        `add_generation_prompt` and `chat_template_kwargs`, as a chat request would be)."""
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self._error(400, "request body is not JSON", "BadRequestError")
        if isinstance(body.get("messages"), list):
            try:
                messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in body["messages"]]
            except (KeyError, TypeError):
                return self._error(400, "each message needs 'role' and 'content'", "BadRequestError")
            kw = self.profile.thinking_kwarg
            thinking = bool((body.get("chat_template_kwargs") or {}).get(kw, True)) if kw else True
            tokens = self.tok.encode(render_prompt(self.profile, messages, thinking))
        else:
            tokens = self.tok.encode(str(body.get("prompt", "")))
        return web.json_response({"count": len(tokens), "max_model_len": self.cfg.max_model_len, "tokens": tokens,
                                  "token_strs": None}, dumps=_dumps)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.cfg.vllm_version})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        name = self.cfg.model
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f'vllm:num_requests_running{{model_name="{name}"}} {self.engine.running}',
            "# TYPE vllm:num_requests_waiting gauge",
            f'vllm:num_requests_waiting{{model_name="{name}"}} {self.engine.waiting}',
            "# TYPE vllm:prompt_tokens_total counter",
            f'vllm:prompt_tokens_total{{model_name="{name}"}} {self.counters["prompt_tokens"]}',
            "# TYPE vllm:generation_tokens_total counter",
            f'vllm:generation_tokens_total{{model_name="{name}"}} {self.counters["generation_tokens"]}',
            "# TYPE vllm:request_success_total counter",
            f'vllm:request_success_total{{model_name="{name}",finished_reason="stop"}} {self.counters["success"]}',
        ]
        lines.append(f"eagle3q_sim_peak_running {self.engine.peak_running}")
        for f in FAULTS:
            lines.append(f'eagle3q_sim_faults_total{{fault="{f}"}} {self.counters[f"fault_{f}"]}')
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.metrics)
        return app


def serve(cfg: SimConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    async def make() -> web.Application:
        return Simulator(cfg).app()

    web.run_app(make(), host=host, port=port, access_log=None, print=None)
