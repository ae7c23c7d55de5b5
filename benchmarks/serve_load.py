"""Load a live `deltaserve serve`: startup to healthy, first-request vs steady latency, and for 1/4/8 concurrent
streaming clients requests/s, median time to first token and inter-token latency (client side).

    python benchmarks/serve_load.py [CHECKPOINT] --dtype bfloat16 --prompt-tokens 256 --max-tokens 32
"""
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from common import bench_checkpoint, parser  # noqa: E402
from server_utils import free_port  # noqa: E402

parser = parser(__doc__)
parser.add_argument("--prompt-tokens", type=int, default=256)
parser.add_argument("--max-tokens", type=int, default=32)
parser.add_argument("--requests-per-client", type=int, default=2)
args = parser.parse_args()
path = bench_checkpoint(args.checkpoint)
port = free_port()
url = f"http://127.0.0.1:{port}"

t0 = time.perf_counter()
proc = subprocess.Popen([sys.executable, "-m", "deltaserve", "serve", str(path), "--dtype", args.dtype,
                         "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
while True:
    try:
        if httpx.get(f"{url}/health", timeout=1).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    if proc.poll() is not None:
        sys.exit("server exited")
    time.sleep(0.2)
startup = time.perf_counter() - t0
seed = iter(range(10**6))


def one_request() -> tuple[float, list[float], float]:
    """(time to first token, inter-token gaps, total) of one streaming completion with a fresh prompt."""
    s = next(seed)
    prompt = [(s * 7919 + i * 104729) % 50000 for i in range(args.prompt_tokens)]
    body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    stamps = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                if json.loads(line[6:])["choices"]:
                    stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - start, gaps, time.perf_counter() - start


try:
    first = one_request()
    steady = [one_request() for _ in range(3)]
    steady_total = statistics.median(s[2] for s in steady)
    print(f"startup to healthy: {startup:.1f} s ({args.dtype})")
    print(f"first request: {first[2] * 1000:.0f} ms, steady median {steady_total * 1000:.0f} ms "
          f"(first/steady = {first[2] / steady_total:.2f}); first TTFT {first[0] * 1000:.0f} ms, "
          f"steady TTFT {statistics.median(s[0] for s in steady) * 1000:.0f} ms")
    for clients in (1, 4, 8):
        results: list = []
        lock = threading.Lock()

        def client(results: list, lock: threading.Lock) -> None:
            for _ in range(args.requests_per_client):
                r = one_request()
                with lock:
                    results.append(r)

        t = time.perf_counter()
        threads = [threading.Thread(target=client, args=(results, lock)) for _ in range(clients)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        elapsed = time.perf_counter() - t
        ttft = statistics.median(r[0] for r in results)
        itl = statistics.median(g for r in results for g in r[1])
        print(f"{clients} clients: {len(results) / elapsed:.2f} req/s, {len(results) * args.max_tokens / elapsed:.1f} "
              f"output tok/s, median TTFT {ttft * 1000:.0f} ms, median ITL {itl * 1000:.1f} ms")
finally:
    proc.terminate()
    proc.wait()
