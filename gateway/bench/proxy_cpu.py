#!/usr/bin/env python3
"""The gateway's CPU per request against its floor, measured from outside: a bare reverse
proxy on the same hyper and tokio (`bench/bare_proxy.rs`, built as `--example bare_proxy`:
forward, stream back, nothing else), the gateway with its defaults, and the gateway with the audit log, metrics and tracing
each turned off in turn; all in front of the same HTTP upstream (the simulator,
`--example sim_server`), loaded by oha (open loop, in its own process) at 1,000 and 3,000
requests a second, in alternating rounds (every variant once per round). Each run's CPU is
the proxy process's user + system time from /proc, per request answered.

    python3 gateway/bench/proxy_cpu.py                     # 3 rounds of 10 s per variant and rate
    python3 gateway/bench/proxy_cpu.py --secs 5 --rounds 2 --json figures.json

Prints a table per rate: each variant's median µs per request and its ratio to the bare
proxy's (the target: the gateway at most 1.5x). Not run in CI: its figures depend on the
machine.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import external  # noqa: E402
from audit_cpu import cpu_seconds  # noqa: E402


def build():
    subprocess.run(
        ["cargo", "build", "--release", "-p", "tower-llm-quota-gateway",
         "--example", "bare_proxy"],
        cwd=external.ROOT, check=True,
    )
    gateway_bin, sim_bin = external.build()
    return gateway_bin, sim_bin, os.path.join(os.path.dirname(sim_bin), "bare_proxy")


def variants(gateway_bin, bare_bin, sim_url, audit_path):
    """Each variant's command and environment: the bare proxy, then the gateway's."""
    def gateway(name, audit, metrics=True, log="warn"):
        with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as file:
            text = external.config(sim_url, audit)
            if not metrics:
                text = text.replace("[server]\n", "[server]\nmetrics = false\n", 1)
            file.write(text)
        env = dict(os.environ, LLM_QUOTA_GATEWAY_LOG=log)
        command = [gateway_bin, "--config", file.name, "--listen", "127.0.0.1:0",
                   "--state", "memory"]
        return name, command, env, "gateway listening on ", external.GATEWAY_KEY

    return [
        ("bare proxy", [bare_bin, "--listen", "127.0.0.1:0", "--upstream", sim_url],
         dict(os.environ), "bare proxy listening on ", external.SIM_KEY),
        gateway("gateway (defaults)", audit_path),
        gateway("gateway, audit off", "off"),
        gateway("gateway, metrics off", audit_path, metrics=False),
        gateway("gateway, tracing off", audit_path, log="off"),
    ]


def run(variant, rate, args):
    """One run of `variant` at `rate`: its CPU µs per request answered, and oha's figures."""
    name, command, env, prefix, key = variant
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    url = None
    for line in process.stdout:
        if line.startswith(prefix):
            url = line[len(prefix):].split()[0]
            break
    if url is None:
        raise RuntimeError(f"{name} exited before printing its address")
    try:
        external.oha(url, key, rate, 2, args.connections)  # warm-up
        before = cpu_seconds(process.pid)
        figures = external.oha(url, key, rate, args.secs, args.connections)
        spent = cpu_seconds(process.pid) - before
    finally:
        process.terminate()
        process.wait()
    answered = figures["rps"] * args.secs * figures["ok"]
    return {"cpu_us": spent / max(answered, 1) * 1e6, **figures}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--secs", type=int, default=10, help="seconds per oha run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per rate")
    parser.add_argument("--connections", type=int, default=64, help="oha's connections")
    parser.add_argument("--rates", default="1000,3000", help="the rates, comma-separated")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    external.ensure_oha()
    gateway_bin, sim_bin, bare_bin = build()
    sim, sim_url = external.start([sim_bin], "simulator listening on ")
    audit = tempfile.NamedTemporaryFile(suffix=".log", delete=False).name
    figures = {"cores": os.cpu_count(), "load_average": os.getloadavg(), "rates": {}}
    try:
        all_variants = variants(gateway_bin, bare_bin, sim_url, audit)
        for rate in (int(r) for r in args.rates.split(",")):
            runs = {v[0]: [] for v in all_variants}
            for _ in range(args.rounds):
                for variant in all_variants:
                    runs[variant[0]].append(run(variant, rate, args))
            floor = statistics.median(r["cpu_us"] for r in runs["bare proxy"])
            print(f"\n{rate} requests a second ({args.rounds} rounds of {args.secs} s, "
                  f"load average {os.getloadavg()[0]:.1f}):\n")
            print("| variant | CPU µs / request (median; each round) | ÷ bare proxy | answered |")
            print("|---|---|---|---|")
            figures["rates"][rate] = {}
            for name, rounds in runs.items():
                median = statistics.median(r["cpu_us"] for r in rounds)
                each = ", ".join(f"{r['cpu_us']:.0f}" for r in rounds)
                ok = min(r["ok"] for r in rounds)
                print(f"| {name} | {median:.1f} ({each}) | {median / floor:.2f} | "
                      f"{ok * 100:.1f} % |")
                figures["rates"][rate][name] = {
                    "cpu_us_median": median, "ratio": median / floor, "runs": rounds}
    finally:
        sim.terminate()
        os.unlink(audit)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(figures, file, indent=2)


if __name__ == "__main__":
    main()
