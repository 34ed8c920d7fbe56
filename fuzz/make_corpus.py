"""Writes the fuzzers' seed corpus (fuzz/corpus/<target>/) from a real session.

A real server (server.testing.ServerProcess, TCP) and a real client (remote_accel.init in
a subprocess, running a small model's forward and backward passes, a few transfers and a
sync) talk through a recording TCP proxy here; the two byte streams are then cut into
messages with wire.py, and each target gets the parts it parses:

  prologue/    each message's head: a flags byte (prologue_fuzz.c), 8 bytes of msg_len
               (little-endian), then the prologue and the start of the payload
  codec/       each message's meta (codec-encoded fields)
  batch_scan/  the metas of BATCH messages
  frame/       a flags byte (frame_fuzz.c), then DPDK frames (the shim's frame_build) carrying chunks of those messages as
               DATA, and the HELLO / ACK / KEEPALIVE frames of a channel
  handshake/   the first messages each side sent (HELLO, AUTH; CHALLENGE, WELCOME), as
               wire bytes, behind one byte naming the side the fuzzer plays

The two streams are kept too (fuzz/capture/), so that the seeds can be cut again without
a new session: `.venv/bin/python fuzz/make_corpus.py` cuts them from the kept capture,
`... make_corpus.py --record` records a new session first (a minute or so; do that when
the wire format changes). The corpus and the capture are small and kept in the repo.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading

from remote_accel.dataplane import wire
from remote_accel.server.testing import ServerProcess

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")
PER_TARGET = 48  # seeds per target: enough variety, a small repository

CLIENT = textwrap.dedent("""
    import torch, remote_accel
    remote_accel.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).to("remote_accel")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 8).to("remote_accel")
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(step, loss.item())
    y = torch.arange(10, device="remote_accel") * 3
    print(y.cpu(), (y > 5).any().item(), y.float().std().item())
    remote_accel.shutdown()
""")


def _pump(src: socket.socket, dst: socket.socket, log: bytearray) -> None:
    while True:
        data = src.recv(1 << 16)
        if not data:
            dst.shutdown(socket.SHUT_WR)
            return
        log += data
        dst.sendall(data)


def record(server_addr: tuple) -> tuple[bytearray, bytearray]:
    """Runs the client through a proxy; the bytes the client sent and those it got."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    up, down = bytearray(), bytearray()

    def serve() -> None:
        client, _ = listener.accept()
        server = socket.create_connection(server_addr)
        threads = [threading.Thread(target=_pump, args=(client, server, up)),
                   threading.Thread(target=_pump, args=(server, client, down))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    proxy = threading.Thread(target=serve, daemon=True)
    proxy.start()
    env = dict(os.environ, REMOTE_ACCEL_TRANSPORT="tcp", REMOTE_ACCEL_SERVER=f"127.0.0.1:{port}",
               REMOTE_ACCEL_TOKEN="test-token")
    subprocess.run([sys.executable, "-c", CLIENT], env=env, check=True, timeout=300)
    proxy.join(timeout=30)
    return up, down


def messages(stream: bytes) -> list[tuple[int, bytes, bytes]]:
    """(type, whole message, meta) of each message in a byte stream."""
    out, pos = [], 0
    while pos < len(stream):
        header, lengths, meta, used = wire.decode_prologue(stream[pos:])
        end = pos + used + sum(lengths)
        out.append((header.type, bytes(stream[pos:end]), meta))
        pos = end
    return out


def prologue_seed(msg: bytes) -> bytes:
    header = wire.decode_header(msg)
    used = wire.HEADER_SIZE + header.rest_len
    head = msg[:used + min(64, len(msg) - used)]  # a little payload too, as a receive's head holds
    return b"\1" + struct.pack("<Q", len(msg)) + head


def frame_seeds(msgs: list) -> list[bytes]:
    """Frames as the channel builds them (frame_build: the shim's own code for test frames);
    the DPDK ports of a test run (memif, ring) carry them in shared memory, out of a
    capture's sight, so they are made here around the captured messages' chunks."""
    return [flags + frame for frame in _frames(msgs) for flags in (b"\2", b"\1")]


def _frames(msgs: list) -> list[bytes]:
    from remote_accel.dataplane import dpdk_eal  # the shim: only its frame_build is used

    seeds = []
    for i, (_, msg, _) in enumerate(msgs):
        seeds.append(dpdk_eal.build_frame(1, 7, i, msg[:1400]))  # FT_DATA, a message's first chunk
    hello = struct.pack("!IIQ", 1400, 256, 2_000_000_000)  # struct hello_body
    for frame_type, chunk in ((3, hello), (4, hello), (2, b""), (5, b""), (6, b""), (7, b"")):
        seeds.append(dpdk_eal.build_frame(frame_type, 7, 0, chunk))
    return seeds


def save(target: str, seeds: list[bytes]) -> None:
    folder = os.path.join(CORPUS, target)
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):
        os.unlink(os.path.join(folder, name))
    unique = list(dict.fromkeys(seeds))
    # the smallest first, then a spread of the rest: variety within PER_TARGET files
    unique.sort(key=len)
    if len(unique) > PER_TARGET:
        step = len(unique) / PER_TARGET
        unique = [unique[int(i * step)] for i in range(PER_TARGET)]
    for seed in unique:
        with open(os.path.join(folder, hashlib.sha1(seed).hexdigest()[:16]), "wb") as f:
            f.write(seed)
    print(f"{target}: {len(unique)} seeds")


