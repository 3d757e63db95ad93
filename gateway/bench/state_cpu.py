#!/usr/bin/env python3
"""The SQLite state's CPU cost, measured from outside: the gateway binary at 1,000 requests a
second (oha, open loop, in its own process) against the simulator (`--example sim_server`),
its state in memory (`--state memory`) and in an SQLite file (`--state sqlite:FILE`, the
default beside a configuration file), in alternating rounds; the gateway's CPU time (user +
system, from /proc) per request in each, and their ratio (target: at most 1.10).

The configuration prices the model and gives the caller's tenant a monthly spend cap and a
daily spend alert, so that each request writes what a production gateway's does: the cap's
count (committed before the request is sent), the report's counters and the spend ledger.

    python3 gateway/bench/state_cpu.py                  # 3 rounds of 10 s each way
    python3 gateway/bench/state_cpu.py --rate 1000 --secs 10 --rounds 3

Not run in CI: its figures depend on the machine.
"""

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import external  # noqa: E402
from audit_cpu import round_of  # noqa: E402

# A cap far above the run's spend, and an alert it never reaches.
STATEFUL = """
[prices]
unpriced = "refuse"
[prices.models."gpt-4o-mini"]
input = "0.15"
output = "0.60"
[tenants.nodes."bench"]
caps = [{ dimension = "spend", amount = 1000000000000, window = "calendar_month_utc" }]
[[spend_alerts]]
tenant = "bench"
amount = 1000000000000
window = "calendar_day_utc"
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--secs", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--without", choices=["caps", "alerts", "both"],
                        help="leave the cap, the alert or both out of the configuration "
                             "(to see what each costs)")
    args = parser.parse_args()
    stateful = STATEFUL
    if args.without in ("caps", "both"):
        stateful = stateful.replace("caps = [", "# caps = [")
    if args.without in ("alerts", "both"):
        stateful = stateful.split("[[spend_alerts]]")[0]

    external.ensure_oha()
    gateway_bin, sim_bin = external.build()
    sim, sim_url = external.start([sim_bin], "simulator listening on ")
    folder = tempfile.mkdtemp()
    ratios = []
    try:
        print("| round | memory: CPU µs a request | SQLite | ratio | answered (memory / SQLite) |")
        print("|---|---|---|---|---|")
        for i in range(args.rounds):
            state = f"sqlite:{os.path.join(folder, f'state-{i}.db')}"
            memory, run_memory = round_of(gateway_bin, sim_url, "off", args,
                                          ("--state", "memory"), stateful)
            sqlite, run_sqlite = round_of(gateway_bin, sim_url, "off", args,
                                          ("--state", state), stateful)
            ratios.append(sqlite / memory)
            print(f"| {i + 1} | {memory:.1f} | {sqlite:.1f} | {sqlite / memory:.3f} | "
                  f"{run_memory['ok']:.4f} / {run_sqlite['ok']:.4f} |")
        print(f"\nmedian ratio {statistics.median(ratios):.3f} (target at most 1.10)")
    finally:
        sim.kill()
        sim.wait()
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)


if __name__ == "__main__":
    main()
