"""Port 443 and DNS inside a test's network namespace, reaching the server on this host.

Started in the host's network namespace, it enters the namespace named by --netns only long
enough to open its sockets there (a socket stays in the namespace it was made in), then comes
back: its TCP listeners on 127.0.0.1:443 and <address>:443 inside the namespace are relayed to
--upstream, which it connects to from the host's namespace. So the namespace needs no link to
anything: its only interface is its loopback, and no packet of it can go anywhere but here.

Inside the namespace it also answers DNS on <address>:53 (the FakeDns of e2e_util): <domain>
and every name under it resolve to <address>; every other name is NXDOMAIN.

Prints "ready" once everything listens; runs until killed.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import socket
import sys
import threading

from e2e_util import FakeDns

CLONE_NEWNET = 0x40000000


def setns(fd: int) -> None:
    """Moves the calling thread (the only one yet) into the network namespace of `fd`."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


def listen(host: str, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(128)
    return s


class Pair:
    """A client's connection and its upstream one: each direction is pumped by a thread,
    and both are closed once both directions have ended."""

    def __init__(self, client: socket.socket, upstream: socket.socket):
        self.sockets = (client, upstream)
        self.open = 2
        self.lock = threading.Lock()
        threading.Thread(target=self.pump, args=(client, upstream), daemon=True).start()
        threading.Thread(target=self.pump, args=(upstream, client), daemon=True).start()

    def pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        try:
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        with self.lock:
            self.open -= 1
            done = self.open == 0
        if done:
            for s in self.sockets:
                s.close()


def relay(listener: socket.socket, upstream: tuple) -> None:
    while True:
        client, _ = listener.accept()
        try:
            server = socket.create_connection(upstream, timeout=5)
        except OSError as e:
            print(f"relay: cannot reach {upstream}: {e}", file=sys.stderr, flush=True)
            client.close()
            continue
        server.settimeout(None)
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        Pair(client, server)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--netns", required=True)
    parser.add_argument("--address", required=True, help="the namespace's own address")
    parser.add_argument("--upstream", required=True, help="host:port in this namespace")
    parser.add_argument("--domain", required=True)
    args = parser.parse_args()
    host, port = args.upstream.rsplit(":", 1)
    upstream = (host, int(port))

    home = os.readlink("/proc/thread-self/ns/net")
    here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    there = os.open(f"/run/netns/{args.netns}", os.O_RDONLY)
    setns(there)
    try:
        listeners = [listen("127.0.0.1", 443), listen(args.address, 443)]
        dns = FakeDns(host=args.address, port=53)
        dns.records[args.domain] = args.address
        dns.records["*." + args.domain] = args.address
    finally:
        setns(here)
    # The upstream connections must be made from here, where the server is.
    assert os.readlink("/proc/thread-self/ns/net") == home

    for listener in listeners:
        threading.Thread(target=relay, args=(listener, upstream), daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
