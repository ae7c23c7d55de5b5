"""Worst /health latency while the server refuses a 50 MB request (issue 12: it used to stall every client for 7 s).

Starts `deltaserve serve` on the default model, polls /health every 10 ms from one thread, and sends a 50 MB
/v1/completions body from another: once with the default --max-request-bytes (413 from the Content-Length alone),
once with a limit that admits it (parsed, then refused as too long for the context without being tokenized).

    .venv/bin/python benchmarks/health_under_large_body.py
"""
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx

BODY = json.dumps({"prompt": "word " * 10_000_000, "max_tokens": 1}).encode()       # 50 MB


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(*flags: str) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "deltaserve", "serve", "--port", str(port), *flags],
                            stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        worst, stop = [0.0], threading.Event()

        def probe() -> None:
            with httpx.Client(timeout=60) as client:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    client.get(f"{url}/health")
                    worst[0] = max(worst[0], time.perf_counter() - t0)
                    time.sleep(0.01)
        thread = threading.Thread(target=probe)
        thread.start()
        time.sleep(0.5)
        t0 = time.perf_counter()
        try:
            status = httpx.post(f"{url}/v1/completions", content=BODY, timeout=120,
                                headers={"Content-Type": "application/json"}).status_code
        except httpx.HTTPError as e:                  # the server answered 413 and closed while we still sent
            status = type(e).__name__
        refused_s = time.perf_counter() - t0
        time.sleep(0.5)
        stop.set()
        thread.join()
        return {"flags": " ".join(flags), "status": status, "request_s": round(refused_s, 3),
                "worst_health_ms": round(worst[0] * 1000, 1)}
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    print(json.dumps(measure(), indent=None))
    print(json.dumps(measure("--max-request-bytes", str(64 << 20)), indent=None))
