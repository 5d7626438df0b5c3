"""A real GCS JSON API server for the gs:// tier: `gcp-storage-emulator` in its own process, behind a small proxy
that enforces `ifGenerationMatch=0` the way Google Cloud Storage documents it.

Why the proxy: the emulator accepts `ifGenerationMatch=0` and overwrites anyway (checked with 2026.7.19), so a
create-only test straight against it could never fail. Real GCS answers 412 Precondition Failed when the object
exists; gcsfs turns that into FileExistsError. The proxy does the same and nothing else: every request goes to
the emulator unchanged, except one that carries `ifGenerationMatch=0` for an object that already exists, which
gets the 412 GCS would send. The check and the forwarded write run under one lock, so two creators racing for one
key see exactly one winner (GCS evaluates the precondition when it creates the object; a resumable upload is
checked at every chunk, the last included).
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# gcsfs 2026.x asks a bucket's type over gRPC first, which the emulator does not speak: each new bucket would
# wait 60 s before gcsfs falls back. Read when gcsfs is imported, so set before any test process imports it.
GCS_ENV = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "GCS_TEST_TOKEN": "anon"}
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Emulator:
    """`gcp-storage-emulator start --in-memory` on a free localhost port, in its own process (its own GIL); the
    same command line as the package's script, through this interpreter so PATH does not matter."""

    def __init__(self) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host=127.0.0.1", f"--port={self.port}",
               "--in-memory"]
        self.proc = subprocess.Popen(cmd,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._wait_ready(time.monotonic() + 60)

    def _wait_ready(self, deadline: float) -> None:
        while True:
            try:
                with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b?project=test", timeout=2):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"gcp-storage-emulator did not start on port {self.port}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def create_bucket(endpoint: str, bucket: str) -> None:
    req = urllib.request.Request(f"{endpoint}/storage/v1/b?project=test", data=json.dumps({"name": bucket}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=10):
        pass


def _object_name(query: dict[str, list[str]], body: bytes) -> str | None:
    """The object a create-only upload writes: `name=` in the query, else the multipart body's JSON part."""
    if "name" in query:
        return query["name"][0]
    start = body.find(b"{")
    if start < 0:
        return None
    try:
        meta, _ = json.JSONDecoder().raw_decode(body[start:].decode("utf-8", errors="replace"))
    except json.JSONDecodeError:
        return None
    return meta.get("name") if isinstance(meta, dict) else None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: CreateOnlyProxy

    def log_message(self, *args: object) -> None:  # quiet: pytest shows failures, not every request
        pass

    def _any(self) -> None:
        if "chunked" in self.headers.get("Transfer-Encoding", ""):  # gcsfs sends sized bodies; say so if not
            return self._send(501, [], b"the test proxy reads Content-Length bodies only")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        if query.get("ifGenerationMatch") != ["0"]:
            return self._send(*self.server.forward(self.command, self.path, self.headers, body))
        bucket = url.path.split("/b/", 1)[-1].split("/", 1)[0]
        name = _object_name(query, body)
        with self.server.create_lock:
            if name is not None and self.server.exists(bucket, name):
                error = {"error": {"code": 412, "message": "At least one of the pre-conditions you specified did "
                                                           "not hold.", "errors": [{"reason": "conditionNotMet"}]}}
                return self._send(412, [("Content-Type", "application/json")], json.dumps(error).encode())
            self._send(*self.server.forward(self.command, self.path, self.headers, body))

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _any

    def _send(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.send_response(status)
        for k, v in headers:
            if k.lower() not in _HOP:
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class CreateOnlyProxy(ThreadingHTTPServer):
    """Forwards to `upstream`; answers 412 to `ifGenerationMatch=0` on an existing object, as GCS does."""

    daemon_threads = True

    def __init__(self, upstream_port: int) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream_port = upstream_port
        self.create_lock = threading.Lock()
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"
        self._thread = threading.Thread(target=self.serve_forever, name="gcs-create-only-proxy", daemon=True)
        self._thread.start()

    def forward(self, method: str, path: str, headers: object, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=60)
        try:  # the client's Host header goes through: the emulator builds resumable-upload URLs from it
            conn.request(method, path, body=body, headers={k: v for k, v in headers.items()  # type: ignore[attr-defined]
                                                          if k.lower() not in _HOP})
            resp = conn.getresponse()
            return resp.status, resp.getheaders(), resp.read()
        finally:
            conn.close()

    def exists(self, bucket: str, name: str) -> bool:
        status, _, _ = self.forward("GET", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}", {}, b"")
        return status == 200

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
