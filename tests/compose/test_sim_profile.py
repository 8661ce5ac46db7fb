"""The `sim` profile (the simulator with a tiny target, every worker on CPUs): more consumers for more req/s, faults
of the containers themselves (a consumer killed, Redis restarted mid-run), and the volumes' ownership whichever
image creates them."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.compose.stack import ARTIFACTS

# Images built in the first test, whole runs after: far past the suite's 300 s default.
pytestmark = pytest.mark.timeout(2400)
DATASET = "/app/eagle3q/data/perfectblend_sample.jsonl"


def _ready_consumers(c) -> int:  # noqa: ANN001
    return c.logs("inference").count(" ready.")


def _wait_consumers(c, n: int, timeout_s: float = 180) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while _ready_consumers(c) < n:
        assert time.monotonic() < deadline, c.logs("inference")[-4000:]
        time.sleep(1)


def test_scale_inference_to_three_consumers(compose):  # noqa: ANN001
    """`docker compose up -d --scale inference=3` where the server has room (64 slots, 4 threads a consumer, a
    0.4 s time to first token): three consumers finish a run at >= 2.5x one consumer's req/s."""
    c = compose("scale", "env.sim", INFERENCE_CONCURRENCY="4", EAGLE3Q_INFLIGHT_MODE="off",
                SIM_ARGS="--ttft 0.4 --itl 0.004 --mean-output-tokens 32")
    rates = {}
    for n in (1, 3):
        c("up", "-d", "--scale", f"inference={n}", "inference", timeout=600)
        _wait_consumers(c, n)
        run = f"scale{n}"
        c.run("producer", "eagle3q", "enqueue", DATASET, "--run", run)
        snap = c.wait(run, lambda s: s["stages"]["inference"]["pending"] == 0, 300, f"{run} generated",
                      via="inference", every_s=1)
        inf = snap["stages"]["inference"]
        assert inf["incoming"] == inf["done"] == 240, inf  # sampled: every prompt is sent, repeats too
        rates[n] = inf["rate_per_s"]
    ratio = rates[3] / rates[1]
    (ARTIFACTS / "scale.json").write_text(json.dumps({"req_per_s": rates, "ratio": round(ratio, 3)}))
    assert ratio >= 2.5, rates


def test_consumer_killed_and_redis_restarted_mid_run(compose):  # noqa: ANN001
    """`docker kill` of one of two consumers and `docker restart` of Redis while the run goes: every prompt ends
    once, the stages' counts add up, the sample files match them, and training runs once."""
    c = compose("faults", "env.sim", INFERENCE_CONCURRENCY="4", SIM_ARGS="--target-model /models/tiny --ttft 1.0",
                EAGLE3Q_VISIBILITY_TIMEOUT_S="20", EAGLE3Q_RESTORE_SWEEP_S="2", EAGLE3Q_EPOCHS="6")
    c("up", "-d", "--scale", "inference=2", timeout=600)
    _wait_consumers(c, 2)
    run = "faults"
    c.run("producer", "eagle3q", "enqueue", DATASET, "--run", run, "--max-samples", "120")
    consumer = c.container_ids("inference")[0]
    c.wait(run, lambda s: s["stages"]["inference"]["done"] >= 20, 300, "20 generated", via="flower", every_s=0.5)
    subprocess.run(["docker", "kill", consumer], check=True, capture_output=True, timeout=60)
    c.wait(run, lambda s: s["stages"]["inference"]["done"] >= 50, 300, "50 generated", via="flower", every_s=0.5)
    redis_id = c.container_ids("redis")[0]
    subprocess.run(["docker", "restart", "-t", "10", redis_id], check=True, capture_output=True, timeout=120)
    snap = c.wait(run, lambda s: s["train"].get("state") == "done", 900, "trained", via="flower", every_s=3)

    inf, hs = snap["stages"]["inference"], snap["stages"]["hidden_states"]
    assert inf["incoming"] == 120 and inf["done"] + inf["rejected"] == 120, inf
    assert hs["incoming"] == inf["done"] and hs["done"] + hs["rejected"] == hs["incoming"], hs
    assert inf["done"] >= 110 and hs["done"] >= 100, (inf, hs)  # faults cost time, not samples
    files = c.run("producer", "sh", "-c", f"find /store/{run}/samples -name '*.json' | wc -l").stdout.split()[-1]
    hs_files = c.run("producer", "sh", "-c",
                     f"find /store/{run}/hidden -name '*.safetensors' | wc -l").stdout.split()[-1]
    assert int(files) == inf["done"] and int(hs_files) == hs["done"], (files, hs_files)
    result = json.loads(c.run("producer", "cat", f"/store/{run}/train/result.json").stdout)
    assert not result.get("resumed_from") and result["steps"] > 0
    trainer_log = c.logs("trainer_cpu")
    assert trainer_log.count("training samples") == 1, trainer_log[-3000:]  # one training, never a second
    # The sim profile's draft learns (it was 20 steps at lr 1e-4, accuracy ~0, before the cpu workers' settings)
    assert float(json.loads(snap["train"]["acc"])[0]) > 0.2, snap["train"]


def _write(c, service: str, path: str, *pre: str) -> None:  # noqa: ANN001
    r = c("run", "--rm", "-T", "--no-deps", *pre, service, "-c", f"mkdir -p {path} && touch {path}/f /models/f-$$",
          check=False)
    assert r.returncode == 0, f"{service} cannot write {path}: {r.stdout}{r.stderr}"


def test_store_and_models_volumes_writable_whichever_image_creates_them(compose):  # noqa: ANN001
    """The light, CPU-worker and vLLM images all run as uid 1000 and own /store and /models: a volume takes its
    owner from the first image that mounts it, and every other image still writes to it, in either order."""
    writers = {"light": ("producer", ("--entrypoint", "sh")),
               "cpu": ("trainer_cpu", ("--entrypoint", "sh")),
               "vllm-cpu": ("vllm-cpu", ("--entrypoint", "sh"))}
    for order in (("light", "cpu", "vllm-cpu"), ("vllm-cpu", "cpu", "light")):
        c = compose(f"own-{order[0]}", "env.cpu")
        c("up", "-d", "redis", timeout=300)
        for image in order:
            service, pre = writers[image]
            _write(c, service, f"/store/by-{image}", *pre)
        listing = c("run", "--rm", "-T", "--no-deps", "--entrypoint", "sh", "producer", "-c",
                    "stat -c '%u %n' /store /store/* /models").stdout
        assert all(line.startswith("1000 ") for line in listing.split("\n") if line.strip()), listing
    # vLLM's GPU images run as root: after volume-init, a file a root container writes into the connector's
    # directory is still one the hidden-state workers (uid 1000) can delete once read
    c("--profile", "gpu-extract", "run", "--rm", "-T", "--no-deps", "volume-init")
    c("run", "--rm", "-T", "--no-deps", "--user", "root", "--entrypoint", "sh", "vllm-cpu", "-c",
      "touch /store/connector/hs_0.safetensors")
    r = c("run", "--rm", "-T", "--no-deps", "--entrypoint", "sh", "producer", "-c",
          "rm /store/connector/hs_0.safetensors && id -u", check=False)
    assert r.returncode == 0 and r.stdout.strip() == "1000", r.stdout + r.stderr
