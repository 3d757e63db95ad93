"""The official `openai` and `anthropic` Python SDKs against the gateway.

Run by `tests/gateway/sdk.rs` with the URL of the gateway binary's URL and the demo's keys in the environment
(GATEWAY_URL, SEARCH_KEY, REPORTS_KEY, GLOBEX_KEY, ADMIN_TOKEN), and the upstream's URL
(UPSTREAM_URL, which counts its 429s at `/calls`). Each check prints one line;
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


def upstream_calls():
    """The calls the upstream answered 429 so far."""
    with urllib.request.urlopen(f"{os.environ['UPSTREAM_URL']}/calls") as response:
        return int(response.read())


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


def models():
    ids = [m.id for m in openai_client(SEARCH).models.list()]
    check(
        "openai: models.list() gives the key's models",
        "gpt-4o-mini" in ids and "claude-sonnet" in ids,
        ids,
    )
    ids = [m.id for m in anthropic_client(GLOBEX).models.list()]
    check(
        "anthropic: models.list() gives the key's models, not the others",
        "claude-sonnet" in ids and "gpt-4o" not in ids,
        ids,
    )
    try:
        openai_client(SEARCH).chat.completions.create(
            model="gpt-9-nonexistent", messages=HELLO, max_tokens=20
        )
        raise AssertionError("openai: an unknown model was served")
    except openai.NotFoundError as e:
        check(
            "openai: an unknown model is a NotFoundError, code model_not_found",
            e.code == "model_not_found" and "gpt-9-nonexistent" in str(e),
            e,
        )


def provider_pushback():
    # The provider answers 429 every time: once the gateway's retries give up, the SDK raises
    # its RateLimitError, marked as the provider's, with a Retry-After.
    try:
        openai_client(SEARCH).chat.completions.create(
            model="always-limited", messages=HELLO, max_tokens=20
        )
        raise AssertionError("openai: a provider that always refuses served a request")
    except openai.RateLimitError as e:
        error = e.response.json()["error"]
        check(
            "openai: a provider's 429 is a RateLimitError from the provider, with Retry-After",
            error["gateway_decision"] == "provider"
            and float(e.response.headers.get("retry-after", "0")) > 0,
            error,
        )
    # One logical request, bounded upstream calls: the gateway retried the provider (three
    # attempts for an interactive key) and says `x-should-retry: false`, so an SDK allowed two
    # retries of its own does not multiply them (before: 8 upstream calls).
    before = upstream_calls()
    try:
        openai_client(SEARCH, retries=2).chat.completions.create(
            model="always-limited", messages=HELLO, max_tokens=20
        )
        raise AssertionError("openai: a provider that always refuses served a request")
    except openai.RateLimitError as e:
        calls = upstream_calls() - before
        check(
            "openai: one create with max_retries=2 makes at most 3 upstream calls",
            calls <= 3 and e.response.headers.get("x-should-retry") == "false",
            f"{calls} upstream calls, x-should-retry {e.response.headers.get('x-should-retry')}",
        )
    # The provider cuts a stream after two events: the SDK gets them, then an error, never a
    # silently short answer.
    stream = openai_client(SEARCH).chat.completions.create(
        model="cut-stream", messages=HELLO, max_tokens=20, stream=True
    )
    received = []
    try:
        for chunk in stream:
            received.append(chunk.choices[0].delta.content or "")
        raise AssertionError(f"openai: a cut stream ended cleanly after {received}")
    except (openai.APIError, Exception) as e:  # httpx's RemoteProtocolError, or the SDK's
        if isinstance(e, AssertionError):
            raise
        check(
            "openai: a stream cut by the provider raises after the events sent",
            "".join(received) == "Hello",
            f"{type(e).__name__}: {e}; received {received}",
        )


def more_apis():
    answer = openai_client(SEARCH).embeddings.create(model="embed-model", input=["a cat", "a mat"])
    check(
        "openai: embeddings through the gateway, with usage",
        len(answer.data) == 2 and answer.usage.prompt_tokens == 4,
        repr(answer),
    )
    counted = anthropic_client(SEARCH).messages.count_tokens(
        model="overloaded-claude", messages=HELLO
    )
    check(
        "anthropic: count_tokens through the gateway",
        counted.input_tokens == 12,
        repr(counted),
    )


def overloaded():
    # The provider answers Anthropic's 529 overloaded_error every time: once the gateway's
    # retries give up, the Anthropic SDK raises its OverloadedError (before: a 503, its
    # InternalServerError).
    try:
        anthropic_client(SEARCH).messages.create(
            model="overloaded-claude", messages=HELLO, max_tokens=20
        )
        raise AssertionError("anthropic: an overloaded provider served a request")
    except anthropic.OverloadedError as e:
        check(
            "anthropic: an overloaded provider is an OverloadedError (529), with Retry-After",
            e.status_code == 529 and float(e.response.headers.get("retry-after", "0")) > 0,
            e,
        )


def service_tiers():
    # The caller's service_tier reaches the provider; flex has no capacity (a 429 "Resource
    # Unavailable"), so this interactive key's request falls back at once to the standard
    # tier, and the SDK reads the tier that served it.
    raw = openai_client(SEARCH).chat.completions.with_raw_response.create(
        model="flex-model", messages=HELLO, max_tokens=20, service_tier="flex"
    )
    answer = raw.parse()
    check(
        "openai: flex without capacity falls back to the standard tier, named in the answer",
        answer.service_tier == "default"
        and raw.headers.get("x-llm-quota-fallback") == "tier_unavailable",
        f"{answer.service_tier} {dict(raw.headers)}",
    )


def main():
    print(f"openai {openai.__version__}, anthropic {anthropic.__version__} against {URL}")
    chat_completions()
    messages()
    authentication_errors()
    missing_model()
    models()
    provider_pushback()
    overloaded()
    more_apis()
    service_tiers()
    rate_limits()


if __name__ == "__main__":
    main()
