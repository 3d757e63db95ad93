"""The official `openai` and `anthropic` Python SDKs against the gateway.

Run by `tests/gateway/sdk.rs` with the gateway's URL and the demo's keys in the environment
(GATEWAY_URL, SEARCH_KEY, REPORTS_KEY, GLOBEX_KEY, ADMIN_TOKEN). Each check prints one line;
the first failure raises, and the exit status says so.
"""

import json
import os
import time
import urllib.request

import anthropic
import openai

URL = os.environ["GATEWAY_URL"]
SEARCH = os.environ["SEARCH_KEY"]
REPORTS = os.environ["REPORTS_KEY"]
GLOBEX = os.environ["GLOBEX_KEY"]
ADMIN = os.environ["ADMIN_TOKEN"]

HELLO = [{"role": "user", "content": "Hello there"}]


def check(name, condition, detail=""):
    if not condition:
        raise AssertionError(f"{name}: {detail}")
    print(f"ok   {name}")


def openai_client(key, retries=0):
    return openai.OpenAI(base_url=f"{URL}/v1", api_key=key, max_retries=retries)


def anthropic_client(key, retries=0):
    return anthropic.Anthropic(base_url=URL, api_key=key, max_retries=retries)


def chat_completions():
    client = openai_client(SEARCH)
    answer = client.chat.completions.create(
        model="gpt-4o-mini", messages=HELLO, max_tokens=20
    )
    check(
        "openai: a chat completion, with usage",
        answer.choices[0].message.content and answer.usage.total_tokens > 0,
        repr(answer),
    )
    chunks = list(
        client.chat.completions.create(
            model="gpt-4o-mini",
            messages=HELLO,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check(
        "openai: a streamed chat completion, usage in the last chunk",
        text and chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 0,
        repr(chunks[-1]),
    )


def messages():
    client = anthropic_client(REPORTS)
    answer = client.messages.create(
        model="claude-sonnet", messages=HELLO, max_tokens=20
    )
    check(
        "anthropic: a message, with usage",
        answer.content[0].text and answer.usage.output_tokens > 0,
        repr(answer),
    )
    with client.messages.stream(
        model="claude-sonnet", messages=HELLO, max_tokens=20
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    check(
        "anthropic: a streamed message, usage at its end",
        text and final.usage.output_tokens > 0,
        repr(final),
    )


def authentication_errors():
    try:
        openai_client("not-a-key").chat.completions.create(
            model="gpt-4o-mini", messages=HELLO, max_tokens=20
        )
        raise AssertionError("openai: an unknown key was served")
    except openai.AuthenticationError as e:
        check("openai: an unknown key is an AuthenticationError", e.code == "invalid_api_key", e)
    try:
        anthropic_client("not-a-key").messages.create(
            model="claude-sonnet", messages=HELLO, max_tokens=20
        )
        raise AssertionError("anthropic: an unknown key was served")
    except anthropic.AuthenticationError as e:
        error_type = e.body["error"]["type"]
        check(
            "anthropic: an unknown key is an AuthenticationError",
            error_type == "authentication_error",
            e,
        )


def missing_model():
    try:
        openai_client(SEARCH).chat.completions.create(
            model="", messages=HELLO, max_tokens=20
        )
        raise AssertionError("openai: a request without a model was served")
    except openai.BadRequestError as e:
        check("openai: a request without a model is a BadRequestError", e.status_code == 400, e)


def rate_limits():
    # globex: 20 requests a minute, all at once; the 21st is refused with a Retry-After.
    client = openai_client(GLOBEX)
    for _ in range(20):
        client.chat.completions.create(model="gpt-4o-mini", messages=HELLO, max_tokens=5)
    try:
        client.chat.completions.create(model="gpt-4o-mini", messages=HELLO, max_tokens=5)
        raise AssertionError("openai: the 21st request of a 20-a-minute tenant was served")
    except openai.RateLimitError as e:
        retry_after = e.response.headers.get("retry-after")
        check(
            "openai: a tenant over its limit is a RateLimitError with a Retry-After",
            e.code == "rate_limit_exceeded" and retry_after and float(retry_after) > 0,
            f"{e} (retry-after {retry_after!r})",
        )
    # The SDK's own retry honours that Retry-After, and the call then succeeds.
    started = time.monotonic()
    answer = openai_client(GLOBEX, retries=2).chat.completions.create(
        model="gpt-4o-mini", messages=HELLO, max_tokens=5
    )
    waited = time.monotonic() - started
    check(
        "openai: the SDK's retry waits the Retry-After and succeeds",
        answer.choices[0].message.content and waited >= float(retry_after) * 0.5,
        f"waited {waited:.2f} s for a Retry-After of {retry_after}",
    )
    # acme paused by the admin API: its Messages calls are refused in Anthropic's schema.
    pause = urllib.request.Request(
        f"{URL}/admin/pause",
        data=json.dumps({"tenant": "acme"}).encode(),
        headers={"authorization": f"Bearer {ADMIN}", "content-type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(pause) as response:
        check("admin: acme paused", response.status == 204, response.status)
    try:
        anthropic_client(REPORTS).messages.create(
            model="claude-sonnet", messages=HELLO, max_tokens=20
        )
        raise AssertionError("anthropic: a paused tenant was served")
    except anthropic.RateLimitError as e:
        check(
            "anthropic: a paused tenant is a RateLimitError",
            e.body["type"] == "error" and e.body["error"]["type"] == "rate_limit_error",
            e,
        )


def main():
    print(f"openai {openai.__version__}, anthropic {anthropic.__version__} against {URL}")
    chat_completions()
    messages()
    authentication_errors()
    missing_model()
    rate_limits()


if __name__ == "__main__":
    main()
