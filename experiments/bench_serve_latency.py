"""``python -m experiments serve_latency``: latency and throughput of ``vfl serve`` (issue 29), q = 4.

A breast-cancer run (q = 4, one epoch: the model's quality does not matter here) is served as a user
serves it (``vfl serve RUN --port 0``), and a client on the same machine asks over HTTP with keep-alive
(aiohttp's client): first one-row requests one after another (latency p50/p99), then 64 concurrent
clients sending one-row requests (rows/s) for a few seconds, and the same with several rows a request.
The server's ``/health`` counters give the batches formed and the time spent in the federation (the
aggregations), so each latency splits into federation and HTTP/event loop. Client, leader and the
three other parties share this machine's cores, with whatever else runs on it: each row records the
load average and the CPU model.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from experiments._machine import cpu_model

RESULTS = Path(__file__).resolve().parent / "results" / "serve_latency"
ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def train_run(out: Path, q: int, sealed: bool = False) -> None:
    command = [sys.executable, "-m", "vfl.cli", "train", "--out", str(out), "--no-progress", "-n", str(q),
               "-m", "1", "--algorithm", "svrg", "--epochs", "1", "--dataset", "breast-cancer", "--problem",
               "logistic", "--lam", "0.1", "--gamma", "0.02", *(["--secure-channels"] if sealed else [])]
    subprocess.run(command, cwd=ROOT, env=ENV, check=True, capture_output=True)


def ranks_cpu_seconds(run: Path, q: int) -> float:
    """User + system CPU seconds the service's ranks have used so far (Linux /proc)."""
    total = 0
    for rank in range(q):
        pid = (run / "serving" / f"party-{rank}.pid").read_text().strip()
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)
    return total / os.sysconf("SC_CLK_TCK")


def start_service(run: Path, window_ms: float, max_batch: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "vfl.cli", "serve", str(run), "--port", "0", "--window-ms",
                             str(window_ms), "--max-batch", str(max_batch)], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if "listening on" in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
            return proc, line.split("listening on ")[1].split()[0]
    raise RuntimeError("vfl serve ended before listening")


async def sequential(session, url: str, ids: list[int], n: int) -> list[float]:
    times = []
    for k in range(n):
        started = time.perf_counter()
        async with session.post(url + "/score", json={"ids": [ids[k % len(ids)]]}) as response:
            await response.read()
            assert response.status == 200
        times.append(time.perf_counter() - started)
    return times


async def concurrent(session, url: str, ids: list[int], clients: int, rows: int, seconds: float) -> int:
    deadline = time.perf_counter() + seconds
    done = [0]

    async def client(k: int) -> None:
        rng = np.random.default_rng(k)
        while time.perf_counter() < deadline:
            ask = rng.choice(ids, size=rows).tolist()
            async with session.post(url + "/score", json={"ids": ask, "output": "score"}) as response:
                await response.read()
                assert response.status == 200
            done[0] += rows

    await asyncio.gather(*(client(k) for k in range(clients)))
    return done[0]


async def health(session, url: str) -> dict:
    async with session.get(url + "/health") as response:
        return await response.json()


async def measure(url: str, ids: list[int], args, cpu) -> list[dict]:
    import aiohttp

    rows = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.clients)) as session:
        await sequential(session, url, ids, 50)  # warm-up
        before, load = await health(session, url), os.getloadavg()[0]
        before["cpu"] = cpu()
        times = np.array(await sequential(session, url, ids, args.requests)) * 1e3
        after = await health(session, url)
        after["cpu"] = cpu()
        rows.append(_row("one-row requests, one client", 1, 1, len(times), times.sum() / 1e3, before, after,
                         load, p50=np.percentile(times, 50), p99=np.percentile(times, 99)))
        for per_request in args.rows_per_request:
            before, load = await health(session, url), os.getloadavg()[0]
            before["cpu"] = cpu()
            started = time.perf_counter()
            scored = await concurrent(session, url, ids, args.clients, per_request, args.seconds)
            wall = time.perf_counter() - started
            after = await health(session, url)
            after["cpu"] = cpu()
            rows.append(_row(f"{args.clients} concurrent clients", args.clients, per_request, scored, wall,
                             before, after, load))
    return rows


