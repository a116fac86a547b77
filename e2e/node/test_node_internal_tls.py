"""Mutual TLS inside the service, wired by the operator from a Secret in cert-manager's layout
(`spec.internalTls`), on a real node: the router, prefill and decode pods mount the Secret and
speak mTLS to each other (gRPC and the KV transport), the disaggregated answer is the greedy text
`cleave generate` gives, and a worker pod's gRPC port answers no plain HTTP/2."""

import base64
import socket

import openai
import trustme

from nodekit import (LONG_PROMPT, cleave_generate, isvc, metric, metrics_port, pods, ready,
                     router_base_url, scrape)

SERVER_NAME = "cleave-internal.test"


def tls_secret(name):
    ca = trustme.CA()
    peer = ca.issue_cert(SERVER_NAME)  # trustme: server and client usage
    b64 = lambda b: base64.b64encode(b).decode()
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls", "metadata": {"name": name},
        "data": {
            "tls.crt": b64(b"".join(blob.bytes() for blob in peer.cert_chain_pems)),
            "tls.key": b64(peer.private_key_pem.bytes()),
            "ca.crt": b64(ca.cert_pem.bytes()),
        },
    }


def answers_plain_http2(ip, port):
    with socket.create_connection((ip, port), timeout=10) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        try:
            reply = s.recv(64)
        except OSError:
            reply = b""
    return len(reply) >= 4 and reply[3] == 4


def test_internal_mutual_tls_from_a_secret(node, operator, namespace):
    node.apply(tls_secret("internal-tls"), namespace)
    node.apply(isvc("mtls", internalTls={"secretName": "internal-tls", "serverName": SERVER_NAME}), namespace)
    node.wait_for("isvc mtls Ready", lambda: ready(node, namespace, "mtls"), timeout=300)
    for component in ("router", "prefill", "decode"):
        spec = pods(node, namespace, component)[0]["spec"]
        volume = next(v for v in spec["volumes"] if v["name"] == "internal-tls")
        assert volume["secret"]["secretName"] == "internal-tls", volume
    client = openai.OpenAI(base_url=router_base_url(node, namespace, "mtls"), api_key="none", max_retries=0,
                           timeout=120)
    model = node.wait_for("the router", lambda: client.models.list().data[0].id, timeout=60)
    decode = pods(node, namespace, "decode")[0]
    ip, port = decode["status"]["podIP"], metrics_port(decode)
    before = metric(scrape(ip, port), "cleave_worker_disaggregated_requests_total")
    r = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=16, temperature=0)
    assert r.choices[0].text == cleave_generate(LONG_PROMPT, 16)
    body = scrape(ip, port)
    assert metric(body, "cleave_worker_disaggregated_requests_total") == before + 1, body
    assert metric(body, "cleave_worker_prefill_fallbacks_total") == 0, body
    for component in ("prefill", "decode"):
        p = pods(node, namespace, component)[0]
        grpc = next(x["containerPort"] for x in p["spec"]["containers"][0]["ports"] if x["name"] == "grpc")
        assert not answers_plain_http2(p["status"]["podIP"], grpc), f"{component} answered plain HTTP/2"
