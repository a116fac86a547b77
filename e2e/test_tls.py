"""HTTPS through `cleave up --tls-cert/--tls-key` with the official `openai` client trusting a
CA made for the test (trustme, the client's own HTTP stack via openai.DefaultHttpxClient), and mutual TLS with `--tls-client-ca`: plain HTTP to the TLS port
and clients that do not trust the CA are refused; with mTLS a client without a certificate is
refused and one with a certificate from the client CA is served."""

import time

import http.client
import socket
import ssl
import urllib.error
import urllib.request

import openai
import pytest
import trustme

import conftest
from conftest import free_port

PROMPT = [{"role": "user", "content": "Name a colour."}]


def start_up(cleave_bin, port, extra):
    proc, line = conftest.start_up(cleave_bin, port, ["--prefill", "0", "--decode", "1"] + extra)
    assert f"https://127.0.0.1:{port}/v1" in line, line
    return proc


def chat_when_ready(client):
    # `cleave up` does not probe readiness over HTTPS: retry the 503 the router answers until it
    # has seen its decode worker, as a client would.
    name = client.models.list().data[0].id
    deadline = time.time() + 120
    while True:
        try:
            return client.chat.completions.create(
                model=name, messages=PROMPT, max_tokens=8, temperature=0
            )
        except openai.InternalServerError as e:
            if e.status_code != 503 or time.time() > deadline:
                raise
            time.sleep(0.5)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    files = {
        "ca": d / "ca.pem",
        "cert": d / "server.pem",
        "key": d / "server.key",
        "client_ca_file": d / "client-ca.pem",
        "client_cert": d / "client.pem",
    }
    ca.cert_pem.write_to_path(str(files["ca"]))
    server.private_key_pem.write_to_path(str(files["key"]))
    with open(files["cert"], "wb") as f:
        for blob in server.cert_chain_pems:
            f.write(blob.bytes())
    client_ca = trustme.CA()
    client_ca.cert_pem.write_to_path(str(files["client_ca_file"]))
    client = client_ca.issue_cert("client@example.test")
    client.private_key_and_cert_chain_pem.write_to_path(str(files["client_cert"]))
    return {k: str(v) for k, v in files.items()}


def test_https_with_the_openai_client_and_refusals(cleave_bin, pki):
    port = free_port()
    proc = start_up(cleave_bin, port, ["--tls-cert", pki["cert"], "--tls-key", pki["key"]])
    try:
        base = f"https://127.0.0.1:{port}/v1"
        with openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=pki["ca"])) as hc:
            client = openai.OpenAI(base_url=base, api_key="unused", http_client=hc, max_retries=0)
            out = chat_when_ready(client)
            assert out.choices[0].message.content
            assert out.usage.completion_tokens > 0
            # HTTP/2 is offered by ALPN; the client above may speak either. A plain-HTTP request
            # to the TLS port gets no HTTP answer.
        with pytest.raises((urllib.error.URLError, http.client.HTTPException, OSError)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)
        # A client that does not trust the test CA refuses the certificate.
        with openai.DefaultHttpxClient() as untrusting:
            c = openai.OpenAI(base_url=base, api_key="unused", http_client=untrusting, max_retries=0)
            with pytest.raises(openai.APIConnectionError):
                c.models.list()
        # The certificate names 127.0.0.1 and localhost: both verify.
        ctx = ssl.create_default_context(cafile=pki["ca"])
        with urllib.request.urlopen(f"https://localhost:{port}/health", context=ctx, timeout=10) as r:
            assert r.status == 200
    finally:
        conftest.stop_up(proc)


def test_mutual_tls_requires_a_client_certificate(cleave_bin, pki):
    port = free_port()
    proc = start_up(
        cleave_bin,
        port,
        [
            "--tls-cert",
            pki["cert"],
            "--tls-key",
            pki["key"],
            "--tls-client-ca",
            pki["client_ca_file"],
        ],
    )
    try:
        base = f"https://127.0.0.1:{port}/v1"
        with openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=pki["ca"])) as anonymous:
            c = openai.OpenAI(base_url=base, api_key="unused", http_client=anonymous, max_retries=0)
            with pytest.raises(openai.APIConnectionError):
                c.models.list()
        with openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=pki["ca"]), cert=pki["client_cert"]) as hc:
            client = openai.OpenAI(base_url=base, api_key="unused", http_client=hc, max_retries=0)
            out = chat_when_ready(client)
            assert out.choices[0].message.content
    finally:
        conftest.stop_up(proc)


def test_internal_mutual_tls_through_cleave_up(cleave_bin, tmp_path):
    """`cleave up --internal-tls-*` (cert-manager's layout): the router's gRPC to the decode
    worker, the decode worker's to the prefill worker and the KV transfer all run over mutual
    TLS; a disaggregated chat is served, and the workers' gRPC ports answer no plain HTTP/2."""
    ca = trustme.CA()
    peer = ca.issue_cert("127.0.0.1", "localhost")  # trustme: server and client usage
    secret = tmp_path / "internal-tls"
    secret.mkdir()
    ca.cert_pem.write_to_path(str(secret / "ca.crt"))
    peer.private_key_pem.write_to_path(str(secret / "tls.key"))
    with open(secret / "tls.crt", "wb") as f:
        for blob in peer.cert_chain_pems:
            f.write(blob.bytes())
    flags = []
    for flag, name in [("cert", "tls.crt"), ("key", "tls.key"), ("ca", "ca.crt")]:
        flags += [f"--internal-tls-{flag}", str(secret / name)]
    port = free_port()
    log_path = tmp_path / "up.log"
    with open(log_path, "w") as log:
        proc, line = conftest.start_up(
            cleave_bin, port, ["--prefill", "1", "--decode", "1", "--transport", "tcp"] + flags, log
        )
    try:
        assert f"http://127.0.0.1:{port}/v1" in line, line
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        name = client.models.list().data[0].id
        long_prompt = "Summarise the licence terms that follow. " + "Redistribution is permitted. " * 40
        out = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": long_prompt}], max_tokens=8, temperature=0
        )
        assert out.usage.completion_tokens > 0
        workers = {}
        for l in open(log_path):
            # "decode worker 0: grpc 127.0.0.1:N, metrics http://127.0.0.1:M/metrics"
            if " worker 0: grpc " in l:
                role = l.split()[0]
                grpc = l.split("grpc ")[1].split(",")[0]
                workers[role] = (grpc, l.split("metrics ")[1].strip())
        assert set(workers) == {"prefill", "decode"}, open(log_path).read()
        metrics = urllib.request.urlopen(workers["decode"][1], timeout=10).read().decode()
        assert "cleave_worker_disaggregated_requests_total 1" in metrics, metrics
        assert "cleave_worker_prefill_fallbacks_total 0" in metrics, metrics
        # Plain HTTP/2 (gRPC without TLS) to each worker: no SETTINGS frame comes back.
        for grpc, _ in workers.values():
            host, p = grpc.rsplit(":", 1)
            with socket.create_connection((host, int(p)), timeout=10) as s:
                s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
                try:
                    reply = s.recv(64)
                except OSError:
                    reply = b""
            assert not (len(reply) >= 4 and reply[3] == 4), f"{grpc} answered plain HTTP/2: {reply!r}"
    finally:
        conftest.stop_up(proc)
