#!/usr/bin/env python3
"""The gateway's speed, measured from outside: oha (an open-loop HTTP load generator, in its
own process) against the simulated provider called directly and through the gateway binary,
each in its own process, interleaved (direct, gateway, direct, gateway, ...).

    python3 gateway/bench/external.py                 # the whole run (about 10 minutes)
    python3 gateway/bench/external.py --secs 5 --rounds 2 --json figures.json

It installs oha with `cargo install --locked oha` when it is missing, builds the gateway
binary and the simulator (`--example sim_server`) in release mode, and reports:

1. the added latency (gateway minus direct, paired round by round) at p50 and p99 at
   1,000 and 3,000 requests a second (targets: p99 +0.5 ms and +1 ms);
2. the highest rate, in steps of 1,000 a second, whose added p99 (the median of the step's
   pairs) stays within 1 ms with every request answered at the rate asked (target: 5,000 a
   second);
3. 10,000 idle keep-alive connections held by the gateway (each made one request), and the
   gateway's resident memory before and with them.

Open loop: oha sends at the rate asked whatever the answers do, and with
`--latency-correction` counts each request's latency from when it was due, so a stall shows
in the tail instead of slowing the load. Not run in CI: its figures depend on the machine.
"""

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BODY = '{"model":"gpt-4o-mini","max_tokens":20,"messages":[{"role":"user","content":"Hi"}]}'
GATEWAY_KEY = "bench-key"
SIM_KEY = "sim-key"


def ensure_oha():
    if shutil.which("oha") is None:
        print("installing oha (cargo install --locked oha)", file=sys.stderr)
        subprocess.run(["cargo", "install", "--locked", "oha"], check=True)


def build():
    subprocess.run(
        ["cargo", "build", "--release", "-p", "tower-llm-quota-gateway",
         "--bin", "llm-quota-gateway", "--example", "sim_server"],
        cwd=ROOT, check=True,
    )
    meta = json.loads(subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout)
    release = os.path.join(meta["target_directory"], "release")
    return os.path.join(release, "llm-quota-gateway"), os.path.join(release, "examples", "sim_server")


def start(command, prefix):
    """Starts `command`; returns the process and the URL it prints after `prefix`."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    for line in process.stdout:
        if line.startswith(prefix):
            return process, line[len(prefix):].split()[0]
    raise RuntimeError(f"{command[0]} exited before printing its address")


def config(sim_url, audit_log="off"):
    return f"""
