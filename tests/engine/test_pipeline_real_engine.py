"""The whole pipeline on vLLM's real engine: a shaped generating engine (kimi_k2 template and parser) answers the
inference consumers, a second engine with `extract_hidden_states` and the CPU connector gives the hidden states
(`EAGLE3Q_HS_BACKEND=vllm`), the trainer trains and exports; then a third engine speculates with that export
(`--speculative-config` eagle3): its outputs equal plain greedy, and the acceptance vLLM counts equals
`eval-draft`'s own loop on the same prompts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open

from eagle3q.dev.local import LocalStack, child_env
from eagle3q.dev.tiny import SAMPLE_DATASET
from eagle3q.dev.vllm_engine import Engine, eagle3_args, extraction_args, start_engine
from eagle3q.evaluation.offline import heldout_prompts
from eagle3q.extraction.transformers_backend import TransformersExtractor, default_aux_ids
from tests.engine.conftest import MODEL
from tests.store_paths import hidden_file, load_hidden, train_dir

RUN, K, MAX_NEW = "real", 3, 48
pytestmark = pytest.mark.timeout(900)  # the first test carries the module's run: generation, extraction, training


@pytest.fixture(scope="module")
def trained(generator: Callable, tiny: Path, tmp_path_factory: pytest.TempPathFactory,
            engines: list[Engine]) -> Iterator[LocalStack]:
    """One run through Celery on the real engines, trained and exported (shared by the tests below)."""
    tmp = tmp_path_factory.mktemp("engine-pipeline")
    gen, model_dir = generator("kimi_k2")
    connector = tmp / "connector"
    hs = start_engine(tiny, tmp / "hs", MODEL, extraction_args([*default_aux_ids(8), 8], connector))
    engines.append(hs)
    stack = LocalStack(tmp / "stack", tiny, sims=0, env={
        "EAGLE3Q_VLLM_BASE_URLS": gen.url, "EAGLE3Q_TOKENIZER": str(model_dir), "EAGLE3Q_REQUEST_TIMEOUT_S": "120",
        "EAGLE3Q_HS_BACKEND": "vllm", "EAGLE3Q_HS_VLLM_BASE_URL": hs.url, "EAGLE3Q_HS_CONNECTOR_DIR": str(connector),
        "EAGLE3Q_EPOCHS": "12", "EAGLE3Q_LR": "5e-3", "EAGLE3Q_TRAIN_BATCH_TOKENS": "1024",
        "EAGLE3Q_VAL_FRACTION": "0.25", "EAGLE3Q_CHECKPOINT_EVERY": "1000",
        # Greedy, as the demo: the random tiny target sampled at 0.6 is near-uniform, and its samples' states agree
        # with their tokens too seldom for the consistency check (a real model's sampled text agrees 0.6-0.9).
        "EAGLE3Q_TEMPERATURE": "0", "EAGLE3Q_TOP_P": "1"})
    try:
        stack.worker("inference", concurrency=8)
        stack.worker("hidden_states", concurrency=1)
        stack.worker("train", concurrency=1)
        stack.enqueue(SAMPLE_DATASET, RUN, max_samples=64)
        deadline = time.monotonic() + 600
        while stack.ledger.train_progress(RUN).get("state") not in ("done", "failed") and time.monotonic() < deadline:
            time.sleep(1)
        assert stack.ledger.train_progress(RUN).get("state") == "done", stack.ledger.train_progress(RUN)
        stack.connector = connector  # type: ignore[attr-defined]
        yield stack
    finally:
        stack.close()


def test_samples_and_hidden_states_are_the_real_engines(trained: LocalStack, tiny: Path,
                                                        assert_accounted: Callable) -> None:
    done, rejected = assert_accounted(trained, RUN)
    assert len(done) >= 48, rejected
    # the bundled data set repeats 3 of these 64 prompts: greedy, each repeat is rejected by name, not generated
    assert set(rejected.values()) <= {"prompt_too_long", "duplicate_prompt"}, rejected
    hs_done = trained.ledger.done_ids(RUN, "hidden_states")
    assert hs_done == done, [trained.store.read_rejection(RUN, "hidden_states", sid).detail
                             for sid in trained.ledger.rejected(RUN, "hidden_states")]
    from eagle3q.status import snapshot

    # vLLM's own states, checked against vLLM's own tokens: the consistency check passes them all.
    cons = snapshot(trained.ledger, RUN)["stages"]["hidden_states"]["consistency"]
    assert cons["checked"] == len(hs_done) and cons["inconsistent"] == 0 and cons["mean_top1"] >= 0.95, cons
    ref = TransformersExtractor(str(tiny), None, "cpu", "float32")
    for sid in sorted(hs_done)[:6]:
        s = trained.store.read_sample(RUN, sid)
        assert s.finish_reason == "stop" and s.reasoning
        ours = load_hidden(hidden_file(trained.store, RUN, sid))
        want = ref.extract([s.input_ids])[0]
        assert torch.equal(ours["input_ids"], torch.tensor(s.input_ids))
        # vLLM's fp32 states, stored in the store's dtype: equal to transformers' within that rounding
        torch.testing.assert_close(ours["aux_hidden_states"].float(), want.aux, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(ours["hidden_state"].float(), want.final, atol=3e-2, rtol=3e-2)
        with safe_open(str(hidden_file(trained.store, RUN, sid)), framework="pt") as f:
            assert json.loads(f.metadata()["backend"]) == "vllm"
    assert not any(trained.connector.iterdir())  # type: ignore[attr-defined]  every file read and removed
    assert (train_dir(trained.store, RUN) / "export" / "model.safetensors").is_file()


def test_check_extraction_on_the_real_engines(trained: LocalStack) -> None:
    """`eagle3q check-extraction` against vLLM's generating engine and its extraction engine: exit 0, the states
    of the configured layers, and the consistency figure printed."""
    r = subprocess.run([sys.executable, "-m", "eagle3q.cli", "check-extraction"], capture_output=True, text=True,
                       timeout=300, env=child_env(trained.env))
    print(r.stdout)  # the raw first contact, for the log
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[FAIL]" not in r.stdout and "all checks passed" in r.stdout
    assert f"layer ids asked {[*default_aux_ids(8), 8]}" in r.stdout and '"offset": 0' in r.stdout
    top1 = float(re.search(r'"top1": ([\d.]+)', r.stdout)[1])
    assert top1 >= 0.95, r.stdout


@pytest.fixture(scope="module")
def speculating(trained: LocalStack, tiny: Path, tmp_path_factory: pytest.TempPathFactory,
                engines: list[Engine]) -> Engine:
    export = train_dir(trained.store, RUN) / "export"
    e = start_engine(tiny, tmp_path_factory.mktemp("engine-spec"), MODEL, eagle3_args(export, K), max_num_seqs=4,
                     max_model_len=4096)
    engines.append(e)
    return e


def test_speculative_outputs_equal_plain_greedy(trained: LocalStack, speculating: Engine, tiny: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    prompts = heldout_prompts(trained.store, RUN, 4)
    assert prompts, "the run has no held-out prompt"  # a loop over nothing would pass
    for prompt in prompts:
        r = httpx.post(f"{speculating.url}/completions", timeout=120, json={
            "model": MODEL, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}).json()
        seq = list(prompt)
        with torch.inference_mode():
            for _ in range(MAX_NEW):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert r["choices"][0]["token_ids"] == seq[len(prompt):]


def test_vllm_acceptance_equals_eval_draft(trained: LocalStack, speculating: Engine) -> None:
    """`eagle3q eval-draft --server`: vLLM's own counters beside our loop, on the run's held-out prompts."""
    r = subprocess.run([str(Path(sys.executable).parent / "eagle3q"), "eval-draft", "--run", RUN,
                        "--prompts", "12", "--max-new", str(MAX_NEW), "--server", speculating.url,
                        "--ood-per-category", "2"],
                       capture_output=True, text=True, timeout=600, env=child_env(trained.env))
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(rf"k={K}, (\d+) drafts\): mean acceptance length ([\d.]+); offline, same prompts: ([\d.]+)",
                  r.stdout)
    assert m, r.stdout
    drafts, served, offline = int(m[1]), float(m[2]), float(m[3])
    assert drafts > 12 * 5
    assert abs(served - offline) <= 0.01, r.stdout
    assert served > 1.2  # the trained draft does help: 1.0 is a draft that never hits
    rates = [float(x) for x in re.findall(r"\d:([\d.]+)", r.stdout.split("draft position:")[1].splitlines()[0])]
    assert len(rates) == K and rates == sorted(rates, reverse=True)  # a later position is never accepted more often
    # the out-of-domain prompts too (2 a category, pooled from vLLM's counters per category): vLLM agrees
    report = json.loads((train_dir(trained.store, RUN) / "eval" / "eval.json").read_text())
    ood_served, ood = report["served"]["mean"]["out-of-domain"], report["sets"]["out-of-domain"]
    assert ood["prompts"] == 10 and abs(ood_served - ood["mean"]["trained"][str(K)]) <= 0.02, report
    assert "out-of-domain" in r.stdout
    assert (train_dir(trained.store, RUN) / "eval" / "acceptance_by_position.png").is_file()

