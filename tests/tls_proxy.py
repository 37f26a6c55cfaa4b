"""TLS in front of a PostgreSQL server built without it: a loopback proxy that answers PostgreSQL's
SSLRequest, completes the TLS handshake with a given certificate, and forwards the decrypted protocol.

To the client (libpq, so pgcdc) it is a TLS PostgreSQL server: ``sslmode=verify-full`` checks its
certificate chain and host name, exactly as against a server with ``ssl=on`` or a pooler terminating TLS.
Plain (non-TLS) start-ups are refused, like ``hostnossl ... reject``.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import struct
import threading
from pathlib import Path

SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104


class TlsTerminatingProxy:
    def __init__(self, target_port: int, certfile: Path, keyfile: Path) -> None:
        self.target = ("127.0.0.1", target_port)
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(certfile, keyfile)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="tls-proxy", daemon=True)
        self.refused_plain = 0
        self.handshakes = 0

    def __enter__(self) -> TlsTerminatingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._listener.close()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        client.settimeout(30)
        try:
            while True:
                head = _read_exactly(client, 8)
                length, code = struct.unpack(">II", head)
                if length == 8 and code == GSSENC_REQUEST:
                    client.sendall(b"N")
                    continue
                if length == 8 and code == SSL_REQUEST:
                    client.sendall(b"S")
                    break
                self.refused_plain += 1  # a plain start-up: refused, TLS is required
                client.close()
                return
            secure = self._context.wrap_socket(client, server_side=True)
            self.handshakes += 1
            upstream = socket.create_connection(self.target, timeout=10)
        except (OSError, ssl.SSLError, struct.error):
            with contextlib.suppress(OSError):
                client.close()
            return
        secure.settimeout(None)
        upstream.settimeout(None)
        _pump(secure, upstream)


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise OSError("closed during start-up")
        data += chunk
    return data


def _pump(secure: ssl.SSLSocket, upstream: socket.socket) -> None:
    """Both directions in one thread (an SSL object must not be read and written from two threads)."""
    peers = {secure: upstream, upstream: secure}
    try:
        while True:
            readable = [secure] if secure.pending() else select.select([secure, upstream], [], [], 1.0)[0]
            for sock in readable:
                data = sock.recv(65536)
                if not data:
                    return
                peers[sock].sendall(data)
    except (OSError, ssl.SSLError):
        return
    finally:
        for sock in (secure, upstream):
            with contextlib.suppress(OSError):
                sock.close()
