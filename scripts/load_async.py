#!/usr/bin/env python3
"""load_async.py PORT CONCURRENCY MAX_TOKENS [ROUNDS]: the workload of ../shared/tools/load.py (CONCURRENCY streamed
completions of 64-token prompts, MAX_TOKENS new tokens each, temperature 0) from one asyncio thread instead of one
Python thread per request, so that the client's own start-up does not count as serving time. Each round prints the
aggregate output tokens/s over its wall time, median TTFT and the per-sequence inter-token time, in load.py's format;
ROUNDS (default 1) rounds run one after the other (different prompts each round, so the prefix cache does not serve
them)."""
import asyncio
import json
import sys
import time


async def one(port, i, max_tokens, round_no, out):
    prompt = [1000 + (i * 7 + j + round_no * 131) % 5000 for j in range(64)]
    body = json.dumps({"model": "k3", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    t0 = time.time()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"request {i}: {status.decode().strip()}")
    chunked = False
    while True:  # headers
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
            chunked = True
    first = None
    n = 0
    buf = b""

    async def body_bytes():
        if not chunked:
            while True:
                data = await reader.read(65536)
                if not data:
                    return
                yield data
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)  # CRLF after the chunk
            yield data

    async for data in body_bytes():
        buf += data
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                line = line.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                d = json.loads(line[5:])
                if d.get("usage"):
                    n = d["usage"]["completion_tokens"]
                elif first is None:
                    first = time.time()
    writer.close()
    out.append((first - t0 if first else -1, time.time() - t0, n))


async def round_of(port, conc, max_tokens, round_no):
    res = []
    t0 = time.time()
    await asyncio.gather(*(one(port, i, max_tokens, round_no, res) for i in range(conc)))
    wall = time.time() - t0
    toks = sum(r[2] for r in res)
    ttft = sorted(r[0] for r in res)[len(res) // 2] if res else -1
    itl = sum((r[1] - r[0]) / max(r[2] - 1, 1) for r in res) / max(len(res), 1) * 1000
    print(f"round={round_no} conc={conc} done={len(res)} tokens={toks} wall={wall:.2f}s agg={toks / wall:.1f} tok/s "
          f"median_ttft={ttft:.3f}s per_seq_itl={itl:.2f}ms", flush=True)


def main():
    port, conc, max_tokens = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    for k in range(rounds):
        asyncio.run(round_of(port, conc, max_tokens, k))


if __name__ == "__main__":
    main()