CAPTURE = os.path.join(HERE, "capture")


def main() -> None:
    files = [os.path.join(CAPTURE, name) for name in ("client.bin", "server.bin")]
    if "--record" in sys.argv[1:] or not all(map(os.path.exists, files)):
        with ServerProcess() as server:
            streams = record(server.tcp)
        os.makedirs(CAPTURE, exist_ok=True)
        for path, stream in zip(files, streams):
            with open(path, "wb") as f:
                f.write(stream)
    up, down = (open(path, "rb").read() for path in files)
    sent, got = messages(up), messages(down)
    every = sent + got
    save("prologue", [prologue_seed(msg) for _, msg, _ in every])
    save("codec", [meta for _, _, meta in every])
    save("batch_scan", [meta for t, _, meta in sent if t == wire.MsgType.BATCH])
    save("frame", frame_seeds(every))
    save("handshake", handshake_seeds(sent, got))


def handshake_seeds(sent: list, got: list) -> list[bytes]:
    """The captured HELLO, AUTH (the client's) and CHALLENGE, WELCOME (the server's), as the
    fuzzer's peer sends them: the proofs made again under handshake_fuzz's token and fixed
    nonce (a real session's proofs are under its own nonces), the rest as captured."""
    sys.path.insert(0, HERE)
    from handshake_fuzz import NONCE, TOKEN
    from remote_accel.dataplane import handshake as hs
    from remote_accel.dataplane import messages as msgs

    def as_sent(cls, msg_list) -> tuple:
        for t, msg, meta in msg_list:
            if t == cls.TYPE:
                return msgs.decode(t, meta), wire.decode_header(msg).req_id
        raise LookupError(f"no {cls.__name__} in the capture")

    def encode(value, req_id: int) -> bytes:
        meta = msgs.encode(value)
        return wire.encode_prologue(value.TYPE, meta, [], req_id=req_id)  # meta included

    (hello, hello_id), (auth, auth_id) = as_sent(msgs.Hello, sent), as_sent(msgs.Auth, sent)
    (challenge, ch_id), (welcome, w_id) = as_sent(msgs.Challenge, got), as_sent(msgs.Welcome, got)
    client = encode(hello, hello_id) + encode(msgs.Auth(hs.client_proof(TOKEN, NONCE, hello.nonce)), auth_id)
    server = (encode(challenge, ch_id)
              + encode(dataclasses.replace(welcome, proof=hs.server_proof(TOKEN, NONCE, challenge.nonce)), w_id))
    def records(stream: bytes) -> bytes:  # handshake_fuzz.framed's input for these messages
        out = b""
        for t, _, meta in messages(stream):
            out += bytes([t]) + len(meta).to_bytes(2, "little") + meta
        return out

    # flags byte: bit 0 plays a server against the client's half (else a client against the
    # server's), bit 1 sends records the harness frames (else the stream as it is)
    return [b"\0" + client, b"\1" + server, b"\2" + records(client), b"\3" + records(server),
            b"\0" + client[:len(client) // 2], b"\1" + server[:40]]

if __name__ == "__main__":
    main()
