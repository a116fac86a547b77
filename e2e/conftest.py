"""A whole local cleave (router + prefill + decode workers, real processes on loopback, the
real model) started once per test session with `cleave up`."""

import os
import signal
import socket
import subprocess
import time

import pytest

# The node tier has its own conftest and runs on its own (`pytest --confcutdir e2e/node e2e/node`,
# as scripts/test does): collected together, two modules named `conftest` would clash.
collect_ignore = ["node"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def cleave_bin():
    return os.environ.get("CLEAVE_BIN", os.path.join(ROOT, "target", "debug", "cleave"))


def start_up(cleave_bin, port, args, stderr=None):
    """Starts `cleave up --port PORT ARGS...` and returns the process and its "cleave is up" line
    (`stderr`: a file for its log, which names the workers' addresses)."""
    proc = subprocess.Popen(
        [cleave_bin, "up", "--port", str(port)] + args,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"cleave up exited with {proc.returncode}")
        if "cleave is up" in line:
            return proc, line
    proc.kill()
    raise RuntimeError("cleave up did not come up in time")


def stop_up(proc):
    """SIGTERM, as Ctrl-C would; fails the caller if it does not exit within 30 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


@pytest.fixture(scope="session")
def cluster(cleave_bin):
    port = free_port()
    proc, _ = start_up(cleave_bin, port, ["--prefill", "1", "--decode", "2"])
    yield {"base_url": f"http://127.0.0.1:{port}/v1", "port": port, "proc": proc}
    stop_up(proc)


@pytest.fixture()
def client(cluster):
    import openai

    return openai.OpenAI(base_url=cluster["base_url"], api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model_name(cluster):
    import openai

    c = openai.OpenAI(base_url=cluster["base_url"], api_key="unused")
    return c.models.list().data[0].id
