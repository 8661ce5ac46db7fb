"""A real S3 server on this machine, for the store's tests and benchmarks: moto's standalone server (`python -m
moto.server`, the S3 stand-in that pandas' and s3fs' own tests run against; the `dev` extra) on a free loopback
port, with authentication enforced (an IAM user and its key, so wrong credentials are refused as AWS refuses them),
a bucket, and the front the store talks to (eagle3q.dev.s3_front): it can be killed and restarted, made to refuse
PUTs for a while, or add a remote store's latency."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3q.dev.local import free_port

POLICY = '{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"*","Resource":"*"}]}'


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{what} not listening on {port}")


@dataclass
class S3Server:
    workdir: Path
    bucket: str = "eagle3q-test"
    moto_port: int = 0
    port: int = 0  # the front the store talks to
    key_id: str = ""
    secret: str = ""
    delay_ms: float = 0.0  # added by the front to every request

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.refuse_flag = self.workdir / "refuse-puts"
        self.moto_port, self.port = free_port(), free_port()
        # Requests before the count is spent are not authenticated: the IAM set-up below; every later one is.
        env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}
        self.moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                      str(self.moto_port)], env=env, stdout=subprocess.DEVNULL,
                                     stderr=(self.workdir / "moto.log").open("ab"))
        _wait_port(self.moto_port, self.moto, "moto")
        import boto3

        iam = boto3.client("iam", endpoint_url=self.moto_url, region_name="us-east-1", aws_access_key_id="setup",
                           aws_secret_access_key="setup")
        iam.create_user(UserName="eagle3q")
        iam.put_user_policy(UserName="eagle3q", PolicyName="all", PolicyDocument=POLICY)
        key = iam.create_access_key(UserName="eagle3q")["AccessKey"]
        self.key_id, self.secret = key["AccessKeyId"], key["SecretAccessKey"]
        self.client().create_bucket(Bucket=self.bucket)
        self.proxy: subprocess.Popen | None = None
        self.start_front()

    @property
    def moto_url(self) -> str:
        return f"http://127.0.0.1:{self.moto_port}"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def env(self, prefix: str) -> dict[str, str]:
        """What a worker is given: the store URL and endpoint as settings, the key in AWS_* variables."""
        return {"EAGLE3Q_STORE_URL": self.url(prefix), "EAGLE3Q_S3_ENDPOINT": self.endpoint,
                "AWS_ACCESS_KEY_ID": self.key_id, "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_REGION": "us-east-1"}

    def client(self):  # noqa: ANN201 - a boto3 S3 client straight to moto (the tests' own view of the bucket)
        import boto3

        return boto3.client("s3", endpoint_url=self.moto_url, region_name="us-east-1",
                            aws_access_key_id=self.key_id, aws_secret_access_key=self.secret)

    def keys(self, prefix: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            out |= {o["Key"]: o["Size"] for o in page.get("Contents", [])}
        return out

    def start_front(self) -> None:
        self.proxy = subprocess.Popen([sys.executable, "-m", "eagle3q.dev.s3_front", str(self.port),
                                       str(self.moto_port), str(self.refuse_flag), str(self.delay_ms)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port, self.proxy, "the S3 front")

    def kill_front(self) -> None:
        """SIGKILL: connections drop mid-request, new ones are refused, until start_front."""
        if self.proxy is not None:
            self.proxy.kill()
            self.proxy.wait()
            self.proxy = None

    def refuse_puts(self, on: bool) -> None:
        if on:
            self.refuse_flag.touch()
        else:
            self.refuse_flag.unlink(missing_ok=True)

    def close(self) -> None:
        self.kill_front()
        self.moto.kill()
        self.moto.wait()
