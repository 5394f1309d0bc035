"""The two programs of the network-flood tests and benchmark (scripts/bench-netflood.py): a
sink that runs in a network namespace the caller makes and counts what reaches it, and a
flood that runs inside a sandbox and sends to it (or, `download`, reads from it).

The sink takes its port and a state file, which it rewrites every 100 ms as
`<monotonic time> <UDP bytes> <TCP bytes>`. The flood takes `udp|tcp|download`, the sink's
address and port, and how many seconds to run.
"""

SINK = r"""
import os, socket, sys, threading, time
port, state = int(sys.argv[1]), sys.argv[2]
counts = {"udp": 0, "tcp": 0}
lock = threading.Lock()

def add(kind, n):
    with lock:
        counts[kind] += n

def udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    s.bind(("0.0.0.0", port))
    while True:
        add("udp", len(s.recv(65536)))

def serve(c):
    try:
        mode = c.recv(1)
        if mode == b"U":
            while True:
                data = c.recv(1 << 20)
                if not data:
                    break
                add("tcp", len(data))
        elif mode == b"D":
            block = bytes(65536)
            while True:
                c.sendall(block)
    except OSError:
        pass
    finally:
        c.close()

def tcp():
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", port))
    listener.listen(16)
    while True:
        c, _ = listener.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()

threading.Thread(target=udp, daemon=True).start()
threading.Thread(target=tcp, daemon=True).start()
while True:
    with lock:
        line = f"{time.monotonic()} {counts['udp']} {counts['tcp']}\n"
    with open(state + ".tmp", "w") as f:
        f.write(line)
    os.replace(state + ".tmp", state)
    time.sleep(0.1)
"""

# Runs in a sandbox: `udp` and `tcp` send to the sink as fast as they can, `download` reads
# from it and prints what arrived after the first second and over how long.
FLOOD = r"""
import socket, sys, time
kind, host, port, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
start = time.monotonic()
end = start + secs
if kind == "udp":
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect((host, port))
    packet = b"x" * 1400
    while time.monotonic() < end:
        try:
            s.send(packet)
        except OSError:
            pass
elif kind == "tcp":
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(b"U")
    s.settimeout(1)
    block = b"x" * 65536
    while time.monotonic() < end:
        try:
            s.send(block)
        except socket.timeout:
            pass
else:
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(b"D")
    s.settimeout(1)
    got, first = 0, None
    while time.monotonic() < end:
        try:
            n = len(s.recv(1 << 20))
        except socket.timeout:
            continue
        if not n:
            break
        now = time.monotonic()
        if first is None and now >= start + 1:
            first = (now, got)
        got += n
    print(got - first[1], time.monotonic() - first[0])
"""
