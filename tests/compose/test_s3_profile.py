"""The `s3` profile (deploy/env.s3): the sim profile's stages as on machines that share no disk. The inference,
hidden-state and trainer containers mount no volume at all; they share only Redis and an object store (moto's
server, its image built here). The run completes, its counts add up, training runs once, and the export is fetched
from the bucket."""

from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = pytest.mark.timeout(2400)
DATASET = "/app/eagle3q/data/perfectblend_sample.jsonl"
SERVICES = ("sim_s3", "inference_s3", "hidden_states_s3", "trainer_s3")


def test_stages_that_share_no_volume_complete_a_run_through_the_bucket(compose):  # noqa: ANN001
    c = compose("s3", "env.s3", S3_ACCESS_KEY_ID="eagle3q-test-key", S3_SECRET_ACCESS_KEY="eagle3q-test-secret",
                INFERENCE_CONCURRENCY="8", EAGLE3Q_EPOCHS="4", SIM_ARGS="--target-model /models/tiny --ttft 0.05")
    c("up", "-d", "redis", "s3", *SERVICES, timeout=900)
    for service in SERVICES:  # no volume, no bind mount: nothing on a disk another container sees
        for cid in c.container_ids(service):
            mounts = subprocess.run(["docker", "inspect", "-f", "{{json .Mounts}}", cid], capture_output=True,
                                    text=True, check=True, timeout=60).stdout
            assert json.loads(mounts) == [], (service, mounts)

    run = "s3demo"
    c.run("producer_s3", "eagle3q", "enqueue", DATASET, "--run", run, "--max-samples", "60")

    def status() -> dict:
        r = c.run("producer_s3", "eagle3q", "status", "--run", run, "--json")
        return json.loads(r.stdout[r.stdout.index("{"):])

    import time

    deadline = time.monotonic() + 900
    snap = status()
    while snap["train"].get("state") != "done":
        assert time.monotonic() < deadline and snap["train"].get("state") != "failed", \
            (snap, c.logs(*SERVICES)[-6000:])
        time.sleep(3)
        snap = status()
    inf, hs = snap["stages"]["inference"], snap["stages"]["hidden_states"]
    assert inf["incoming"] == 60 and inf["done"] + inf["rejected"] == 60, inf
    assert hs["incoming"] == inf["done"] and hs["done"] + hs["rejected"] == hs["incoming"], hs
    assert hs["done"] >= 50 and snap["store"]["url"] == "s3://eagle3q/store" and snap["store"]["free_bytes"] is None
    assert c.logs("trainer_s3").count("training samples") == 1  # trained once

    # The export, fetched from the bucket into a container that never saw the trainer's disk, is vLLM's layout.
    r = c.run("producer_s3", "sh", "-c", f"eagle3q fetch-export /tmp/draft --run {run} && "
              "python -c \"import json; print(json.load(open('/tmp/draft/config.json'))['architectures'])\" && "
              "wc -c < /tmp/draft/model.safetensors")
    assert "LlamaForCausalLMEagle3" in r.stdout, r.stdout + r.stderr
    assert int(r.stdout.split()[-1]) > 100_000, r.stdout