[server]
admin_token = "bench"
audit_log = "{audit_log}"
[[accounts]]
name = "sim"
base_url = "{sim_url}"
key = "{SIM_KEY}"
profile = "openai"
apis = ["chat"]
quota = {{ requests_per_minute = 1000000000, tokens_per_minute = 1000000000000 }}
[[keys]]
name = "bench"
key = "{GATEWAY_KEY}"
tenant = "bench"
"""


def oha(url, key, rate, secs, connections):
    """One open-loop run: p50 and p99 in ms, the share answered 200, the rate achieved."""
    out = subprocess.run(
        ["oha", "-z", f"{secs}s", "-q", str(rate), "-c", str(connections),
         "--latency-correction", "--no-tui", "--output-format", "json",
         "-m", "POST", "-H", f"authorization: Bearer {key}",
         "-H", "content-type: application/json", "-d", BODY,
         f"{url}/v1/chat/completions"],
        check=True, capture_output=True, text=True,
    ).stdout
    report = json.loads(out)
    percentiles = report["latencyPercentiles"]
    codes = report.get("statusCodeDistribution", {})
    # Requests still in flight when the run's time is up are cut by oha, not failed.
    errors = {k: v for k, v in report.get("errorDistribution", {}).items()
              if k != "aborted due to deadline"}
    total = sum(codes.values()) + sum(errors.values())
    ok = codes.get("200", 0) / total if total else 0.0
    return {
        "p50": percentiles["p50"] * 1000,
        "p99": percentiles["p99"] * 1000,
        "ok": ok,
        "rps": report["summary"]["requestsPerSec"],
    }


def pairs(direct, gateway, rate, secs, rounds, connections):
    """`rounds` interleaved pairs at `rate`: each pair's direct and gateway figures."""
    runs = []
    for _ in range(rounds):
        a = oha(direct, SIM_KEY, rate, secs, connections)
        b = oha(gateway, GATEWAY_KEY, rate, secs, connections)
        runs.append({"direct": a, "gateway": b,
                     "added_p50": b["p50"] - a["p50"], "added_p99": b["p99"] - a["p99"]})
    return runs


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def idle_connections(url, count, pid):
    """Opens `count` keep-alive connections, one request each, and holds them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, count + 256)), hard))
    host, port = url.removeprefix("http://").split(":")
    request = f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    before = rss_kib(pid)
    sockets = []
    for _ in range(count):
        s = socket.create_connection((host, int(port)))
        s.sendall(request)
        sockets.append(s)
    answered = 0
    for s in sockets:
        s.settimeout(5)
        if s.recv(4096).startswith(b"HTTP/1.1 200"):
            answered += 1
    time.sleep(2)
    held = rss_kib(pid)
    # Still open and served: a second request on every 100th connection.
    again = 0
    for s in sockets[::100]:
        s.sendall(request)
        if s.recv(4096).startswith(b"HTTP/1.1 200"):
            again += 1
    for s in sockets:
        s.close()
    return {"connections": count, "answered": answered, "rss_before_kib": before,
            "rss_with_kib": held, "second_request_ok": f"{again}/{len(sockets[::100])}"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--secs", type=int, default=8, help="seconds per oha run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved pairs per rate")
    parser.add_argument("--connections", type=int, default=64, help="oha's connections")
    parser.add_argument("--idle", type=int, default=10_000, help="idle connections to hold")
    parser.add_argument("--max-rate", type=int, default=10_000, help="the highest rate tried")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    ensure_oha()
    gateway_bin, sim_bin = build()
    sim, sim_url = start([sim_bin], "simulator listening on ")
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as file:
        file.write(config(sim_url))
    gateway, gateway_url = start(
        [gateway_bin, "--config", file.name, "--listen", "127.0.0.1:0"], "gateway listening on ")
    figures = {"cores": os.cpu_count(), "load_average": os.getloadavg()}
    try:
        oha(sim_url, SIM_KEY, 1000, 2, args.connections)  # warm-up
        oha(gateway_url, GATEWAY_KEY, 1000, 2, args.connections)
        print("| rate/s | pair | direct p50 / p99 ms | gateway p50 / p99 ms | added p50 / p99 ms |")
        print("|---|---|---|---|---|")
        figures["targets"] = {}
        for rate in (1000, 3000):
            runs = pairs(sim_url, gateway_url, rate, args.secs, args.rounds, args.connections)
            for i, run in enumerate(runs):
                d, g = run["direct"], run["gateway"]
                print(f"| {rate} | {i + 1} | {d['p50']:.3f} / {d['p99']:.3f} | "
                      f"{g['p50']:.3f} / {g['p99']:.3f} | "
                      f"{run['added_p50']:+.3f} / {run['added_p99']:+.3f} |")
            figures["targets"][rate] = {
                "runs": runs,
                "added_p99_median": statistics.median(r["added_p99"] for r in runs),
            }
        print()
        print("| rate/s | direct p99 ms | gateway p99 ms | added p99 ms (median pair) | answered | achieved/s |")
        print("|---|---|---|---|---|---|")
        highest = None
        figures["ramp"] = []
        for rate in range(1000, args.max_rate + 1, 1000):
            # The median of the step's pairs: one noisy pair does not end the ramp.
            runs = pairs(sim_url, gateway_url, rate, args.secs, args.rounds, args.connections)
            run = sorted(runs, key=lambda r: r["added_p99"])[len(runs) // 2]
            g = run["gateway"]
            answered = min(r["gateway"]["ok"] for r in runs)
            achieved = min(r["gateway"]["rps"] for r in runs)
            kept = run["added_p99"] <= 1.0 and answered == 1.0 and achieved >= 0.97 * rate
            print(f"| {rate} | {run['direct']['p99']:.3f} | {g['p99']:.3f} | "
                  f"{run['added_p99']:+.3f} | {answered:.4f} | {achieved:.0f} |")
            figures["ramp"].append({"rate": rate, "runs": runs})
            if not kept:
                break
            highest = rate
        figures["highest_rate_within_1ms"] = highest
        print(f"\nthe highest rate with an added p99 within 1 ms: {highest}/s")
        idle = idle_connections(gateway_url, args.idle, gateway.pid)
        figures["idle"] = idle
        print(f"\n{idle['connections']} idle keep-alive connections: {idle['answered']} answered, "
              f"a second request on 1 in 100: {idle['second_request_ok']}; gateway RSS "
              f"{idle['rss_before_kib'] / 1024:.1f} MiB before, {idle['rss_with_kib'] / 1024:.1f} MiB with them")
    finally:
        gateway.terminate()
        sim.kill()
        gateway.wait()
        sim.wait()
        os.unlink(file.name)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=1)


if __name__ == "__main__":
    main()
