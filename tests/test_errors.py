from __future__ import annotations

import orjson
import pytest

from app import errors


def _shape_ok(body: dict[str, object]) -> dict[str, object]:
    assert set(body) == {"error"}
    err = body["error"]
    assert isinstance(err, dict)
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


@pytest.mark.parametrize(
    ("exc", "status", "type_", "code"),
    [
        (errors.InvalidRequest("bad"), 400, "invalid_request_error", None),
        (errors.PayloadTooLarge("big"), 413, "invalid_request_error", "payload_too_large"),
        (errors.AuthenticationFailed("who"), 401, "authentication_error", "invalid_api_key"),
        (errors.ModelNotFound("m"), 404, "invalid_request_error", "model_not_found"),
        (
            errors.RateLimited("slow", retry_after=3),
            429,
            "rate_limit_exceeded",
            "rate_limit_exceeded",
        ),
        (
            errors.ServiceUnavailable("none", retry_after=2),
            503,
            "service_unavailable",
            "service_unavailable",
        ),
        (errors.UpstreamConnectError("down"), 502, "upstream_error", "upstream_unavailable"),
        (errors.UpstreamTimeout("slow"), 504, "timeout", "upstream_timeout"),
    ],
)
def test_error_body_and_sse_event(
    exc: errors.GatewayError, status: int, type_: str, code: str | None
) -> None:
    assert exc.status == status
    err = _shape_ok(exc.body())
    assert (err["type"], err["code"]) == (type_, code)
    expected = {} if exc.retry_after is None else {"Retry-After": str(exc.retry_after)}
    if status == 401:  # the SDKs read it: a retry with the same key would be refused again
        expected = {"x-should-retry": "false"}
    assert exc.headers() == expected
    sse = exc.to_sse()
    assert sse.startswith(b"data: ") and sse.endswith(b"\n\n")
    assert orjson.loads(sse[len(b"data: ") : -2]) == exc.body()


def test_sglang_error_body_is_rewrapped_with_status_kept() -> None:
    raw = (
        b'{"object":"error","message":"The request queue is full.",'
        b'"type":"Service Unavailable","param":null,"code":503}'
    )
    exc = errors.UpstreamStatusError.from_worker(503, raw)
    assert exc.status == 503
    assert exc.retryable
    err = _shape_ok(exc.body())
    assert err == {
        "message": "The request queue is full.",
        "type": "server_error",
        "param": None,
        "code": "service_unavailable",
    }
    bad = errors.UpstreamStatusError.from_worker(400, b"not json")
    assert bad.status == 400 and not bad.retryable
    assert bad.body()["error"]["type"] == "invalid_request_error"
    assert bad.body()["error"]["code"] is None


@pytest.mark.parametrize(
    ("status", "raw", "type_", "code", "param"),
    [
        (  # SGLang: the status as a number is no code
            400,
            b'{"object":"error","message":"bad top_p","type":"BadRequestError",'
            b'"param":"top_p","code":400}',
            "invalid_request_error",
            None,
            "top_p",
        ),
        (  # SGLang's words for a prompt too long
            400,
            b'{"object":"error","message":"Requested token count exceeds the model\'s maximum '
            b'context length of 8192 tokens.","type":"BadRequestError","param":null,"code":400}',
            "invalid_request_error",
            "context_length_exceeded",
            None,
        ),
        (  # an OpenAI-shaped body keeps its own type and code
            404,
            b'{"error":{"message":"no such model","type":"not_found_error",'
            b'"param":"model","code":"model_not_found"}}',
            "not_found_error",
            "model_not_found",
            "model",
        ),
        (  # a crash: server_error, whatever the worker called it; the status as a string is no code
            500,
            b'{"object":"error","message":"CUDA error","type":"invalid_request_error",'
            b'"param":null,"code":"500"}',
            "server_error",
            None,
            None,
        ),
        (429, b"", "invalid_request_error", "rate_limit_exceeded", None),
        (  # a code that is not a name is dropped
            400,
            b'{"error":{"message":"x","code":"<script>alert(1)</script>"}}',
            "invalid_request_error",
            None,
            None,
        ),
    ],
)
def test_worker_errors_get_openai_type_and_code(
    status: int, raw: bytes, type_: str, code: str | None, param: str | None
) -> None:
    err = _shape_ok(errors.UpstreamStatusError.from_worker(status, raw).body())
    assert (err["type"], err["code"], err["param"]) == (type_, code, param)
