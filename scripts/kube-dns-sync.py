#!/usr/bin/env python3
"""Cluster DNS records for the test node's dnsmasq, from the API server.

There is no CoreDNS package on Debian; the node runs dnsmasq in a pod with --hostsdir, and this
loop (started by `scripts/kube-cluster start DIR --node`, stopped by `stop DIR`) writes the hosts
file it reads: one A record per Service ClusterIP (NAME.NS.svc.cluster.local), and for headless
Services one per ready endpoint plus HOSTNAME.NAME.NS.svc.cluster.local (StatefulSet pod names).
It lists Services and Endpoints once a second with the admin certificate (no kubectl process
per poll) and replaces the file atomically only when its content changes.

usage: kube-dns-sync.py SERVER PKI_DIR HOSTS_FILE
"""

import json
import os
import ssl
import sys
import time
import urllib.request

DOMAIN = "cluster.local"


def client(pki):
    ctx = ssl.create_default_context(cafile=os.path.join(pki, "ca.crt"))
    ctx.load_cert_chain(os.path.join(pki, "admin.crt"), os.path.join(pki, "admin.key"))
    return ctx


def get(server, ctx, path):
    with urllib.request.urlopen(server + path, context=ctx, timeout=10) as r:
        return json.load(r)["items"]


def records(services, endpoints):
    headless = set()
    lines = set()
    for s in services:
        ns, name = s["metadata"]["namespace"], s["metadata"]["name"]
        ip = s["spec"].get("clusterIP")
        if ip == "None":
            headless.add((ns, name))
        elif ip:
            lines.add(f"{ip} {name}.{ns}.svc.{DOMAIN}")
    for e in endpoints:
        ns, name = e["metadata"]["namespace"], e["metadata"]["name"]
        if (ns, name) not in headless:
            continue
        fq = f"{name}.{ns}.svc.{DOMAIN}"
        for subset in e.get("subsets") or []:
            for a in subset.get("addresses") or []:
                lines.add(f"{a['ip']} {fq}")
                if a.get("hostname"):
                    lines.add(f"{a['ip']} {a['hostname']}.{fq}")
    return "\n".join(sorted(lines)) + "\n"


def main():
    server, pki, out = sys.argv[1:4]
    ctx = client(pki)
    tmp = os.path.join(os.path.dirname(os.path.dirname(out)), "hosts.tmp")
    last = None
    while True:
        try:
            text = records(get(server, ctx, "/api/v1/services"), get(server, ctx, "/api/v1/endpoints"))
        except Exception as e:  # the API server restarting, a timeout: try again next second
            print(f"kube-dns-sync: {e}", file=sys.stderr, flush=True)
            time.sleep(1)
            continue
        if text != last:
            with open(tmp, "w") as f:
                f.write(text)
            os.rename(tmp, out)  # dnsmasq re-reads the file on IN_MOVED_TO
            last = text
        time.sleep(1)


if __name__ == "__main__":
    main()
