"""Worker groups behind the router: `cleave up --tp 3` runs each decode worker as a group of 3
processes (tensor parallel). SIGKILL one follower rank: the group fails fast, requests keep
succeeding on the other group (routed around), `cleave up` restarts the failed group and it
serves again."""

import os
import signal
import sys
import subprocess
import threading
import time

import openai

from conftest import free_port
from test_failures import metric, wait_until


class Up:
    def __init__(self, cleave_bin, *args):
        self.p = subprocess.Popen([cleave_bin, "up", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.err = []
        threading.Thread(target=lambda: [self.err.append(l) for l in self.p.stderr], daemon=True).start()
        deadline = time.time() + 400
        while time.time() < deadline:
            line = self.p.stdout.readline()
            if not line and self.p.poll() is not None:
                raise RuntimeError(f"cleave up exited with {self.p.returncode}: {''.join(self.err[-20:])}")
            if "cleave is up" in line:
                self.base = line.split()[3]
                break
        threading.Thread(target=lambda: [None for _ in self.p.stdout], daemon=True).start()

    def stop(self):
        if sys.exc_info()[0] is not None:
            # Called from a `finally` while a test fails: pytest shows this output with the
            # failure, so the router's and workers' warnings say which path ran.
            print(f"--- the last lines `cleave up` logged:\n{''.join(self.err[-150:])}")
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.p.kill()


def cmdline(pid):
    with open(f"/proc/{pid}/cmdline") as f:
        return f.read().split("\0")


def flag(argv, name):
    return argv[argv.index(name) + 1]


def ranks(up_pid):
    """(rank, group leader address, argv) of every group rank `cleave up` started."""
    out = subprocess.run(["pgrep", "-P", str(up_pid)], capture_output=True, text=True).stdout.split()
    res = []
    for pid in out:
        try:
            argv = cmdline(pid)
        except FileNotFoundError:
            continue
        if "--group-rank" in argv:
            res.append((int(pid), int(flag(argv, "--group-rank")), flag(argv, "--group-leader"), argv))
    return res


def leader_http(up_pid, leader):
    for _, rank, lead, argv in ranks(up_pid):
        if rank == 0 and lead == leader:
            return flag(argv, "--http-addr")
    return None


class Addr:
    def __init__(self, http):
        self.addrs = {"http": http}


def both_groups_healthy(up):
    router = Addr(up.base.removesuffix("/v1").removeprefix("http://"))
    return metric(router, "cleave_router_healthy_decode_workers") == 2


def test_killing_a_rank_fails_its_group_and_requests_go_to_the_other_group(cleave_bin):
    port = free_port()
    up = Up(cleave_bin, "--tp", "3", "--prefill", "0", "--decode", "2", "--policy", "round-robin", "--transport", "tcp", "--kv-blocks", "128", "--port", str(port))
    try:
        client = openai.OpenAI(base_url=up.base, api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id

        def answers():
            try:
                return client.completions.create(model=model, prompt="Warm up", max_tokens=2, temperature=0).usage.completion_tokens == 2
            except openai.APIStatusError:
                return False

        # The router sees both groups healthy once their Watch streams are up: until then
        # round-robin places everything on the first one.
        wait_until(lambda: both_groups_healthy(up), timeout=60, what="the router seeing both groups")
        wait_until(answers, timeout=60, what="the router placing requests")
        for i in range(2):
            r = client.completions.create(model=model, prompt=f"Group request {i}", max_tokens=4, temperature=0)
            assert r.usage.completion_tokens == 4
        victim_pid, _, leader, _ = next(r for r in ranks(up.p.pid) if r[1] == 1)
        victim = Addr(leader_http(up.p.pid, leader))
        assert metric(victim, "cleave_kv_blocks_total") == 128
        os.kill(victim_pid, signal.SIGKILL)
        # Requests keep succeeding while the group is down and while it restarts: one placed on
        # the failed group before the router noticed fails there before its first token (the
        # worker answers UNAVAILABLE, or aborts it) and the router places it again.
        t0 = time.time()
        for i in range(6):
            r = client.completions.create(model=model, prompt=f"During the failure {i}", max_tokens=4, temperature=0)
            assert r.usage.completion_tokens == 4
        assert time.time() - t0 < 60
        wait_until(lambda: any("decode-0 restarted" in l or "decode-1 restarted" in l for l in up.err), timeout=240, what="the group restarted")

        def served_again():
            client.completions.create(model=model, prompt="After the restart", max_tokens=2, temperature=0)
            try:
                return (metric(victim, "cleave_prefix_cache_query_tokens_total") or 0) > 0
            except Exception:
                return False

        # The router reconnects to the restarted leader (same address) and places on it again.
        wait_until(served_again, timeout=120, what="the restarted group serving")
        wait_until(lambda: metric(victim, "cleave_kv_blocks_used") == 0, what="blocks back to 0")
    finally:
        up.stop()


def test_a_group_losing_a_follower_mid_stream_migrates_its_streams(cleave_bin):
    """Two TP=3 decode groups (SmolLM2's 3 KV heads allow TP 1 or 3), round-robin: 4 streams in
    flight (2 per group, each has sent tokens), then SIGKILL a follower of one group. Its streams move to the other group with
    the tokens generated so far and end as uninterrupted runs do."""
    port = free_port()
    up = Up(cleave_bin, "--tp", "3", "--prefill", "0", "--decode", "2", "--policy", "round-robin", "--transport",
            "tcp", "--kv-blocks", "128", "--port", str(port))
    try:
        client = openai.OpenAI(base_url=up.base, api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        def answers():
            try:
                return client.completions.create(model=model, prompt="Warm up", max_tokens=2,
                                                 temperature=0).usage.completion_tokens == 2
            except openai.APIStatusError:
                return False

        # Both groups healthy in the router before the streams start, so round-robin puts 2 on
        # each (with one group unseen, all 4 would land on the other and have nowhere to go).
        wait_until(lambda: both_groups_healthy(up), timeout=60, what="the router seeing both groups")
        wait_until(answers, timeout=60, what="the router placing requests")
        prompts = [f"Chapter {i}. It was a dark and stormy night;" for i in range(4)]
        kw = dict(model=model, max_tokens=128, temperature=0, extra_body={"ignore_eos": True})
        want = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
        streams = [iter(client.completions.create(prompt=p, stream=True, **kw)) for p in prompts]
        texts = [next(s).choices[0].text for s in streams]  # every stream has sent a token
        follower = next(pid for pid, rank, _, _ in ranks(up.p.pid) if rank == 1)
        os.kill(follower, signal.SIGKILL)
        for i, s in enumerate(streams):
            for chunk in s:
                texts[i] += chunk.choices[0].text
        assert texts == want
        router = Addr(up.base.removesuffix("/v1").removeprefix("http://"))
        assert (metric(router, "cleave_router_migrations_total") or 0) >= 1
    finally:
        up.stop()
