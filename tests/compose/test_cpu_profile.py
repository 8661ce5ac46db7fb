"""The `cpu` profile as a user runs it (docs/deployment.md, "No GPUs: the cpu profile"): vLLM's real CPU engine
generating with the kimi_k2 parser, the GPU hand-off (generation -> extraction -> training, one server at a time),
Flower, and the export served by a speculating vLLM, measured against the offline figure."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time

import httpx
import pytest

from tests.compose.conftest import PASSWORDS
from tests.compose.stack import ARTIFACTS, ROOT

# Images built in the first test, whole runs after: far past the suite's 300 s default.
pytestmark = pytest.mark.timeout(2400)
DATASET = "/app/eagle3q/data/perfectblend_sample.jsonl"  # the bundled open-perfectblend sample, in the light image
RUN = "demo"
WORKER_SERVICES = ("inference", "hidden_states_vllm_cpu", "trainer_cpu", "flower", "exporter")


def _screenshot(url: str, out) -> bool:  # noqa: ANN001
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        return False
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tempfile.mkdtemp()}", "--window-size=1280,720",
                    f"--screenshot={out}", url], capture_output=True, timeout=120)
    return out.is_file() and out.stat().st_size > 5000


def test_cpu_profile_end_to_end_with_the_gpu_hand_off(compose):  # noqa: ANN001
    c = compose("cpu")
    timings: dict[str, float] = {}
    t0 = time.monotonic()

    # docker compose up -d: redis, the tiny target, vLLM generating (healthy before the consumers start), the
    # inference consumer, Flower, the exporter
    c("up", "-d", timeout=900)
    timings["up"] = time.monotonic() - t0

    # deploy/first-contact.sh http://localhost:8000/v1, on the host, against the published port
    fc = subprocess.run(["bash", str(ROOT / "deploy" / "first-contact.sh"), f"http://localhost:{c.ports['VLLM_PORT']}/v1"],
                        capture_output=True, text=True, timeout=300)
    assert fc.returncode == 0, fc.stdout + fc.stderr
    assert "first contact: all checks passed" in fc.stdout and "[FAIL]" not in fc.stdout

    # Flower: every pipeline queue with its depth, behind the password
    flower = f"http://localhost:{c.ports['FLOWER_PORT']}"
    auth = (PASSWORDS["FLOWER_USER"], PASSWORDS["FLOWER_PASSWORD"])
    assert httpx.get(f"{flower}/api/queues/length", timeout=10).status_code == 401
    assert httpx.get(f"{flower}/api/queues/length", auth=(auth[0], "wrong"), timeout=10).status_code == 401

    enq = c.run("producer", "eagle3q", "enqueue", DATASET, "--run", RUN)
    assert re.search(r"204 enqueued, 0 already known, 0 bad rows", enq.stdout), enq.stdout
    queues = httpx.get(f"{flower}/api/queues/length", auth=auth, timeout=10).json()["active_queues"]
    assert {q["name"] for q in queues} == {"inference", "hidden_states", "train"}
    assert all(isinstance(q["messages"], int) for q in queues)
    shot = ARTIFACTS / "flower-broker.png"
    shot.unlink(missing_ok=True)
    page = f"http://{auth[0]}:{auth[1]}@localhost:{c.ports['FLOWER_PORT']}/broker"
    if not _screenshot(page, shot):
        pytest.fail("no screenshot of Flower's queue page (chromium missing or it failed)")

    # the hand-off, as on one GPU box: generation's server gives the GPUs to the extraction server, then to training
    c.run("producer", "eagle3q", "status", "--run", RUN, "--wait-for", "inference", "--timeout", "600", timeout=700)
    timings["generation"] = time.monotonic() - t0
    c("stop", "vllm-cpu")
    c("--profile", "cpu-extract", "up", "-d", "vllm-cpu-hs", "hidden_states_vllm_cpu", timeout=600)
    assert not c.container_ids("vllm-cpu")  # `ps` lists running containers: generation's engine stays stopped
    # the extraction server's first contact, on a stored sample (the generation server is stopped by now)
    ce = c.run("hidden_states_vllm_cpu", "eagle3q", "check-extraction", "--run", RUN, timeout=300)
    assert "== all checks passed" in ce.stdout and "[FAIL]" not in ce.stdout, ce.stdout
    assert f"one accepted sample of run {RUN} from the store (greedy)" in ce.stdout
    c.run("producer", "eagle3q", "status", "--run", RUN, "--wait-for", "hidden_states", "--timeout", "600",
          timeout=700)
    timings["extraction"] = time.monotonic() - t0
    c("stop", "vllm-cpu-hs", "hidden_states_vllm_cpu")
    c("--profile", "cpu-workers", "up", "-d", "trainer_cpu", timeout=300)
    c.run("producer", "eagle3q", "status", "--run", RUN, "--wait-for", "train", "--timeout", "900", timeout=1000)
    timings["training"] = time.monotonic() - t0

    snap = c.status(RUN)
    inf, hs = snap["stages"]["inference"], snap["stages"]["hidden_states"]
    assert inf["incoming"] == 240 and inf["done"] == 204 and inf["reasons"] == {"duplicate_prompt": 36}, inf
    assert hs["incoming"] == 204 and hs["done"] + hs["rejected"] == 204 and hs["done"] >= 200, hs
    assert hs["consistency"]["mean_top1"] >= 0.95  # the engine's states through the target's head: its tokens
    assert snap["train_fired"] and snap["train"]["state"] == "done"
    assert not snap.get("refused_workers")
    result = json.loads(c.run("producer", "cat", f"/store/{RUN}/train/result.json").stdout)
    assert result["steps"] > 100 and not result.get("resumed_from")  # trained for real, once
    # every worker container runs as uid 1000, and Celery never warned about running as root
    for svc in ("inference", "flower", "exporter"):
        assert c.exec(svc, "id", "-u").stdout.strip() == "1000", svc
    assert "superuser privileges" not in c.logs(*WORKER_SERVICES).lower()

    # the export served: a vLLM speculating with it (the README's --speculative-config), and eval-draft --server
    c("--profile", "cpu-eval", "up", "-d", "--wait", "vllm-cpu-eagle3", timeout=600)
    ev = c("--profile", "cpu-workers", "run", "--rm", "-T", "trainer_cpu", "eagle3q", "eval-draft", "--run", RUN,
           "--server", "http://vllm-cpu-eagle3:8002/v1", "--prompts", "16", timeout=900)
    timings["eval"] = time.monotonic() - t0
    m = re.search(r"\(k=(\d+), (\d+) drafts\): mean acceptance length ([\d.]+); offline, same prompts: ([\d.]+)",
                  ev.stdout)
    assert m, ev.stdout
    k, drafts, served, offline = int(m[1]), int(m[2]), float(m[3]), float(m[4])
    assert k == 3 and drafts > 100 and abs(served - offline) <= 0.02, m[0]
    held_out = re.search(r"^held-out\s+\d+\s+([\d.]+) / ([\d.]+) / ([\d.]+)", ev.stdout, re.M)
    assert held_out and float(held_out[3]) > 1.3, ev.stdout  # a trained draft, not an untrained one (~1.0)
    (ARTIFACTS / "cpu-profile.json").write_text(json.dumps(
        {"timings_s": {k: round(v, 1) for k, v in timings.items()}, "served": served, "offline": offline,
         "k": k, "drafts": drafts, "status": snap}, indent=1, default=str))


def test_broken_consumer_refuses_to_start_and_status_says_why(compose):  # noqa: ANN001
    """The first run's bug: a consumer whose tokenizer it cannot load reported ready and failed every task. Now it
    exits with the cause, and `status` shows it; the light image itself loads tokenizers through transformers
    (Kimi's has no tokenizer.json) without torch."""
    c = compose("refuse")
    c("up", "-d", "redis", "tiny-target", timeout=600)
    r = c("run", "--rm", "-T", "--no-deps", "-e", "EAGLE3Q_TOKENIZER=/models/no-such-tokenizer", "inference",
          check=False, timeout=300)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "the inference worker cannot start" in out and "/models/no-such-tokenizer does not exist" in out
    assert "ready." not in out
    snap = c.status("any")
    assert any("no-such-tokenizer" in w["cause"] for w in snap["refused_workers"].values()), snap["refused_workers"]
    probe = ("import sys; from eagle3q.generate.tokenizer import HFTokenizer; "
             "t = HFTokenizer('/models/tiny-kimi_k2'); ids = t.encode('<think>hi</think>'); "
             "assert t.token_to_id('</think>') in ids; print('torch' in sys.modules)")
    assert c.run("producer", "python", "-c", probe).stdout.strip().endswith("False")
