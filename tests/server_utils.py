"""Start a real `deltaserve serve` process on a free local port, and stop it."""
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str, timeout: float = 120, env: dict[str, str] | None = None, **popen):
        """`env`: variables added to this environment; `popen`: more subprocess.Popen arguments. The server's
        stderr goes to a file (a pipe nobody reads would block a server that logs a lot)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        key = args[args.index("--api-key") + 1] if "--api-key" in args else None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "deltaserve", "serve", *args, "--port", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=self.err, env={**os.environ, **(env or {})},
                                     **popen)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.stderr()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError("server did not become healthy")

    def stderr(self) -> str:
        """Everything the server has written to stderr so far."""
        self.err.seek(0)
        return self.err.read().decode(errors="replace")

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics", headers=self.headers).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def stop(self) -> str:
        """Stop the server (SIGTERM, then SIGKILL after 15 s); returns its stderr."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.stderr()
