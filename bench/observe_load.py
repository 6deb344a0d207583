"""`kv-bridge observe` under hostile prefix queries: the event loop's worst
pause, and how long /healthz takes meanwhile (issue 26).

    .venv/bin/python -m bench.observe_load              # 8 clients for 20 s
    .venv/bin/python -m bench.observe_load --smoke      # 2 clients for 3 s

The service runs in this process on a real nats-server, its index holding
three worker ranks of three groups (attention, window, state) over one
65,536-block chain, the longest a query may ask about. A child process runs
`--clients` connections, each sending `hostile_requests()` round robin (the
largest bodies the API takes: 4,194,304 token ids at block size 1, refused;
at block size 64, 65,536 blocks hashed; 65,536-block chains; integers past
64 bits; unknown and unseeded algos; malformed and deeply nested JSON), and a
prober asking /healthz every 100 ms. In this process a monitor task sleeps
1 ms at a time and records how late it wakes: the loop's pauses, which
include the service's own background work (the hybrid refresh, every 15 s).
Results go to stdout as JSON (`--out` to a file too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio

MAX_CHAIN = 65_536  # bridge.apps.fleet.query.MAX_CHAIN


def hostile_requests() -> list[tuple[str, str, str, bytes, int]]:
    """(name, method, path, body, status the service answers)."""
    chain = [(i * 0x9E3779B97F4A7C15) % (1 << 64) for i in range(1, MAX_CHAIN + 1)]
    digits = "[" + ",".join(str(i % 10) for i in range(4_194_304)) + "]"
    return [
        ("tokens-4M-bs1", "POST", "/v1/prefix", f'{{"block_size":1,"token_ids":{digits}}}'.encode(), 400),
        ("tokens-4M-bs64", "POST", "/v1/prefix", f'{{"block_size":64,"token_ids":{digits}}}'.encode(), 200),
        ("chain-65536-int", "POST", "/v1/prefix", json.dumps({"chain": chain}).encode(), 200),
        ("chain-65536-hex", "POST", "/v1/prefix", json.dumps({"chain": [f"{h:064x}" for h in chain]}).encode(), 200),
        ("chain-65537", "POST", "/v1/prefix", json.dumps({"chain": [*chain, 1]}).encode(), 400),
        ("chain-int-past-64-bits", "POST", "/v1/prefix", b'{"chain":[18446744073709551616]}', 400),
        ("chain-million-digits", "POST", "/v1/prefix", b'{"chain":[' + b"9" * 1_000_000 + b"]}", 400),
        ("block-size-past-64-bits", "POST", "/v1/prefix", b'{"token_ids":[1,2],"block_size":18446744073709551616}', 400),
        ("token-id-past-64-bits", "POST", "/v1/prefix", b'{"token_ids":[18446744073709551616],"block_size":1}', 400),
        ("limit-past-64-bits", "POST", "/v1/prefix", b'{"chain":[1],"limit":18446744073709551616}', 400),
        ("xxhash-unseeded", "POST", "/v1/prefix", b'{"token_ids":[1,2],"block_size":1,"algo":"xxhash"}', 400),
        ("xxhash-seeded", "POST", "/v1/prefix", b'{"token_ids":[1,2],"block_size":1,"algo":"xxhash","seed":"0"}', 200),
        ("algo-unknown", "POST", "/v1/prefix", b'{"token_ids":[1,2],"block_size":1,"algo":"md5"}', 400),
        ("nested-100k", "POST", "/v1/prefix", b'{"chain":' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
        ("malformed", "POST", "/v1/prefix", b"{", 400),
        ("not-an-object", "POST", "/v1/prefix", b"[]", 400),
        ("unknown-field", "POST", "/v1/prefix", b'{"chain":[1],"evil":1}', 400),
        ("both", "POST", "/v1/prefix", b'{"chain":[1],"token_ids":[1],"block_size":1}', 400),
        ("get-prefix", "GET", "/v1/prefix", b"", 405),
        ("post-metrics", "POST", "/metrics", b"", 405),
        ("no-such-path", "GET", "/nope", b"", 404),
        ("workers", "GET", "/v1/workers", b"", 200),
    ]


async def http(port: int, method: str, path: str, body: bytes = b"") -> tuple[int, bytes, dict[str, str]]:
    """One HTTP/1.1 request on its own connection: status, body, headers."""
    stream = await anyio.connect_tcp("127.0.0.1", port)
    async with stream:
        await stream.send(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                          + body)
        data = b""
        try:
            while True:
                data += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
    head, _, payload = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split(" ")[1]), payload, headers


# -- the child: clients and a prober -------------------------------------------


async def _clients(port: int, clients: int, seconds: float, rounds: int = 0) -> dict[str, Any]:
    """`clients` connections sending the hostile requests round robin for
    `seconds` (or, with `rounds`, that many times each, in a shuffled order),
    and a /healthz prober every 100 ms until they are done. `wrong` lists
    every answer that was not the documented status, or an error without a
    JSON body."""
    requests = hostile_requests()
    counts: dict[str, int] = {}
    wrong: list[str] = []
    health: list[float] = []
    end = time.monotonic() + seconds
    finished = anyio.Event()

    async def client(k: int) -> None:
        order = list(range(len(requests)))
        random.Random(k).shuffle(order)
        i = 0
        while (i < rounds * len(order)) if rounds else time.monotonic() < end:
            name, method, path, body, want = requests[order[i % len(order)]]
            i += 1
            status, payload, headers = await http(port, method, path, body)
            counts[name] = counts.get(name, 0) + 1
            if status != want:
                wrong.append(f"{name}: {status} {payload[:200]!r}")
            elif status != 200 and (headers.get("content-type") != "application/json"
                                    or "error" not in json.loads(payload)):
                wrong.append(f"{name}: an error without a JSON body: {payload[:200]!r}")

    async def prober() -> None:
        while not finished.is_set():
            t0 = time.perf_counter()
            status, _, _ = await http(port, "GET", "/healthz")
            health.append(time.perf_counter() - t0)
            if status != 200:
                wrong.append(f"healthz: {status}")
            await anyio.sleep(0.1)

    async with anyio.create_task_group() as tg:
        tg.start_soon(prober)
        async with anyio.create_task_group() as load:
            for k in range(clients):
                load.start_soon(client, k)
        finished.set()
    health.sort()
    return {"requests": counts, "answered": sum(counts.values()), "wrong": wrong[:20],
            "healthz_max_s": health[-1] if health else None,
            "healthz_p99_s": health[int(0.99 * (len(health) - 1))] if health else None, "healthz_n": len(health)}


async def run_clients(port: int, clients: int, seconds: float = 0.0, rounds: int = 0) -> dict[str, Any]:
    """`_clients` in a child process (its work off the service's loop): its report."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = await anyio.run_process([sys.executable, "-m", "bench.observe_load", "--client", str(port),
                                    "--clients", str(clients), "--seconds", str(seconds), "--rounds", str(rounds)],
                                   env=env, stderr=subprocess.PIPE, check=True)
    return json.loads(proc.stdout)


