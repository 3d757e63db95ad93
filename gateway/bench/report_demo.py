#!/usr/bin/env python3
"""The weekly review on a demo run: the gateway binary's demo (simulated providers in process),
three callers for a minute from outside (oha, open loop, each in its own process: acme's
search key at 8 requests a second, acme's nightly key at 4, globex at 1, over its 20 a
minute), then `GET /admin/report` printed as tables.

    python3 gateway/bench/report_demo.py              # a minute
    python3 gateway/bench/report_demo.py --secs 30

Not run in CI: it takes a minute and its figures depend on the machine.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import external  # noqa: E402

BODY = '{"model":"gpt-4o-mini","max_tokens":64,"messages":[{"role":"user","content":"Say something short."}]}'
CALLERS = [("demo-key-acme-search", 8), ("demo-key-acme-reports", 4), ("demo-key-globex", 1)]


def load(url, key, rate, secs):
    return subprocess.Popen(
        ["oha", "-z", f"{secs}s", "-q", str(rate), "-c", "8", "--no-tui",
         "--output-format", "json", "-m", "POST", "-H", f"authorization: Bearer {key}",
         "-H", "content-type: application/json", "-d", BODY, f"{url}/v1/chat/completions"],
        stdout=subprocess.PIPE, text=True,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--secs", type=int, default=60)
    args = parser.parse_args()
    external.ensure_oha()
    gateway_bin, _ = external.build()
    gateway, url = external.start([gateway_bin, "--listen", "127.0.0.1:0"], "gateway listening on ")
    # The demo writes its audit log to stdout: read, so that the pipe never fills.
    threading.Thread(target=lambda: [None for _ in gateway.stdout], daemon=True).start()
    try:
        runs = [load(url, key, rate, args.secs) for key, rate in CALLERS]
        for (key, _), run in zip(CALLERS, runs):
            codes = json.loads(run.communicate()[0]).get("statusCodeDistribution", {})
            print(f"{key}: {codes}")
        request = urllib.request.Request(
            f"{url}/admin/report", headers={"authorization": "Bearer demo-admin-token"})
        review = json.load(urllib.request.urlopen(request, timeout=60))
    finally:
        gateway.terminate()
        gateway.wait()
    print(f"\nreport {review['since']} to {review['until']}\n")
    print("| account | tenant | model | requests | input | output | estimate ÷ used "
          "| queued | local refusals (by scope and limit) | provider 429s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in review["rows"]:
        refusals = ", ".join(f"{k}: {v}" for k, v in r["refusals"].items()) or "0"
        ratio = r["estimate_ratio"] if r["estimate_ratio"] is not None else "-"
        print(f"| {r['account']} | {r['tenant']} | {r['model']} | {r['requests']} | "
              f"{r['input_tokens']} | {r['output_tokens']} | {ratio} | {r['queued_requests']} | "
              f"{refusals} | {r['provider_429s']} |")
    print("\n| account | minutes served | with waiting | limit | capacity | used | idle | idle share |")
    print("|---|---|---|---|---|---|---|---|")
    for a in review["accounts"]:
        for l in a["limits"]:
            print(f"| {a['account']} | {a['minutes_served']} | {a['minutes_with_waiting']} | "
                  f"{l['limit']} | {l['capacity']} | {l['used']} | {l['idle']} | {l['idle_share']} |")


if __name__ == "__main__":
    main()
