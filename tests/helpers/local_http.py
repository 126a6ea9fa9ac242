"""A local HTTP server for tests of clients that poll one (readiness probes, the launcher)."""
from __future__ import annotations

import contextlib
import http.server
import threading


@contextlib.contextmanager
def answering(status: int | None = None, raw: bytes | None = None):
    """A local HTTP server that answers every GET with `status`, or with the bytes `raw`."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if raw is not None:
                self.wfile.write(raw)
                return
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
