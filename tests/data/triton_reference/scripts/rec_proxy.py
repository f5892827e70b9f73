# Minimal HTTP/1.1 recording proxy: listens 18010, forwards to 127.0.0.1:18000, logs the first requests of each path.
import socket, threading, json, collections, sys
LOG = open("/tmp/pa_wire.log", "w")
seen = collections.Counter()
lock = threading.Lock()
def read_msg(f):
    line = f.readline()
    if not line: return None
    hdrs = []
    while True:
        l = f.readline()
        if l in (b"\r\n", b"\n", b""): break
        hdrs.append(l)
    n = 0
    for h in hdrs:
        k, _, v = h.decode().partition(":")
        if k.strip().lower() == "content-length": n = int(v.strip())
    body = f.read(n) if n else b""
    return line, hdrs, body
def handle(c):
    u = socket.create_connection(("127.0.0.1", 18000))
    cf, uf = c.makefile("rb"), u.makefile("rb")
    while True:
        m = read_msg(cf)
        if m is None: break
        line, hdrs, body = m
        u.sendall(line + b"".join(hdrs) + b"\r\n" + body)
        r = read_msg(uf)
        rline, rh, rb = r
        c.sendall(rline + b"".join(rh) + b"\r\n" + rb)
        path = line.split()[1].decode()
        with lock:
            seen[path] += 1
            if seen[path] <= 2:
                LOG.write("=== REQUEST #%d for path\n%s%s\n%r\n--- RESPONSE\n%s%s\n%r\n\n" % (seen[path], line.decode(), b"".join(hdrs).decode(), body[:2000], rline.decode(), b"".join(rh).decode(), rb[:2000]))
                LOG.flush()
    c.close(); u.close()
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", 18010)); s.listen(16)
while True:
    c, _ = s.accept(); threading.Thread(target=handle, args=(c,), daemon=True).start()
