#!/usr/bin/env python3
"""The audit log's CPU cost, measured from outside: the gateway binary at 3,000 requests a
second (oha, open loop, in its own process) against the simulator (`--example sim_server`),
with the audit log off and written to a file, in alternating rounds; the gateway's CPU time
(user + system, from /proc) per request in each, and their ratio (target: at most 1.10).

    python3 gateway/bench/audit_cpu.py                  # 3 rounds of 10 s each way
    python3 gateway/bench/audit_cpu.py --rate 3000 --secs 10 --rounds 3
    python3 gateway/bench/audit_cpu.py --against OTHER_BIN   # another build against this one,
                                                             # both with the audit log off

Not run in CI: its figures depend on the machine.
"""

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import external  # noqa: E402


def cpu_seconds(pid):
    """The process's user + system CPU time, in seconds."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf(os.sysconf_names["SC_CLK_TCK"])
    return (int(fields[11]) + int(fields[12])) / ticks


def round_of(gateway_bin, sim_url, audit_log, args, flags=(), extra=""):
    """One run: the gateway's CPU time per request answered, in microseconds, and the run.
    `flags` are more arguments of the binary, `extra` more lines of its configuration."""
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as file:
        file.write(external.config(sim_url, audit_log) + extra)
    gateway, url = external.start(
        [gateway_bin, "--config", file.name, "--listen", "127.0.0.1:0", *flags],
        "gateway listening on ",
    )
    try:
        external.oha(url, external.GATEWAY_KEY, args.rate, 2, args.connections)  # warm-up
        before = cpu_seconds(gateway.pid)
        run = external.oha(url, external.GATEWAY_KEY, args.rate, args.secs, args.connections)
        spent = cpu_seconds(gateway.pid) - before
    finally:
        gateway.terminate()
        gateway.wait()
        os.unlink(file.name)
    requests = run["rps"] * args.secs
    return spent / requests * 1e6, run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=int, default=3000)
    parser.add_argument("--secs", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--against", metavar="BIN",
                        help="compare this gateway binary (first column) with the one built "
                             "here (second), both with the audit log off")
    args = parser.parse_args()

    external.ensure_oha()
    gateway_bin, sim_bin = external.build()
    sim, sim_url = external.start([sim_bin], "simulator listening on ")
    log = tempfile.NamedTemporaryFile(suffix=".log", delete=False).name
    ratios = []
    try:
        if args.against:
            print("| round | the other build: CPU µs a request | this build | ratio | answered (other / this) |")
        else:
            print("| round | audit off: CPU µs a request | audit to a file | ratio | answered (off / on) |")
        print("|---|---|---|---|---|")
        for i in range(args.rounds):
            if args.against:
                off, run_off = round_of(args.against, sim_url, "off", args)
                on, run_on = round_of(gateway_bin, sim_url, "off", args)
            else:
                off, run_off = round_of(gateway_bin, sim_url, "off", args)
                on, run_on = round_of(gateway_bin, sim_url, log, args)
            ratios.append(on / off)
            print(f"| {i + 1} | {off:.1f} | {on:.1f} | {on / off:.3f} | "
                  f"{run_off['ok']:.4f} / {run_on['ok']:.4f} |")
        lines = sum(1 for _ in open(log))
        target = "" if args.against else " (target at most 1.10)"
        print(f"\nmedian ratio {statistics.median(ratios):.3f}{target}; "
              f"{lines} audit lines written")
    finally:
        sim.kill()
        sim.wait()
        os.unlink(log)


if __name__ == "__main__":
    main()
