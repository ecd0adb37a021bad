"""app.ClientLimits on its own, driven as ASGI: a join or call body is read and bounded before the app sees
it (and reaches the app intact), a body that never arrives is refused after its timeout, and joins on their
way into Gradio's queue count against their client without any lock held while a client sends.
test_app_server drives the same middleware through the launched server."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

import app

JOIN = "/gradio_api/queue/join"


class Gradio:
    """Stands in for Gradio's routes: records each body it receives and answers 200, after `gate` opens."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, scope, receive, send) -> None:
        message = await receive()
        self.bodies.append(message["body"])
        await self.gate.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def limits(gradio: Gradio) -> app.ClientLimits:
    blocks = SimpleNamespace(_queue=SimpleNamespace(event_ids_to_events={}),
                             fns={0: SimpleNamespace(api_name="generate_world", api_visibility="public")})
    return app.ClientLimits(gradio, blocks, proxy_hops=1)


async def post(middleware: app.ClientLimits, chunks: list[bytes], headers: dict[str, str] | None = None,
               stall: bool = False) -> tuple[int, dict]:
    """POST a join in `chunks` (then, with `stall`, nothing more) and return the status and JSON answer."""
    sent: list[dict] = []
    pending = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1 or stall}
               for i, c in enumerate(chunks)]

    async def receive() -> dict:
        if pending:
            return pending.pop(0)
        await asyncio.sleep(3600)  # a client that sends nothing more
        raise AssertionError("unreachable")

    async def send(message: dict) -> None:
        sent.append(message)

    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {"type": "http", "method": "POST", "path": JOIN, "client": ("127.0.0.1", 1), "query_string": b"",
             "headers": raw}
    await middleware(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body)


def test_a_body_reaches_the_app_whole_however_it_was_split():
    gradio = Gradio()
    body = json.dumps({"data": [[{"path": "a.bin"}, {"path": "b.bin"}], "Straight"]}).encode()
    status, _ = asyncio.run(post(limits(gradio), [body[:7], body[7:30], body[30:]]))
    assert status == 200 and gradio.bodies == [body]


def test_bodies_past_the_size_or_file_limit_are_refused_unseen():
    gradio = Gradio()
    middleware = limits(gradio)
    status, answer = asyncio.run(post(middleware, [b"{}"], {"Content-Length": str(app.MAX_REQUEST_BODY_BYTES + 1)}))
    assert status == 413 and "at most 256 KB" in answer["detail"]
    big = [b" " * 65536] * (app.MAX_REQUEST_BODY_BYTES // 65536 + 1)  # no Content-Length: counted as it comes
    assert asyncio.run(post(middleware, big))[0] == 413
    refs = json.dumps({"data": [[{"path": f"{i}.bin"} for i in range(app.MAX_FILES_PER_REQUEST + 1)]]}).encode()
    status, answer = asyncio.run(post(middleware, [refs]))
    assert status == 413 and f"lists {app.MAX_FILES_PER_REQUEST + 1} files" in answer["detail"]
    assert gradio.bodies == []


def test_a_body_holding_a_string_past_the_limit_is_refused_unseen():
    """Gradio quotes a refused choice in full, so a long string never reaches it; one at the limit does."""
    gradio = Gradio()
    middleware = limits(gradio)
    long = json.dumps({"data": [3, "urban", "x" * (app.MAX_REQUEST_STRING_CHARS + 1)]}).encode()
    status, answer = asyncio.run(post(middleware, [long]))
    assert status == 413 and "a value of 1,025 characters; at most 1,024" in answer["detail"]
    key = json.dumps({"data": [{"x" * (app.MAX_REQUEST_STRING_CHARS + 1): 1}]}).encode()
    assert asyncio.run(post(middleware, [key]))[0] == 413
    fits = json.dumps({"data": [3, "urban", "x" * app.MAX_REQUEST_STRING_CHARS]}).encode()
    assert asyncio.run(post(middleware, [fits]))[0] == 200 and gradio.bodies == [fits]


def test_a_body_that_never_arrives_is_refused_after_its_timeout(monkeypatch):
    monkeypatch.setattr(app, "REQUEST_BODY_TIMEOUT_S", 0.2)
    status, answer = asyncio.run(post(limits(Gradio()), [b'{"data": ['], stall=True))
    assert status == 408 and "within 0.2 s" in answer["detail"]


def test_joins_on_their_way_in_count_against_their_client_and_free_their_place_when_answered():
    """Gradio adds a join's event to its queue before it answers; until then the middleware counts it, so a
    burst cannot pass between a count and its event, and no lock waits on any client meanwhile."""

    async def scenario() -> tuple[list[int], int, int, int]:
        gradio = Gradio()
        gradio.gate.clear()  # Gradio is slow to answer: every join is in flight
        middleware = limits(gradio)
        me = {"X-Forwarded-For": "10.0.0.1"}
        held = [asyncio.create_task(post(middleware, [b"{}"], me)) for _ in range(app.MAX_QUEUED_PER_CLIENT)]
        stalled = asyncio.create_task(post(middleware, [b"{"], {"X-Forwarded-For": "10.0.0.3"}, stall=True))
        await asyncio.sleep(0.05)
        refused = (await post(middleware, [b"{}"], me))[0]
        other = asyncio.create_task(post(middleware, [b"{}"], {"X-Forwarded-For": "10.0.0.2"}))
        await asyncio.sleep(0.05)
        gradio.gate.set()
        codes = [status for status, _ in await asyncio.gather(*held)]
        later = (await post(middleware, [b"{}"], me))[0]
        stalled.cancel()
        return codes, refused, (await other)[0], later

    codes, refused, other, later = asyncio.run(scenario())
    assert codes == [200] * app.MAX_QUEUED_PER_CLIENT and refused == 429
    assert other == 200, "another client was held up by one whose body never came"
    assert later == 200, "answered joins must free their places"


@pytest.mark.parametrize(("lines", "client"), [
    (["10.0.0.5"], "10.0.0.5"),
    (["spoofed", "10.0.0.5"], "10.0.0.5"),  # a line the client wrote, then the proxy's
    (["spoofed, 10.0.0.5"], "10.0.0.5"),
    ([], "127.0.0.1"),
])
def test_the_client_is_the_last_entry_of_every_forwarded_line_together(lines, client):
    assert limits(Gradio()).client_of(", ".join(lines), "127.0.0.1") == client
