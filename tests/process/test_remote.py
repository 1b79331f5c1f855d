"""The remote tier against a real S3-protocol server on 127.0.0.1 (tests/_s3server.py).

Uploads commit by their manifest (uploaded last); only checkpoints whose manifest verifies are
listed or loaded; loads read straight into tensors with verified ranged GETs; a run resumes
from the newest checkpoint that verifies in either tier and rebuilds its local directory; the
faults a store has (5xx, a slow or dead server, wrong credentials, a missing bucket, an
unreachable endpoint) end in retries or in an error naming the bucket and the cause -- never
in a fresh start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

import unbroken
from unbroken import CorruptCheckpointError
from unbroken.errors import RemoteStoreError
from unbroken.store import CheckpointStore, Retention
from unbroken.store.remote._bucket import RemoteStore
from unbroken.store.remote._s3 import PART_BYTES

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train(run_dir, remote, steps=4, save_every=2, width=8, **kw):
    """A tiny run, uninterrupted from wherever it resumes; returns (run, model)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = unbroken.Run(
        str(run_dir),
        model=model,
        optimizer=opt,
        save_every=save_every,
        max_steps=steps,
        remote=remote,
        handle_signals=False,
        **kw,
    )
    while not run.done:
        g = torch.Generator().manual_seed(run.counters.step)  # the data of this step
        model(torch.randn(3, width, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        run.step(loss=float(run.counters.step))
    run.finish()
    return run, model


def remote_steps(url):
    return [item.step for item in RemoteStore(url).listing(checksums=False) if item.valid]


def test_checkpoints_upload_manifest_last_and_load_straight_into_tensors(s3, tmp_path):
    run, model = train(tmp_path / "run", s3.url, steps=4, save_every=2)
    assert remote_steps(s3.url) == [4, 2]
    # Every object of a checkpoint was stored before its manifest.
    puts = [p for m, p in s3.proxy.requests(r"^PUT .*step-000000004/") if m == "PUT"]
    assert puts[-1].split("?")[0].endswith("/manifest.json")
    reader = RemoteStore(s3.url).latest(checksums=True)
    assert reader is not None and reader.step == 4
    targets = {
        k: torch.full(i.shape, -1.0, dtype=i.dtype) for k, i in reader.tensor_infos().items()
    }
    reader.load_tensors(targets)
    assert torch.equal(targets["model/weight"], model.weight.detach())
    # The metrics log travels with it: exactly the log as of step 4.
    local = open(tmp_path / "run" / "metrics.jsonl", "rb").read()
    files = reader.manifest["files"]
    assert files["metrics.jsonl"]["size"] == reader.global_trees()["counters"]["metrics_offset"]
    assert files["metrics.jsonl"]["size"] <= len(local)


def test_a_large_tensor_goes_in_parallel_parts_and_ranges(s3, tmp_path):
    width = 2100  # 17.6 MB of float32: more than one part
    _, model = train(tmp_path / "run", s3.url, steps=1, save_every=1, width=width)
    assert width * width * 4 > PART_BYTES
    assert s3.proxy.requests(r"^POST .*uploads"), "no multipart upload was started"
    s3.proxy.reset()
    reader = RemoteStore(s3.url).latest()
    w = torch.empty(width, width)
    reader.load_tensors({"model/weight": w})
    assert torch.equal(w, model.weight.detach())
    ranges = s3.proxy.requests(r"^GET .*tensors-r00000.bin")
    assert len(ranges) >= 2, "one GET for the whole tensor: not split into ranges"


def test_an_empty_run_directory_resumes_from_the_remote_and_rebuilds_it(s3, tmp_path):
    ref, ref_model = train(tmp_path / "ref", None, steps=6, save_every=2)
    train(tmp_path / "a", s3.url, steps=4, save_every=2)
    shutil.rmtree(tmp_path / "a")  # the machine is gone
    run, model = train(tmp_path / "a", s3.url, steps=6, save_every=2)
    assert run.resumed_from == 4
    assert torch.equal(model.weight, ref_model.weight)
    assert unbroken.read_metrics(str(tmp_path / "a")) == unbroken.read_metrics(
        str(tmp_path / "ref")
    )
    assert [i.step for i in CheckpointStore(str(tmp_path / "a")).listing()] == [6, 4]
    assert remote_steps(s3.url)[0] == 6


def test_a_newer_local_checkpoint_wins_and_is_uploaded_at_start(s3, tmp_path):
    train(tmp_path / "run", None, steps=4, save_every=2)  # saved before remote= was set
    assert remote_steps(s3.url) == []
    run, _ = train(tmp_path / "run", s3.url, steps=4, save_every=2)
    assert run.resumed_from == 4
    assert remote_steps(s3.url) == [4]


def test_remote_retention_keeps_its_own_count_and_never_the_uncommitted(s3, tmp_path):
    train(tmp_path / "run", s3.url, steps=8, save_every=1, keep_last=5, remote_keep_last=2)
    # Uploads that fall behind skip to the newest waiting checkpoint, so which older step is
    # kept depends on timing; how many, and that the newest is, does not.
    kept = remote_steps(s3.url)
    assert kept[0] == 8 and len(kept) == 2
    assert sorted(RemoteStore(s3.url).scan()) == sorted(kept)  # nothing else left
    assert [i.step for i in CheckpointStore(str(tmp_path / "run")).listing()] == [8, 7, 6, 5, 4]


def test_a_held_upload_is_not_listed_until_its_manifest_lands(s3, tmp_path):
    s3.proxy.hold(r"^PUT .*step-000000002/manifest.json")
    done = threading.Event()
    threading.Thread(
        target=lambda: (train(tmp_path / "run", s3.url, steps=2, save_every=2), done.set()),
        daemon=True,
    ).start()
    assert s3.proxy.held.wait(60), "the manifest was never uploaded"
    store = RemoteStore(s3.url)
    assert "tensors-r00000.bin" in store.scan()[2]  # the data is there ...
    assert store.listing() == [] and store.latest() is None  # ... but no checkpoint
    s3.proxy.release.set()
    assert done.wait(60)
    assert remote_steps(s3.url) == [2]


def test_injected_5xx_are_retried(s3, tmp_path):
    s3.proxy.fail_next(2, 503, match=r"^PUT .*tensors-r00000.bin")
    s3.proxy.fail_next(2, 500, match=r"^GET .*tensors-r00000.bin")
    _, model = train(tmp_path / "run", s3.url, steps=2, save_every=2)
    reader = RemoteStore(s3.url).latest()
    w = torch.empty(8, 8)
    reader.load_tensors({"model/weight": w})
    assert torch.equal(w, model.weight.detach())
    assert len(s3.proxy.requests(r"^PUT .*step-000000002/tensors-r00000.bin")) == 3
    assert all(times == 0 for _, _, times in s3.proxy.fail), "a fault point was not reached"


def test_5xx_past_the_retries_fail_the_final_upload_loudly(s3, tmp_path):
    s3.proxy.fail_next(1000, 503, match=r"^PUT .*step-000000002/")
    with pytest.raises(RemoteStoreError) as ei:
        train(tmp_path / "run", s3.url, steps=2, save_every=2)
    msg = str(ei.value)
    assert "step 2" in msg and s3.url in msg and "ServiceUnavailable" in msg
    assert os.path.isdir(tmp_path / "run" / "checkpoints" / "step-000000002")  # kept locally
    s3.proxy.reset()  # the store is back: relaunching only uploads
    run, _ = train(tmp_path / "run", s3.url, steps=2, save_every=2)
    assert run.resumed_from == 2 and remote_steps(s3.url) == [2]


FROZEN_SCRIPT = """
import os, sys, time, torch, unbroken
run_dir, url, go = sys.argv[1:4]
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
run = unbroken.Run(run_dir, model=model, save_every=2, max_steps=4, remote=url,
                   remote_finish_timeout=4, handle_signals=False)
while not run.done:
    if run.counters.step == 2:
        assert run._checkpointer.remote.wait(120)  # step 2 is in the store
        print("UPLOADED 2", flush=True)
        while not os.path.exists(go):  # the test freezes the store meanwhile
            time.sleep(0.05)
        t0 = time.monotonic()
    model(torch.randn(3, 8)).pow(2).mean().backward()
    run.step(loss=1.0)
try:
    run.finish()
finally:
    print(f"FINISH {time.monotonic() - t0:.1f}", flush=True)
"""


def test_a_frozen_store_holds_a_finished_run_at_most_remote_finish_timeout(s3, tmp_path):
    """The store accepts connections and never answers (not down: frozen). A finished run
    waits for its final upload at most ``remote_finish_timeout`` (4 s here; botocore's read
    timeout and retries alone would be minutes), then exits non-zero, loudly, with the final
    checkpoint kept locally and the command that uploads it -- which, run once the store is
    back, puts it there. The process exits at once: no request thread holds it."""
    run_dir, go = tmp_path / "run", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen(
        [sys.executable, "-c", FROZEN_SCRIPT, str(run_dir), s3.url, str(go)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "UPLOADED 2", proc.communicate(timeout=60)
    s3.proxy.freeze()
    go.touch()
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=300)
    took = time.monotonic() - t0
    assert proc.returncode == 1, (out, err)
    finish = float(out.split("FINISH ")[1].split()[0])
    assert 4 <= finish < 30 and took < 60, (finish, took, err)  # before: > 400 s
    assert "RemoteStoreError" in err and "did not finish within 4 s" in err, err
    local = run_dir / "checkpoints" / "step-000000004"
    assert f"is committed in {local} but NOT in {s3.url}" in err, err
    assert CheckpointStore(str(run_dir)).latest().step == 4  # kept, valid
    command = err.split("to upload it later (with the metrics log it carries), run:\n  ")[1]
    command = command.split("\n")[0]
    s3.proxy.reset()  # the store answers again
    assert remote_steps(s3.url) == [2]
    done = subprocess.run(command, shell=True, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert remote_steps(s3.url) == [4, 2]
    reader = RemoteStore(s3.url).latest(checksums=True)
    assert reader.manifest["files"]["metrics.jsonl"]["size"] > 0


def test_a_slow_server_still_gets_every_checkpoint(s3, tmp_path):
    s3.proxy.delay = 0.05
    train(tmp_path / "run", s3.url, steps=4, save_every=2)
    assert remote_steps(s3.url) == [4, 2]


def test_the_server_killed_mid_upload(s3, tmp_path):
    """The store dies while a checkpoint uploads, and a new, empty one takes its address: the
    objects stored before are gone, so that upload never becomes a complete checkpoint (its
    manifest lists objects the store does not have); the next checkpoint is complete."""
    s3.proxy.hold(r"^PUT .*step-000000002/tensors-r00000.bin")
    restarted = threading.Event()

    def kill_and_restart():
        assert s3.proxy.held.wait(60)
        s3.server.kill()
        s3.restart_server()
        s3.proxy.drop()  # the request in flight dies with the server; the client retries
        restarted.set()

    threading.Thread(target=kill_and_restart, daemon=True).start()
    train(tmp_path / "run", s3.url, steps=4, save_every=2)
    assert restarted.is_set()
    assert remote_steps(s3.url) == [4]


def test_wrong_credentials_name_the_bucket_and_the_cause(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(RemoteStoreError, match=rf"{s3.bucket}.*SignatureDoesNotMatch"):
        train(tmp_path / "run", s3.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOBODY")
    with pytest.raises(RemoteStoreError, match=r"refused the credentials.*AWS_ACCESS_KEY_ID"):
        train(tmp_path / "run", s3.url)
    assert not os.path.exists(tmp_path / "run" / "checkpoints")  # nothing started


def test_a_missing_bucket_is_named(s3, tmp_path):
    with pytest.raises(RemoteStoreError, match="bucket 'no-such-bucket-here' does not exist"):
        train(tmp_path / "run", "s3://no-such-bucket-here/x")


def test_an_unreachable_remote_is_never_a_fresh_start(s3, tmp_path, monkeypatch):
    train(tmp_path / "run", s3.url, steps=2, save_every=2)
    shutil.rmtree(tmp_path / "run")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    with pytest.raises(RemoteStoreError, match=r"cannot connect to the endpoint.*127\.0\.0\.1:9"):
        train(tmp_path / "run", s3.url, steps=2, save_every=2)
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_a_corrupt_remote_checkpoint_falls_back_to_an_older_one(s3, tmp_path):
    train(tmp_path / "run", s3.url, steps=4, save_every=2)
    shutil.rmtree(tmp_path / "run")
    import boto3

    key = "run/checkpoints/step-000000004/tensors-r00000.bin"
    c = boto3.session.Session().client("s3")
    raw = bytearray(c.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    raw[0] ^= 1
    c.put_object(Bucket=s3.bucket, Key=key, Body=bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="model/weight"):
        reader = RemoteStore(s3.url).open(4)
        reader.load_tensors({"model/weight": torch.empty(8, 8)})
    run = unbroken.Run(
        str(tmp_path / "run"),
        model=torch.nn.Linear(8, 8),
        remote=s3.url,
        allow_missing=("optimizer",),
        allow_unexpected=("optimizer",),
        handle_signals=False,
    )
    assert run.resumed_from == 2
    run.close()


def test_start_over_moves_the_remote_checkpoints_aside(s3, tmp_path):
    train(tmp_path / "run", s3.url, steps=2, save_every=2)
    run, _ = train(tmp_path / "run2", s3.url, steps=1, save_every=1, start_over=True)
    assert run.resumed_from is None
    assert remote_steps(s3.url) == [1]
    moved = [k for k in RemoteStore(s3.url).objects.list_under("") if k.startswith("superseded-")]
    assert any(k.endswith("step-000000002/manifest.json") for k in moved)


def test_resume_false_refuses_a_remote_with_checkpoints(s3, tmp_path):
    train(tmp_path / "run", s3.url, steps=2, save_every=2)
    with pytest.raises(unbroken.ConfigError, match="already holds checkpoints"):
        train(tmp_path / "run2", s3.url, resume=False)


def test_a_bad_url_is_a_config_error(tmp_path):
    for url in ("gs://bucket/x", "s3://B/x", "s3://ok-bucket/a/../b"):
        with pytest.raises(unbroken.ConfigError):
            unbroken.RunConfig(remote=url)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(unbroken.ConfigError, match="remote_finish_timeout"):
            unbroken.RunConfig(remote_finish_timeout=bad)
    assert unbroken.RunConfig().remote_finish_timeout == 120.0
    assert unbroken.RunConfig(remote_finish_timeout=None).remote_finish_timeout is None


def test_retention_keeps_the_newest_complete_when_newer_uploads_are_partial(s3, tmp_path):
    train(tmp_path / "run", s3.url, steps=2, save_every=1, remote_keep_last=1)
    store = RemoteStore(s3.url, Retention(keep_last=1))
    # A newer upload that never committed, and retention asked about it: nothing goes.
    store.objects.put_bytes("checkpoints/step-000000009/tensors-r00000.bin", b"x")
    assert store.apply_retention(9) == []
    assert remote_steps(s3.url) == [2]
    assert store.latest().step == 2


def test_a_killed_multipart_upload_is_aborted_at_the_next_start(s3, tmp_path):
    c = RemoteStore(s3.url).objects.client()
    c.create_multipart_upload(Bucket=s3.bucket, Key="run/checkpoints/step-000000005/x.bin")
    assert c.list_multipart_uploads(Bucket=s3.bucket).get("Uploads")
    time.sleep(1.1)  # begun before this start, at the store's clock resolution
    train(tmp_path / "run", s3.url, steps=1, save_every=1)
    assert not c.list_multipart_uploads(Bucket=s3.bucket).get("Uploads")
