#!/usr/bin/env python3
"""Mooncake's transfer engine (PyPI `mooncake-transfer-engine-non-cuda`, `tcp` protocol)
measured the way `pdserve bench transfer` measures pdserve's engine, for a side-by-side table.

Two processes on this host: a target that allocates and registers a buffer, and this
initiator, which writes `size` bytes into it. For each size: `latency_us` is the median time
of one write alone (`transfer_sync_write`); `gbps` is `WINDOW * size` over the median time of
one batch of `WINDOW` writes (`batch_transfer_sync_write`) into disjoint slots of the target
buffer, as pdserve keeps `WINDOW` writes in flight. Repetitions stop after `--max-time` seconds (at least 3). Mooncake finds its peer
through its peer-to-peer handshake (`P2PHANDSHAKE`: no metadata server).

Prints one JSON list of rows like `pdserve bench transfer --json`
(`backend`, `op`, `size_bytes`, `gbps`, `limit_gbps` (null), `latency_us`, `cpu_s_per_gb`:
user + system seconds of both processes per GB over the timed batches).

Needs: `pip install mooncake-transfer-engine-non-cuda` and Debian's `libibverbs1` (the wheel
links libibverbs even for tcp).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WINDOW = 8
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def engine(port_hint: str):
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    rc = e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        sys.exit(f"mooncake initialize failed ({rc}) in the {port_hint}")
    return e


def run_target(size: int) -> None:
    e = engine("target")
    buf = e.allocate_managed_buffer(size)
    if not buf:
        sys.exit("mooncake target could not allocate its buffer")
    print(f"READY 127.0.0.1:{e.get_rpc_port()} {buf}", flush=True)
    sys.stdin.read()  # until the initiator closes our stdin


def process_cpu(pid: int) -> float:
    """User + system seconds process `pid` has used (`/proc/PID/stat`, clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def both_ends_cpu(peer_pid: int) -> float:
    t = os.times()
    return t.user + t.system + process_cpu(peer_pid)


def measure(once, max_time: float, max_iterations: int = 2000, peer_pid=None):
    """Median seconds of `once`; with `peer_pid`, also both ends' CPU seconds per repetition."""
    once()  # warm-up
    cpu0 = both_ends_cpu(peer_pid) if peer_pid else None
    samples = []
    start = time.perf_counter()
    while len(samples) < max_iterations and (len(samples) < 3 or time.perf_counter() - start < max_time):
        t = time.perf_counter()
        once()
        samples.append(time.perf_counter() - t)
    cpu = (both_ends_cpu(peer_pid) - cpu0) / len(samples) if peer_pid else None
    return statistics.median(samples), cpu


def run_initiator(sizes, max_time: float) -> list:
    biggest = max(sizes)
    target = subprocess.Popen(
        [sys.executable, __file__, "--target", str(WINDOW * biggest)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = target.stdout.readline().split()
        if not line or line[0] != "READY":
            sys.exit("mooncake target did not start")
        peer, remote = line[1], int(line[2])
        e = engine("initiator")
        local = e.allocate_managed_buffer(biggest)
        rows = []
        for size in sizes:
            def one():
                if e.transfer_sync_write(peer, local, remote, size) != 0:
                    raise RuntimeError("mooncake write failed")

            def window():
                # Disjoint target slots, as pdserve's bench writes them.
                rc = e.batch_transfer_sync_write(
                    peer,
                    [local] * WINDOW,
                    [remote + i * size for i in range(WINDOW)],
                    [size] * WINDOW,
                )
                if rc != 0:
                    raise RuntimeError("mooncake batch write failed")

            lat, _ = measure(one, max_time / 2)
            thr, cpu = measure(window, max_time, peer_pid=target.pid)
            rows.append(
                {
                    "backend": "mooncake-tcp",
                    "op": "write",
                    "size_bytes": size,
                    "gbps": WINDOW * size / thr / 1e9,
                    "limit_gbps": None,
                    "latency_us": lat * 1e6,
                    "cpu_s_per_gb": cpu / (WINDOW * size / 1e9),
                    "limit_cpu_s_per_gb": None,
                }
            )
        return rows
    finally:
        target.stdin.close()
        target.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--max-time", type=float, default=0.7)
    args = ap.parse_args()
    if args.target:
        run_target(args.target)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    print(json.dumps(run_initiator(sizes, args.max_time)))


if __name__ == "__main__":
    main()
