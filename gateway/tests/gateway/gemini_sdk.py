"""Google's official Python SDK (`google-genai`) against the gateway.

Run by `tests/gateway/gemini.rs` with GATEWAY_URL, GATEWAY_KEY and CALLS_URL (how many
calls the fake Google upstream behind the model `always-limited` answered). Prints one
`ok <check>` line per check; exits non-zero on the first failure.
"""

import os
import sys
import urllib.request

from google import genai
from google.genai import errors, types

URL = os.environ["GATEWAY_URL"]
KEY = os.environ["GATEWAY_KEY"]


def upstream_calls():
    with urllib.request.urlopen(os.environ["CALLS_URL"]) as response:
        return int(response.read())


def check(name, condition, detail=""):
    if not condition:
        print(f"FAILED {name}: {detail}")
        sys.exit(1)
    print(f"ok {name}")


# The clients are kept: a client closes its connections when it is collected.
CLIENTS = {}


def client(retries=None):
    if retries not in CLIENTS:
        options = types.HttpOptions(base_url=URL, api_version="v1beta")
        if retries is not None:
            options.retry_options = types.HttpRetryOptions(
                attempts=retries, initial_delay=0.1, max_delay=0.5
            )
        CLIENTS[retries] = genai.Client(api_key=KEY, http_options=options)
    return CLIENTS[retries]


def generate():
    answer = client().models.generate_content(
        model="gemini-2.5-flash",
        contents="Hello there",
        config=types.GenerateContentConfig(
            system_instruction="Be brief.", max_output_tokens=32
        ),
    )
    usage = answer.usage_metadata
    check(
        "generate_content: text and usage",
        answer.text and usage.prompt_token_count > 0 and usage.candidates_token_count > 0,
        answer,
    )


def stream():
    chunks = list(
        client().models.generate_content_stream(
            model="gemini-2.5-flash",
            contents="Tell me a story",
            config=types.GenerateContentConfig(max_output_tokens=64),
        )
    )
    text = "".join(chunk.text or "" for chunk in chunks)
    last = chunks[-1]
    check(
        "generate_content_stream: chunks, text, final usage",
        len(chunks) > 1 and text and last.usage_metadata.candidates_token_count > 0,
        chunks,
    )


def count_tokens():
    counted = client().models.count_tokens(model="gemini-2.5-flash", contents="Hello there")
    check("count_tokens", counted.total_tokens > 0, counted)


def embed():
    one = client().models.embed_content(model="text-embedding-004", contents="a cat")
    check("embed_content: one", len(one.embeddings) == 1 and one.embeddings[0].values, one)
    many = client().models.embed_content(model="text-embedding-004", contents=["a", "b", "c"])
    check("embed_content: a batch", len(many.embeddings) == 3, many)


def models():
    names = [m.name for m in client().models.list()]
    check(
        "models.list: the key's models",
        "models/gemini-2.5-flash" in names and "models/always-limited" in names,
        names,
    )
    one = client().models.get(model="gemini-2.5-flash")
    check("models.get", one.name == "models/gemini-2.5-flash", one)


def rate_limits():
    before = upstream_calls()
    try:
        client().models.generate_content(model="always-limited", contents="Hello")
        check("429: ClientError", False, "no error raised")
    except errors.ClientError as e:
        check(
            "429: the SDK's own ClientError, RESOURCE_EXHAUSTED",
            e.code == 429 and e.status == "RESOURCE_EXHAUSTED",
            f"{e.code} {e.status} {e.message}",
        )
    first = upstream_calls() - before
    # The SDK retrying three more times: the model's scope is paused for the provider's
    # retryDelay (30 s), so its retries are refused here without a call upstream.
    before = upstream_calls()
    try:
        client(retries=4).models.generate_content(model="always-limited", contents="Hello")
    except errors.ClientError as e:
        assert e.code == 429, e
    retried = upstream_calls() - before
    check(
        "the SDK's retries do not multiply upstream calls",
        first >= 1 and retried == 0,
        f"first call: {first} upstream calls; four SDK attempts later: {retried}",
    )
    print(f"figures: one create {first} upstream call(s); 4 SDK attempts while paused: {retried}")


def main():
    generate()
    stream()
    count_tokens()
    embed()
    models()
    rate_limits()


if __name__ == "__main__":
    main()