# -- the service side ------------------------------------------------------------


def _fill(index: Any) -> None:
    from bridge.contract import SCHEMA_VERSION, BlockHash, BlockStored, GroupMessage, family_of

    chain: list[BlockHash] = [(i * 0x9E3779B97F4A7C15) % (1 << 64) for i in range(1, MAX_CHAIN + 1)]
    kinds = {0: "full_attention", 1: "sliding_window", 2: "mamba"}
    for w in range(3):
        for group, kind in kinds.items():
            hashes = chain if group != 2 else chain[::64]
            ev = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                             medium="GPU", lora_name=None, group_idx=group, kv_cache_spec_kind=kind,
                             kv_cache_spec_sliding_window=1024 if group == 1 else None)
            index.apply(GroupMessage(v=SCHEMA_VERSION, worker=f"bench-{w}", dp_rank=0, epoch=1, seq=group, ts=time.time(),
                                     group=group, kind=kind, family=family_of(kind), kind_source="event",
                                     events=[ev]))


async def _serve_and_measure(clients: int, seconds: float, concurrency: int = 0) -> dict[str, Any]:
    from bridge.apps.fleet import ObserveOptions, ObserveService
    from bridge.client.connection import settings_for
    from bridge.runtime.nats_server import NatsServerProcess

    with NatsServerProcess(jetstream=False) as server:
        extra = {"query_concurrency": concurrency} if concurrency else {}
        service = ObserveService(ObserveOptions(http_host="127.0.0.1", http_port=0, bucket="", bootstrap=None,
                                                **extra))  # type: ignore[arg-type]
        _fill(service.state.index)
        pauses: list[float] = []
        async with anyio.create_task_group() as tg:
            port = await tg.start(service.run, settings_for(server.url))

            async def monitor() -> None:
                while True:
                    t0 = time.perf_counter()
                    await anyio.sleep(0.001)
                    pauses.append(time.perf_counter() - t0 - 0.001)

            tg.start_soon(monitor)
            result = await run_clients(port, clients, seconds)
            tg.cancel_scope.cancel()
        pauses.sort()
        result.update({
            "clients": clients, "seconds": seconds, "query_concurrency": service.opts.query_concurrency,
            "loop_pause_max_ms": round(1000 * pauses[-1], 2),
            "loop_pause_p99_ms": round(1000 * pauses[int(0.99 * (len(pauses) - 1))], 2),
            "loop_pause_p50_ms": round(1000 * pauses[len(pauses) // 2], 2),
            "loop_wakeups": len(pauses),
            "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
        })
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--query-concurrency", type=int, default=0, help="observe's --query-concurrency (its default)")
    parser.add_argument("--smoke", action="store_true", help="2 clients, 3 s")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--client", type=int, default=None, help=argparse.SUPPRESS)  # the child's side
    parser.add_argument("--rounds", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client is not None:
        print(json.dumps(asyncio.run(_clients(args.client, args.clients, args.seconds, args.rounds))))
        return 0
    if args.smoke:
        args.clients, args.seconds = 2, 3.0
    import logging

    import structlog

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
                        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    result = anyio.run(_serve_and_measure, args.clients, args.seconds, args.query_concurrency)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0 if not result["wrong"] else 1


if __name__ == "__main__":
    sys.exit(main())