def _row(what: str, clients: int, per_request: int, scored: int, wall: float, before: dict, after: dict,
         load: float, p50: float = float("nan"), p99: float = float("nan")) -> dict:
    batches = max(after["batches"] - before["batches"], 1)
    requests = after["requests"] - before["requests"]
    federation = after["aggregation_seconds"] - before["aggregation_seconds"]
    return {"what": what, "clients": clients, "rows_per_request": per_request, "requests": requests,
            "rows": scored, "seconds": round(wall, 3), "rows_per_s": round(scored / wall, 1),
            "p50_ms": round(float(p50), 3), "p99_ms": round(float(p99), 3), "batches": batches,
            "rows_per_batch": round(requests * per_request / batches, 2),
            "federation_ms_per_batch": round(1e3 * federation / batches, 3),
            "server_cpu_ms_per_request": round(1e3 * (after["cpu"] - before["cpu"]) / max(requests, 1), 3),
            "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2), "cpu": cpu_model()}


FIELDS = ["what", "clients", "rows_per_request", "requests", "rows", "seconds", "rows_per_s", "p50_ms",
          "p99_ms", "batches", "rows_per_batch", "federation_ms_per_batch", "server_cpu_ms_per_request",
          "load_before", "load_after", "cpu"]


def write_outputs(rows: list[dict], out: Path, note: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "results.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    (out / "results.json").write_text(json.dumps({"rows": rows, "note": note}, indent=1) + "\n")
    lines = ["| measure | rows/request | p50 ms | p99 ms | rows/s | rows/batch | federation ms/batch "
             "| server CPU ms/request | load |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['what']} | {r['rows_per_request']} | {_ms(r['p50_ms'])} | {_ms(r['p99_ms'])} | "
              f"{r['rows_per_s']:,.0f} | {r['rows_per_batch']:.1f} | {r['federation_ms_per_batch']:.2f} | "
              f"{r['server_cpu_ms_per_request']:.2f} | {r['load_before']:.2f} / {r['load_after']:.2f} |"
              for r in rows]
    lines += ["", f"CPU: {rows[0]['cpu']}; {note}; written {time.strftime('%Y-%m-%d %H:%M')}."]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    _plot(rows, out)


def _ms(value: float) -> str:
    return "–" if value != value else f"{value:.2f}"  # NaN: not measured in that row


def _plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    labels = [f"{r['clients']} client(s)\n{r['rows_per_request']} row(s)/req" for r in rows]
    ax.bar(labels, [r["rows_per_s"] for r in rows], color="tab:blue")
    ax.axhline(20_000, color="tab:red", linestyle="--", label="goal 20,000 rows/s")
    ax.set_ylabel("rows scored per second")
    ax.set_title(f"vfl serve, q = 4 (p50 one row: {rows[0]['p50_ms']:.2f} ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)
    plt.close(fig)


def _ids() -> list[int]:
    """The ids every party holds: breast-cancer's rows, as the launcher's party files key them."""
    from vertical.datasets import load

    dataset = load("breast-cancer", seed=0)
    return [int(i) for i in np.concatenate([dataset.train_ids, dataset.test_ids])]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments serve_latency", description=__doc__)
    parser.add_argument("--parties", type=int, default=4)
    parser.add_argument("--requests", type=int, default=2000, help="sequential one-row requests (latency)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each throughput run")
    parser.add_argument("--rows-per-request", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--window-ms", type=float, default=1.0)
    parser.add_argument("--max-batch", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="200 requests, 1 s runs")
    parser.add_argument("--secure-channels", action="store_true",
                        help="train the run with --secure-channels, so that the service seals its messages")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.seconds = 200, 1.0
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        train_run(run, args.parties, args.secure_channels)
        ids = _ids()
        proc, url = start_service(run, args.window_ms, args.max_batch)
        try:
            rows = asyncio.run(measure(url, ids, args, lambda: ranks_cpu_seconds(run, args.parties)))
        finally:
            proc.terminate()
            proc.wait(30)
    sealed = ", sealed channels" if args.secure_channels else ""
    note = (f"q = {args.parties}, --window-ms {args.window_ms:g}, --max-batch {args.max_batch}{sealed}; "
            "client and all parties on this shared machine")
    write_outputs(rows, args.out, note)
    for r in rows:
        print({k: r[k] for k in ("what", "rows_per_request", "p50_ms", "p99_ms", "rows_per_s",
                                 "rows_per_batch", "federation_ms_per_batch", "load_before")})
    print(f"results in {args.out}")


if __name__ == "__main__":
    main()
