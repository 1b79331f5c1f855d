"""Run every benchmark of this folder and collect their JSON lines into bench/results.jsonl.

    .venv/bin/python bench/run_all.py                 # everything, full size (~30 min)
    .venv/bin/python bench/run_all.py --quick         # smoke run: smaller sizes, fewer repeats
    .venv/bin/python bench/run_all.py --only checkpoint loop

Each ``bench/bench_*.py`` runs as a subprocess, one after the other (never in parallel: they
time the same CPUs and disk), with its output shown as it comes. With ``--quick`` a bench gets
``--quick`` if it has that option, else ``--repeats 3`` if it has that one. The last line of a
bench's output that is a JSON object with a ``"bench"`` key is its result: it is appended to
the results file with ``run`` (this invocation's id), ``script``, ``args``, ``seconds`` and
the load average before and after. A summary table closes the run; the exit status is 1 if a
bench failed to run (a missed target is not a failure).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def benches() -> list[Path]:
    return sorted(HERE.glob("bench_*.py"))


def options(script: Path) -> set[str]:
    text = script.read_text(encoding="utf-8")
    return {opt for opt in ("--quick", "--repeats") if f'"{opt}"' in text}


def run_one(script: Path, args: list[str], timeout: float) -> tuple[dict[str, Any] | None, float]:
    cmd = [sys.executable, str(script), *args]
    print(f"\n=== {script.name} {' '.join(args)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=HERE.parent)
    result: dict[str, Any] | None = None
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        print(line, end="", flush=True)
        text = line.strip()
        if text.startswith("{"):
            try:
                doc = json.loads(text)
            except ValueError:
                continue
            if isinstance(doc, dict) and "bench" in doc:
                result = doc
        if time.monotonic() > deadline:
            proc.kill()
            print(f"=== {script.name}: killed after {timeout:.0f} s", flush=True)
            break
    code = proc.wait()
    took = time.perf_counter() - t0
    if code != 0:
        print(f"=== {script.name}: exit status {code}", flush=True)
        return None, took
    return result, took


def headline(doc: dict[str, Any]) -> str:
    """A short line of a result's ratios (whatever the bench reports)."""
    parts = []
    for key in ("ratios", "ratio", "unbroken_ratio_1e6_over_10", "thread_over_none"):
        if key in doc:
            parts.append(f"{key}={json.dumps(doc[key])}")
    for section in ("overhead", "throughput"):
        sec = doc.get(section)
        if isinstance(sec, dict):
            for k in ("estimate", "async_over_none_efficiency", "sync_over_none_efficiency"):
                if k in sec:
                    parts.append(f"{section}.{k}={sec[k]}")
    if "better" in doc:
        parts.append(f"better={doc['better']}")
    text = "; ".join(parts)
    return text if len(text) <= 300 else text[:297] + "..."


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="pass --quick (or --repeats 3)")
    p.add_argument("--only", nargs="+", default=None, help="names, e.g. checkpoint loop")
    p.add_argument("--skip", nargs="+", default=[], help="names to leave out")
    p.add_argument("--out", default=str(HERE / "results.jsonl"))
    p.add_argument("--timeout", type=float, default=3600, help="seconds per bench")
    a = p.parse_args()

    def name(s: Path) -> str:
        return s.stem.removeprefix("bench_")

    chosen = [s for s in benches() if (a.only is None or name(s) in a.only)]
    chosen = [s for s in chosen if name(s) not in a.skip]
    if not chosen:
        raise SystemExit(f"no benchmark matches; have {[name(s) for s in benches()]}")
    run_id = time.strftime("%Y%m%dT%H%M%S")
    machine = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    summary: list[tuple[str, float, str, str]] = []
    failed = False
    for script in chosen:
        opts = options(script)
        args: list[str] = []
        if a.quick:
            args = ["--quick"] if "--quick" in opts else (["--repeats", "3"] if opts else [])
        load_before = os.getloadavg()[0]
        doc, took = run_one(script, args, a.timeout)
        load_after = os.getloadavg()[0]
        if doc is None:
            failed = True
            summary.append((script.name, took, "FAILED", ""))
            continue
        record = {
            **doc,
            "run": run_id,
            "script": script.name,
            "args": args,
            "seconds": round(took, 1),
            "run_load_average": [round(load_before, 2), round(load_after, 2)],
            "machine": machine,
        }
        with open(a.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        ok = doc.get("ok")
        if isinstance(ok, dict):
            status = ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in ok.items())
        elif isinstance(ok, bool):
            status = "met" if ok else "MISSED"
        else:
            status = "-"
        summary.append((script.name, took, status, headline(doc)))

    print()
    print(
        f"run {run_id}: {len(chosen)} benchmarks{' (quick)' if a.quick else ''}; results in {a.out}"
    )
    print()
    print("| bench | seconds | targets | figures |")
    print("| --- | ---: | --- | --- |")
    for script_name, took, status, text in summary:
        print(f"| {script_name} | {took:.0f} | {status} | {text} |")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
