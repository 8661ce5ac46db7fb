"""A front for a local S3 server (moto's), for the tests' faults and the benchmarks' latency:
`python -m eagle3q.dev.s3_front LISTEN_PORT UPSTREAM_PORT FLAG_FILE [DELAY_MS]`.

It passes every request through byte for byte (the Host header too, so the client's SigV4 signature still checks),
DELAY_MS later (a remote object store's first-byte latency, which a loopback server does not have), except while
FLAG_FILE exists: then every PUT is answered `503 SlowDown`, as S3 answers when it throttles. Killing this process
is "the S3 server is down"; starting it again on the same port is "it came back" with its data intact (moto keeps
the objects in its own process, as a real server keeps them on its disks).
"""

from __future__ import annotations

import http.client
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


def handler(upstream: int, flag: Path, delay_s: float = 0.0) -> type[BaseHTTPRequestHandler]:
    class Forward(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _body(self) -> bytes:
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _forward(self) -> None:
            body = self._body()
            if delay_s:
                time.sleep(delay_s)
            if self.command == "PUT" and flag.exists():
                self.send_response(503)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(SLOW_DOWN)))
                self.end_headers()
                self.wfile.write(SLOW_DOWN)
                return
            conn = http.client.HTTPConnection("127.0.0.1", upstream, timeout=60)
            try:
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for k, v in self.headers.items():
                    conn.putheader(k, v)
                conn.endheaders(body if body else None)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status, resp.reason)
                head = self.command == "HEAD"  # its Content-Length is the object's size: passed on as it is
                for k, v in resp.getheaders():
                    skip = ("transfer-encoding", "connection", "date", "server") + (() if head else ("content-length",))
                    if k.lower() not in skip:
                        self.send_header(k, v)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
            finally:
                conn.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    return Forward


def main(argv: list[str]) -> None:
    listen, upstream, flag = int(argv[0]), int(argv[1]), Path(argv[2])
    delay_ms = float(argv[3]) if len(argv) > 3 else 0.0
    server = ThreadingHTTPServer(("127.0.0.1", listen), handler(upstream, flag, delay_ms / 1000))
    server.daemon_threads = True
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
