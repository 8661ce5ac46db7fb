"""The whole pipeline against vLLM 0.33's real frontend: producer, Celery inference workers (the real client, the
/version floor, the context sizing, validation), hidden states and the accounting, with vLLM's own server in place of
the simulator."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx

from eagle3q.dev.local import child_env
from eagle3q.dev.tiny import SAMPLE_DATASET
from tests.conformance.vllm_server import MAX_MODEL_LEN, MODEL, VLLMServer
from tests.store_paths import hidden_file

ROOT = Path(__file__).parents[2]


def test_a_few_dozen_prompts_through_celery_against_real_vllm(kimi: VLLMServer, stack_factory: Callable,
                                                              assert_accounted: Callable, tiny: Path) -> None:
    stack = stack_factory(sims=0, env={"EAGLE3Q_VLLM_BASE_URLS": kimi.url, "EAGLE3Q_TOKENIZER": str(kimi.model_dir),
                                       "EAGLE3Q_MAX_TOKENS": "4096", "EAGLE3Q_REQUEST_TIMEOUT_S": "60"})
    stack.worker("inference", concurrency=8)
    stack.worker("hidden_states", concurrency=1)
    rep = stack.enqueue(SAMPLE_DATASET, "real", max_samples=36)
    assert rep.enqueued == 36
    stack.wait_settled("real", stages=("inference", "hidden_states"), timeout_s=240)
    done, rejected = assert_accounted(stack, "real")
    # Data-set prompts longer than the test server's 1024-token context are the only rejections, by that name;
    # max_tokens (4096 asked) was sized down to each prompt's room, so no request was refused for it.
    assert set(rejected.values()) <= {"prompt_too_long"}, rejected
    assert len(done) >= 30
    assert stack.ledger.counts("real", "hidden_states").done == len(done)
    for sid in sorted(done)[:10]:
        s = stack.store.read_sample("real", sid)
        body = {"model": MODEL, "messages": [m.model_dump() for m in s.messages], "max_tokens": 16,
                "return_token_ids": True, "skip_special_tokens": False, "chat_template_kwargs": {"thinking": True}}
        direct = httpx.post(f"{kimi.url}/chat/completions", json=body, timeout=30).json()
        # The stored prompt is vLLM's own rendering of the chat template, token for token.
        assert s.input_ids[: s.num_prompt_tokens] == direct["prompt_token_ids"]
        assert len(s.input_ids) <= MAX_MODEL_LEN
        assert s.finish_reason == "stop" and s.reasoning
        assert hidden_file(stack.store, "real", sid).is_file()


def test_first_contact_script_passes_against_real_vllm(kimi: VLLMServer) -> None:
    r = subprocess.run(["bash", str(ROOT / "deploy" / "first-contact.sh"), kimi.url], capture_output=True, text=True,
                       timeout=120, env=child_env({}))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all checks passed" in r.stdout
