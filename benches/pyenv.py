"""Shared pieces of the external-tool scripts in benches/: a virtual environment with pinned
packages installed from PyPI by pip, and starting/stopping pdserve servers and clusters.

`ensure(packages)` re-executes the calling script inside `$PDSERVE_HOME/venvs/<name>` (default
`~/.cache/pdserve/venvs/`) after `pip install`ing the pinned requirements there, once; later
runs reuse the environment. Nothing is installed into the system Python.
"""
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def venv_python(requirements, env=None):
    """The Python of a venv holding `requirements` (pinned `name==version`), made and filled by
    pip on first use; `env` adds environment variables to the install (build flags)."""
    key = hashlib.sha256("\n".join(sorted(requirements) + sorted(f"{k}={v}" for k, v in
                                                                   (env or {}).items()))
                         .encode()).hexdigest()[:12]
    home = os.environ.get("PDSERVE_HOME", os.path.expanduser("~/.cache/pdserve"))
    venv = os.path.join(home, "venvs", key)
    python = os.path.join(venv, "bin", "python")
    stamp = os.path.join(venv, ".installed")
    if not os.path.exists(stamp):
        print(f"installing {' '.join(requirements)} into {venv} (pip)", file=sys.stderr,
              flush=True)
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", *requirements], check=True,
                       env={**os.environ, **(env or {})})
        open(stamp, "w").close()
    return python


def ensure(requirements):
    """Run the calling script under a venv holding `requirements` (see `venv_python`)."""
    python = venv_python(requirements)
    if os.path.realpath(sys.prefix) != os.path.realpath(os.path.dirname(os.path.dirname(python))):
        os.execv(python, [python, *sys.argv])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=30):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def wait_up(url, proc, what, tries=1200):
    for _ in range(tries):
        if proc.poll() is not None:
            sys.exit(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.25)
    sys.exit(f"{what} did not come up at {url}")


def pdserve_binary(given=None):
    if given:
        return given
    subprocess.run(["cargo", "build", "--release", "--quiet", "--bin", "pdserve"], cwd=REPO,
                   check=True)
    return os.path.join(REPO, "target", "release", "pdserve")


class Server:
    """A process serving HTTP, stopped with SIGTERM (then SIGKILL after 30 s)."""

    def __init__(self, argv, health, what, log=None, env=None):
        self.what = what
        self.log = open(log, "w") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)
        wait_up(health, self.proc, what)

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def serve(binary, args=(), log=None):
    """`pdserve serve` (colocated) on a free port; returns (server, base URL)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    s = Server([binary, "serve", "--port", str(port), *args], url + "/v1/models",
               "pdserve serve", log)
    return s, url


class Cluster(Server):
    """`pdserve launch` (a proxy plus prefill and decode processes) on a free port; `url` is the
    proxy's, `instances()` the members as `pdserve inspect --json` lists them."""

    def __init__(self, binary, args=(), log=None):
        port = free_port()
        self.binary = binary
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log or f"/tmp/pdserve-launch-{port}.log"
        super().__init__([binary, "launch", "--port", str(port), *args],
                         self.url + "/v1/models", "pdserve launch", self.log_path)
        # The proxy answers before `launch` has printed its inspect line: read until it is.
        m = None
        for _ in range(100):
            m = re.search(r"--credentials-dir (\S+)", open(self.log_path).read())
            if m:
                break
            time.sleep(0.1)
        if not m:
            sys.exit(f"no credentials dir in the output of pdserve launch ({self.log_path})")
        self.credentials = m.group(1)
        # The proxy answers /v1/models before every instance has registered.
        for _ in range(240):
            roles = {i["role"] for i in self.instances() if i.get("routable")}
            if {"prefill", "decode"} <= roles or "colocated" in roles:
                return
            time.sleep(0.25)
        sys.exit("pdserve launch: instances did not register")

    def instances(self):
        out = subprocess.run([self.binary, "inspect", "--json", "--credentials-dir",
                              self.credentials], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)["instances"]

    def url_of(self, role):
        return next(i["url"] for i in self.instances() if i["role"] == role)


def metric(url, name):
    """The sum of every sample of metric `name` (all label sets) at `url`/metrics."""
    total = 0.0
    for line in get(url + "/metrics").splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total
