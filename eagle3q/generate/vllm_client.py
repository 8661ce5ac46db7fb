"""The client of vLLM's OpenAI-compatible server: one chat completion with the exact token ids, and a clear split of
errors into transient (retried with backoff) and permanent (rejected with a reason)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import httpx

TRANSIENT_STATUS = {408, 409, 425, 429}


class TransientError(Exception):
    """Worth retrying: connect errors, timeouts, dropped connections, 408/409/425/429/5xx."""

    def __init__(self, kind: str, detail: str, endpoint: str = ""):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail
        self.endpoint = endpoint


class PermanentError(Exception):
    """Retrying cannot help (e.g. the prompt exceeds the context): the sample is rejected with `reason`."""

    def __init__(self, reason: str, detail: str, raw: dict[str, Any] | None = None):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.raw = raw


def backoff_s(attempt: int, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Exponential backoff with full jitter (AWS style): uniform in [0, min(cap, base * 2**attempt)]."""
    r = rng or random
    return r.uniform(0, min(cap, base * (2**attempt)))


@dataclass
class ChatRequest:
    model: str
    messages: list[dict[str, str]]
    temperature: float
    top_p: float
    max_tokens: int
    chat_template_kwargs: dict[str, Any]

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
            "stream": False,
            # vLLM >= 0.10.2: the exact prompt and generated ids, so samples are never rebuilt from text.
            "return_token_ids": True,
            # Special tokens kept in the text, as validation decodes them: vLLM's deepseek_r1 parser honours the
            # flag, and with `true` a `</think>` marked special is stripped before the split (content null, every
            # sample rejected). The split is made on the token ids anyway; the text is the cross-check.
            "skip_special_tokens": False,
        }
        if self.chat_template_kwargs:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        return body


def _error_message(resp: httpx.Response) -> str:
    try:
        data = resp.json()
        if isinstance(data, dict):
            err = data.get("error")
            if isinstance(err, dict):
                return str(err.get("message", ""))[:500]
            return str(data.get("message") or data.get("detail") or data)[:500]
    except (json.JSONDecodeError, UnicodeDecodeError):
        pass
    return resp.text[:500]


class VLLMClient:
    def __init__(self, api_key: str | None, timeout_s: float, max_connections: int):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))
        self.http = httpx.Client(headers=headers, timeout=timeout, limits=limits)

    def close(self) -> None:
        self.http.close()

    def chat(self, base_url: str, req: ChatRequest) -> dict[str, Any]:
        url = base_url.rstrip("/") + "/chat/completions"
        try:
            resp = self.http.post(url, json=req.body())
        except httpx.TimeoutException as e:
            raise TransientError("timeout", f"{type(e).__name__} after the request timeout", base_url) from e
        except httpx.ConnectError as e:
            raise TransientError("connect", str(e) or type(e).__name__, base_url) from e
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
            raise TransientError("dropped", str(e) or type(e).__name__, base_url) from e
        status = resp.status_code
        if status in TRANSIENT_STATUS or status >= 500:
            raise TransientError(f"http_{status}", _error_message(resp), base_url)
        if status == 400:
            msg = _error_message(resp)
            low = msg.lower()
            # Every context error (prompt over the context, max_tokens over max_model_len) by one name.
            context = ("context length" in low or "too long" in low or "max_model_len" in low
                       or "too large" in low)
            reason = "prompt_too_long" if context else "bad_request"
            raise PermanentError(reason, msg)
        if status >= 400:
            raise PermanentError(f"http_{status}", _error_message(resp))
        try:
            data = resp.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            # A proxy's HTML error page or a cut body: the server may answer properly next time.
            raise TransientError("bad_response", f"response is not JSON: {resp.text[:200]!r}", base_url) from e
        if not isinstance(data, dict):
            raise TransientError("bad_response", "response is not a JSON object", base_url)
        return data
