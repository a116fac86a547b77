"""CI-sized runs of the robustness commands (docs/robustness.md has the full-sized ones and their
output): `cleave soak` with a worker killed every 15 s under mixed traffic must end with every
request finished, KV blocks back to zero and no panic (it exits non-zero otherwise), with the
killed workers restarted by `cleave up --restart-workers`; `cleave bench overload` must run its
three phases and print its verdict lines (its ratios are measurements, not asserted)."""

import re
import subprocess


def test_soak_with_workers_killed(cleave_bin):
    out = subprocess.run(
        [cleave_bin, "soak", "--duration", "45s", "--kill-every", "15s", "--clients", "3",
         "--request-timeout", "60s"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    assert "soak passed" in out.stdout, out.stdout
    kills = re.search(r"\((\d+) kills\)", out.stdout)
    assert kills and int(kills.group(1)) == 2, out.stdout
    assert re.search(r"all\s+\d+", out.stdout), out.stdout
    assert "hang" not in out.stdout.split("all", 1)[1].splitlines()[0], out.stdout


def test_overload_command_runs_its_phases(cleave_bin):
    out = subprocess.run(
        [cleave_bin, "bench", "overload", "--capacity-duration", "5s", "--overload-duration", "10s",
         "--no-progress", "--max-in-flight", "4", "--max-queue", "8", "--input-len", "32",
         "--output-len", "16"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    for phase in ["capacity", "overload", "recovery"]:
        assert re.search(rf"^{phase}\s", out.stdout, re.M), out.stdout
    assert "admitted TTFT p99 under overload" in out.stdout, out.stdout
    assert "recovery vs capacity" in out.stdout, out.stdout
