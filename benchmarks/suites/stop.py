"""How fast a job stops when told, and what its clients get: ``jobs/serve.py`` with streams in flight, or
``jobs/distill.py`` while it trains, is sent SIGINT (to its whole process group, as Ctrl-C in a terminal does) or
SIGTERM (to the job alone, as a service manager does); prints the seconds to exit, its exit status, how each open
stream ended (an error event then ``[DONE]``, or a cut connection) and every line the job printed after the signal.

    python -m benchmarks.suites.stop --job serve --signal SIGINT --streams 4
    python -m benchmarks.suites.stop --job distill --signal SIGTERM --after 90
    python -m benchmarks.suites.stop --job serve --signal SIGTERM --starting 10   # while it is still starting

Extra arguments go to the job (``serve.port=8123`` is set for the endpoint).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

import requests
from transformers import AutoTokenizer

PORT = 8123


def open_streams(count: int, eos: int) -> tuple[list[threading.Thread], dict]:
    """``count`` streamed completions that never end by themselves (EOS biased away); each records how it ended."""
    results: dict[int, tuple[str, str]] = {}
    body = {"prompt": "Question: what is 3+4?\nAnswer:", "max_tokens": 500, "stream": True}
    body["logit_bias"] = {str(eos): -100}

    def stream(i: int) -> None:
        try:
            url = f"http://127.0.0.1:{PORT}/v1/completions"
            with requests.post(url, json=body, stream=True, timeout=60) as r:
                events = [line.decode() for line in r.iter_lines() if line]
            error = any('"error"' in e for e in events[-2:])
            results[i] = ("error event, then [DONE]" if error and events[-1] == "data: [DONE]" else "ended", events[-2])
        except requests.RequestException as exc:
            results[i] = (f"cut ({type(exc).__name__})", "")

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    return threads, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", choices=["serve", "distill"], default="serve")
    parser.add_argument("--signal", choices=["SIGINT", "SIGTERM"], default="SIGINT")
    parser.add_argument("--streams", type=int, default=4, help="streams open at the signal (serve)")
    parser.add_argument("--after", type=float, default=3.0, help="seconds after the job is ready (serve: serving)")
    parser.add_argument(
        "--starting", type=float, help="instead: seconds after the job was launched, ready or not (no streams)"
    )
    args, extra = parser.parse_known_args()
    command = [sys.executable, f"jobs/{args.job}.py", *extra]
    if args.job == "serve":
        command.append(f"serve.port={PORT}")
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[tuple[float, str]] = []
    ready = threading.Event()

    def read() -> None:
        for line in job.stdout:
            lines.append((time.time(), line.rstrip()))
            if args.job == "distill" or line.startswith("serving "):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    start = time.time()
    threads, results = [], {}
    if args.starting is not None:
        if ready.wait(args.starting):
            sys.exit(f"the job was ready within {args.starting:g} s: give a shorter --starting")
        print(f"{args.job} still starting {args.starting:g} s after its launch")
    else:
        if not ready.wait(900):
            job.kill()
            sys.exit("the job did not start within 15 minutes:\n" + "\n".join(line for _, line in lines[-20:]))
        print(f"{args.job} ready in {time.time() - start:.0f} s")
        if args.job == "serve":
            target = next(line.split(None, 1)[1] for _, line in lines if line.startswith("target "))
            threads, results = open_streams(args.streams, AutoTokenizer.from_pretrained(target).eos_token_id)
        time.sleep(args.after)
    sent = time.time()
    sig = getattr(signal, args.signal)
    os.killpg(job.pid, sig) if sig == signal.SIGINT else job.send_signal(sig)
    try:
        job.wait(120)
    except subprocess.TimeoutExpired:
        job.kill()
    took = time.time() - sent
    for t in threads:
        t.join(30)
    print(f"{args.signal}: {args.job} exited with status {job.returncode} in {took:.1f} s")
    for i, (how, _) in sorted(results.items()):
        print(f"  stream {i}: {how}")
    after = [line for t, line in lines if t >= sent]
    print(f"lines after the signal ({len(after)}):")
    for line in after:
        print(f"  {line[:200]}")


if __name__ == "__main__":
    main()
