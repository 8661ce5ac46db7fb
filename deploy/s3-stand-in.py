"""The `s3` profile's object store: moto's S3 server on :9000 with the bucket $S3_BUCKET made before it reports
healthy (/tmp/ready, the compose healthcheck). A stand-in for a real bucket, on the compose network only."""

import os
import time

import boto3
from moto.server import ThreadedMotoServer

server = ThreadedMotoServer(ip_address="0.0.0.0", port=9000)
server.start()
boto3.client("s3", endpoint_url="http://127.0.0.1:9000", region_name=os.environ.get("S3_REGION", "us-east-1"),
             aws_access_key_id="stand-in", aws_secret_access_key="stand-in").create_bucket(
    Bucket=os.environ.get("S3_BUCKET", "eagle3q"))
open("/tmp/ready", "w").close()  # noqa: SIM115
print(f"S3 stand-in on :9000, bucket {os.environ.get('S3_BUCKET', 'eagle3q')}", flush=True)
while True:
    time.sleep(3600)
