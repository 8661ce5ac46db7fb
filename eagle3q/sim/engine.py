"""The simulator's engine: deterministic generation (words from a bank, or greedy from a local target model), the
output faults, vLLM's reasoning split, and the latency model after llm-d-inference-sim: a request holds one of
`max_num_seqs` slots for TTFT + (n-1)·ITL; requests beyond the limit wait (and show in
`vllm:num_requests_waiting`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from eagle3q.generate.profiles import ResolvedProfile, get_profile, resolve
from eagle3q.generate.templates import render_prompt
from eagle3q.generate.tokenizer import load_tokenizer
from eagle3q.sim.faults import FAULTS, OUTPUT_FAULTS, prompt_fault
from eagle3q.sim.textgen import output_lengths, words_for


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
    # The extract_hidden_states mode (`eagle3q.sim.hidden_states`): where the connector's files go, and the layer
    # ids (vLLM convention, the last = L, the final state); empty: /v1/completions without kv_transfer_params.
    hs_dir: str = ""
    vllm_version: str = "0.17.0"  # what /version reports (the vLLM release whose behaviour the simulator follows)
    hs_layer_ids: list[int] = field(default_factory=list)
    hs_shift: int = 0  # a fault: the connector's states moved this many tokens against the token ids


@dataclass
class Generation:
    prompt_ids: list[int]
    gen_ids: list[int] | None
    reasoning: str | None
    content: str | None
    finish_reason: str
    n_tokens: int
    pieces: list[str] = field(default_factory=list)  # each generated token's text as vLLM's detokenizer streams it
    reasoning_tokens: int = 0  # usage.completion_tokens_details.reasoning_tokens


class Engine:
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

    def _prompt_fault(self, prompt: str, name: str) -> bool:
        return prompt_fault(self.cfg.faults, self.cfg.seed, prompt, name)

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

        pieces = self._pieces(prompt_ids, gen, finish)
        reasoning, content = self._parse(gen, pieces, thinking)
        if "leak" in faults and reasoning is not None:
            # A broken reasoning parser: everything lands in content, markers included.
            content = "".join(p for t, p in zip(gen, pieces, strict=True) if t != ids.end_id)
            reasoning = None
        n = len(gen)
        return Generation(prompt_ids, None if "null_ids" in faults else gen, reasoning, content, finish, n,
                          pieces=pieces, reasoning_tokens=self._reasoning_tokens(gen, thinking))

    def _pieces(self, prompt_ids: list[int], gen: list[int], finish: str) -> list[str]:
        """The text vLLM's incremental detokenizer gives for each token: a DecodeStream primed with the prompt, which
        gives nothing while a character's bytes are incomplete and the held-back text with the token that completes
        it (a trailing incomplete character never comes out); the end-of-turn token that stopped it gives none."""
        stream_tok = getattr(self.tok, "_tok", None)
        if stream_tok is None:  # not a `tokenizers` tokenizer: token by token
            pieces = [self.tok.decode([t]) for t in gen]
        else:
            from tokenizers.decoders import DecodeStream

            stream = DecodeStream(ids=prompt_ids, skip_special_tokens=False)
            pieces = [stream.step(stream_tok, t) or "" for t in gen]
        if gen and finish == "stop" and gen[-1] == self.ids.end_id:
            pieces[-1] = ""
        return pieces

    def _reasoning_tokens(self, gen: list[int], thinking: bool) -> int:
        """vLLM's count: tokens inside the reasoning, the markers not counted. The deepseek_r1 parser counts only
        between a generated <think> and </think> (none when the prompt opened it)."""
        if not thinking:
            return 0
        ids = self.ids
        if self.profile.name == "deepseek_r1":
            count = depth = 0
            for t in gen:
                if t == ids.open_id:
                    depth += 1
                elif t == ids.close_id:
                    depth = max(0, depth - 1)
                elif depth:
                    count += 1
            return count
        body = gen[: gen.index(ids.close_id)] if ids.close_id in gen else gen
        return sum(1 for t in body if t not in (ids.open_id, ids.end_id))

    async def generate_async(self, messages: list[dict[str, str]], thinking: bool, max_tokens: int) -> Generation:
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

    def _parse(self, gen: list[int], pieces: list[str], thinking: bool) -> tuple[str | None, str | None]:
        """What vLLM's reasoning parser returns: text before `</think>` is reasoning; no close marker means the
        whole output is reasoning. The text is the detokenizer's (`pieces`); the markers and the end of turn are
        not in it."""
        ids = self.ids
        skip = {ids.open_id, ids.close_id, ids.end_id}

        def held_back(i: int) -> str:
            """A marker's piece can start with text the detokenizer held back (a character's incomplete bytes,
            flushed as U+FFFD when the marker arrives): that text belongs before the marker, as in vLLM's parser."""
            marker = self.tok.decode([gen[i]])
            return pieces[i][: -len(marker)] if marker and pieces[i].endswith(marker) else ""

        def text(lo: int, hi: int) -> str:
            return "".join(held_back(lo + j) if t in skip else p
                           for j, (t, p) in enumerate(zip(gen[lo:hi], pieces[lo:hi], strict=True)))

        if not thinking:
            return None, text(0, len(gen))
        if ids.close_id in gen:
            cut = gen.index(ids.close_id)
            return text(0, cut) + held_back(cut), text(cut + 1, len(gen))
        return text(0, len(gen)), None

    # --- latency ---
    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one of `max_num_seqs` running slots (waiting, and counted as waiting, while none is free)."""
        self.waiting += 1
        async with self.slots:
            self.waiting -= 1
            self.running += 1
            self.peak_running = max(self.peak_running, self.running)
            try:
                yield
            finally:
                self.running -= 1

    def duration_s(self, gen: Generation) -> float:
        return self.cfg.ttft_s + max(gen.n_tokens - 1, 0) * self.cfg.itl_s

    def count(self, gen: Generation) -> None:
        self.counters["success"] += 1
        self.counters["prompt_tokens"] += len(gen.prompt_ids)
        self.counters["generation_tokens"] += gen.n_tokens


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
