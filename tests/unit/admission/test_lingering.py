"""A sender refused while still sending its body gets the answer (CI, stop 52: a slow sender's 408 arrived as
an empty read). The webhook closing at once, with the sender's next bytes unread, made the kernel reset the
connection, and the reset took the 408 with it: 18 of these 40 senders lost it before the staged close."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

from pdfleet_operator.admission import VALIDATE_WEBHOOK_ID, Verdicts, review
from tests.unit.admission.builders import Review, example
from tests.unit.admission.test_pushover import _server
from tests.unit.admission.test_server import _serve


def test_a_sender_still_writing_after_its_408_reads_it(tmp_path: Path) -> None:
    verdicts = Verdicts()
    server = _server(tmp_path, lambda b: review(b, verdicts), body_read_seconds=1)

    async def sender(url: str, ctx: ssl.SSLContext, uid: str, after_s: float) -> bytes:
        host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        body = Review(example("llama-dense")).uid(uid).body()
        reader, writer = await asyncio.open_connection(host, int(port), ssl=ctx, server_hostname=host)
        writer.write(f"POST /{VALIDATE_WEBHOOK_ID} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body) + 1000}\r\n\r\n".encode() + body)
        await writer.drain()
        await asyncio.sleep(after_s)  # around the 1 s body deadline: before, at and after the 408
        answer = b""
        try:
            writer.write(b"  ")
            await writer.drain()
            while chunk := await asyncio.wait_for(reader.read(65536), 5):
                answer += chunk
        except ConnectionError as e:
            answer += f"<{type(e).__name__}>".encode()
        finally:
            writer.close()
        return answer

    async def calls(url: str, _: object) -> list[bytes]:
        ctx = ssl.create_default_context(cafile=str(server.cafile))
        return await asyncio.gather(*[sender(url, ctx, f"u{i}", 1.0 + (i - 20) * 0.002) for i in range(40)])

    answers = asyncio.run(_serve(server, None, calls))
    lost = [a[-60:] for a in answers if b'"code": 408' not in a or b"did not arrive within 1s" not in a]
    assert not lost, f"{len(lost)} of 40 senders lost their answer: {lost[:3]}"
