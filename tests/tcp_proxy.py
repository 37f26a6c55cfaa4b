"""A TCP proxy on loopback that a test can cut: the network between pgcdc and PostgreSQL, made faulty.

``reset()`` closes every connection with RST and refuses new ones (a crashed router, a firewall
reject); ``blackhole()`` keeps connections open but forwards nothing either way (a silent
partition: no FIN, no RST, only silence); ``heal()`` forwards again.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._pairs: dict[socket.socket, socket.socket] = {}
        self._lock = threading.Lock()
        self._mode = "forward"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tcp-proxy", daemon=True)
        self.connections = 0

    def __enter__(self) -> TcpProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._close_all(reset=False)
        self._listener.close()

    def dsn(self, dsn: str) -> str:
        """``dsn`` going through this proxy."""
        import psycopg

        params = psycopg.conninfo.conninfo_to_dict(dsn)
        params.update(host="127.0.0.1", port=str(self.port))
        return psycopg.conninfo.make_conninfo(**params)

    def reset(self) -> None:
        with self._lock:
            self._mode = "refuse"
            self._close_all(reset=True)

    def blackhole(self) -> None:
        with self._lock:
            self._mode = "blackhole"

    def heal(self) -> None:
        with self._lock:
            self._mode = "forward"

    def _close_all(self, *, reset: bool) -> None:
        for sock in list(self._pairs):
            if reset:
                with contextlib.suppress(OSError):  # linger 0: close sends RST
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            with contextlib.suppress(OSError):
                sock.close()
        self._pairs.clear()

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        self._listener.setblocking(False)
        selector.register(self._listener, selectors.EVENT_READ)
        registered: set[socket.socket] = set()
        while not self._stop.is_set():
            with self._lock:
                mode = self._mode
                live = set(self._pairs) if mode == "forward" else set()
            for sock in registered - live:
                with contextlib.suppress(KeyError, ValueError, OSError):
                    selector.unregister(sock)
            for sock in live - registered:
                with contextlib.suppress(KeyError, ValueError, OSError):
                    selector.register(sock, selectors.EVENT_READ)
            registered = live
            for key, _ in selector.select(timeout=0.05):
                sock = key.fileobj
                if sock is self._listener:
                    self._accept(mode)
                    continue
                self._forward(sock)  # type: ignore[arg-type]

    def _accept(self, mode: str) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        if mode == "refuse":
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()
            return
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        client.setblocking(False)
        upstream.setblocking(False)
        with self._lock:
            self._pairs[client] = upstream
            self._pairs[upstream] = client
            self.connections += 1

    def _forward(self, sock: socket.socket) -> None:
        with self._lock:
            peer = self._pairs.get(sock)
        if peer is None:
            return
        try:
            data = sock.recv(65536)
            if data:
                peer.setblocking(True)
                peer.sendall(data)
                peer.setblocking(False)
                return
        except OSError:
            pass
        with self._lock:  # one side closed: close both
            for end in (sock, peer):
                self._pairs.pop(end, None)
                with contextlib.suppress(OSError):
                    end.close()
