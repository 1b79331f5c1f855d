"""The device check: unbroken's CUDA paths on one GPU, in one command (<= 8 minutes).

    .venv/bin/python bench/gpu_check.py [--sizes 1 4 16] [--save-gb 4] [--skip-golden]

1. golden: examples/char_lm.py on CUDA (``--device cuda``: deterministic kernels), run
   uninterrupted, and again killed from outside with SIGKILL, then with SIGTERM, and resumed
   to the end; the final weights (model and EMA) must be bitwise equal and the per-step
   losses identical.
2. snapshot blocking time against a raw pinned copy of the same bytes, at each of ``--sizes``
   GB of GPU tensors: a ``copy_(non_blocking=True)`` into preallocated pinned buffers and one
   synchronize (the floor); what an async save blocks for (the D2H issued on a side stream)
   and until those copies are done; an in-memory snapshot into /dev/shm slots (pinned stage,
   memcpy + xxh3 into the slot).
3. save and load GB/s of ``--save-gb`` GB of GPU tensors: unbroken (durable, format 2),
   ``torch.save``/``torch.load``, safetensors, DCP.
4. with several GPUs: DDP over NCCL at every GPU of the machine (tests/scripts/toy_dist.py
   ``--device cuda``), uninterrupted against SIGKILLed at step 6, SIGTERMed at step 9 and
   resumed on the same world size: every tensor and logged step bitwise equal.

Prints one table; the last line is one JSON object. Without CUDA it says so and exits 0
having measured nothing (``"cuda": false``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import unbroken  # noqa: E402
from unbroken.state import Registry  # noqa: E402
from unbroken.store import CheckpointReader, CheckpointStore  # noqa: E402
from unbroken.store._host_buffers import Stage  # noqa: E402
from unbroken.store.snapshot._slots import Slots  # noqa: E402

CHUNK = 256 << 20  # bytes a tensor of the synthetic states


def gpu_state(gb: float) -> dict[str, torch.Tensor]:
    n = max(1, int(gb * 1e9) // CHUNK)
    return {f"t{i:04d}": torch.randn(CHUNK // 4, device="cuda") for i in range(n)}


def timed(fn: Any) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---- 1. golden -------------------------------------------------------------------------------


def _char_lm(run_dir: Path, steps: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    args = ["--run-dir", str(run_dir), "--steps", str(steps), "--save-every", "10"]
    return subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "char_lm.py"), *args, "--device", "cuda"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _steps_logged(run_dir: Path) -> int:
    try:
        with open(run_dir / "metrics.jsonl") as f:
            return sum(1 for line in f if '"step"' in line and '"event"' not in line)
    except OSError:
        return 0


def _interrupt(run_dir: Path, steps: int, at: int, sig: int) -> int:
    proc = _char_lm(run_dir, steps)
    deadline = time.monotonic() + 120
    while _steps_logged(run_dir) < at and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if proc.poll() is None:
        proc.send_signal(sig)
    proc.communicate(timeout=120)
    return proc.returncode


def golden(root: Path, steps: int = 40) -> dict[str, Any]:
    from safetensors.torch import load_file

    ref, cut = root / "ref", root / "cut"
    p = _char_lm(ref, steps)
    out, err = p.communicate(timeout=240)
    if p.returncode != 0:
        return {"ok": False, "error": f"uninterrupted run exited {p.returncode}: {err[-500:]}"}
    codes = [
        _interrupt(cut, steps, 15, signal.SIGKILL),
        _interrupt(cut, steps, 27, signal.SIGTERM),
    ]
    p = _char_lm(cut, steps)
    p.communicate(timeout=240)
    codes.append(p.returncode)
    a, b = load_file(ref / "final.safetensors"), load_file(cut / "final.safetensors")
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = [json.loads(line)["loss"] for line in open(ref / "trace.jsonl")]
    cut_losses = [json.loads(line)["loss"] for line in open(cut / "trace.jsonl")]
    return {
        "ok": same and losses == cut_losses and codes[-1] == 0,
        "exit_codes": codes,
        "tensors_equal": same,
        "losses_equal": losses == cut_losses,
        "steps": len(losses),
    }


# ---- 2. snapshot blocking --------------------------------------------------------------------


def snapshot(gb: float, shm: str) -> dict[str, float]:
    state = gpu_state(gb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    pinned = {k: torch.empty_like(v, device="cpu", pin_memory=True) for k, v in state.items()}

    def raw() -> None:
        for k, v in state.items():
            pinned[k].copy_(v, non_blocking=True)
        torch.cuda.synchronize()

    stage = Stage()
    names, tensors = list(state), list(state.values())
    stage.copy(names, tensors).wait()  # buffers allocated (pinned) outside the clock
    raw()
    out: dict[str, float] = {"bytes": nbytes, "raw_pinned_s": min(timed(raw) for _ in range(3))}
    issued, done = [], []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        staged = stage.copy(names, tensors)
        issued.append(time.perf_counter() - t0)
        staged.wait()
        done.append(time.perf_counter() - t0)
    out["async_blocking_s"], out["async_done_s"] = min(issued), min(done)
    area = tempfile.mkdtemp(prefix="unbroken-gpucheck-", dir=shm)
    try:
        slots = Slots(area)
        items = list(state.items())
        times = []
        for i in range(3):
            path = os.path.join(area, f"snap-{i}.bin")
            times.append(timed(lambda p=path: slots.write_chunks(p, items)))
            slots.committed()
            os.unlink(path)
        out["shm_snapshot_s"] = min(times)
        slots.close()
    finally:
        shutil.rmtree(area, ignore_errors=True)
    state.clear()
    pinned.clear()
    torch.cuda.empty_cache()
    return out


# ---- 3. save and load ------------------------------------------------------------------------


def save_load(gb: float, root: Path) -> dict[str, dict[str, float]]:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file

    state = gpu_state(gb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    module = torch.nn.Module()
    for k, v in state.items():
        module.register_buffer(k, v)
    reg = Registry()
    reg.add("model", module)
    res: dict[str, dict[str, float]] = {}

    def fresh(name: str) -> Path:
        d = root / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        return d

    def unbroken_save() -> None:
        CheckpointStore(str(fresh("ub"))).save(1, reg.collect(), {"epoch": 0, "samples": 0})

    def unbroken_load() -> None:
        reader = CheckpointReader(str(root / "ub" / "checkpoints" / "step-000000001"))
        reader.verify(checksums=True, data=False)
        trees = {**reader.global_trees(), **(reader.local_trees(0) or {})}
        names = reg.check_names(trees)
        targets = reg.plan(names, trees, reader.tensor_infos())
        reader.load_tensors(targets, verify=True)
        reg.restore(names, trees, targets)

    def fsynced(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def torch_save() -> None:
        path = fresh("pt") / "s.pt"
        torch.save(state, path)
        fsynced(path)

    def torch_load() -> None:
        got = torch.load(root / "pt" / "s.pt", map_location="cuda", weights_only=True)
        for k, v in got.items():
            state[k].copy_(v)

    def st_save() -> None:
        path = fresh("st") / "s.safetensors"
        save_file(state, str(path))
        fsynced(path)

    def st_load() -> None:
        for k, v in load_file(str(root / "st" / "s.safetensors"), device="cuda").items():
            state[k].copy_(v)

    def dcp_save() -> None:
        d = fresh("dcp")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(d)), no_dist=True)

    def dcp_load() -> None:
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(root / "dcp")), no_dist=True)

    for name, where, save, load in [
        ("unbroken", "ub", unbroken_save, unbroken_load),
        ("torch.save", "pt", torch_save, torch_load),
        ("safetensors", "st", st_save, st_load),
        ("DCP", "dcp", dcp_save, dcp_load),
    ]:
        s = timed(save)
        os.sync()
        ld = timed(load)
        res[name] = {"save_gbps": nbytes / s / 1e9, "load_gbps": nbytes / ld / 1e9}
        shutil.rmtree(root / where, ignore_errors=True)
    return res


# ---- main ------------------------------------------------------------------------------------


def multi_gpu(root: Path) -> dict[str, Any]:
    """Same-size resume of DDP over NCCL on every GPU here, bit for bit (section 4)."""
    from tests.dist_launch import launch
    from tests.golden import assert_identical, resume_steps

    world = torch.cuda.device_count()
    if world < 2:
        return {"ok": True, "skipped": f"{world} GPU"}
    toy = ROOT / "tests" / "scripts" / "toy_dist.py"
    args = ["--device", "cuda", "--steps", "14", "--save-every", "4", "--width", "256"]
    args += ["--batch-size", str(8 * world), "--n", str(64 * world)]
    ref, cut = root / "ref", root / "cut"
    t0 = time.perf_counter()
    launch(toy, ["--run-dir", str(ref), *args], world, timeout=600)
    launch(toy, ["--run-dir", str(cut), *args, "--signal-at", "6"], world, timeout=600)
    launch(toy, ["--run-dir", str(cut), *args, "--signal-at", "9", "--signal", "TERM"], world)
    launch(toy, ["--run-dir", str(cut), *args], world, timeout=600)
    out: dict[str, Any] = {"world": world, "resumed_at": resume_steps(cut)}
    try:
        assert_identical(ref, cut)
        out["ok"] = out["resumed_at"] == [4, 10]
    except AssertionError as e:
        out["ok"], out["difference"] = False, str(e)[:300]
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[1, 4, 16], help="snapshot GB")
    p.add_argument("--save-gb", type=float, default=4.0)
    p.add_argument("--skip-golden", action="store_true")
    p.add_argument("--skip-multi-gpu", action="store_true")
    p.add_argument("--dir", default=None, help="where files go (default: a temporary dir)")
    p.add_argument("--shm", default="/dev/shm")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA: bench/gpu_check.py needs one GPU; nothing was measured", flush=True)
        print(json.dumps({"bench": "gpu_check", "cuda": False}))
        return 0
    root = Path(tempfile.mkdtemp(prefix="unbroken-gpucheck-", dir=a.dir))
    result: dict[str, Any] = {
        "bench": "gpu_check",
        "cuda": True,
        "device": torch.cuda.get_device_name(),
        "unbroken": unbroken.__version__,
        "torch": torch.__version__,
    }
    t_all = time.perf_counter()
    try:
        if not a.skip_golden:
            result["golden"] = golden(root / "golden")
            print(f"golden char_lm on CUDA (SIGKILL, SIGTERM, resume): {result['golden']}")
        free = torch.cuda.mem_get_info()[0] / 1e9
        result["snapshot"] = {}
        print(
            f"\n{'GB':>5} {'raw pinned s':>13} {'async blocks s':>15} {'async done s':>13} "
            f"{'shm snapshot s':>15} {'blocks/raw':>11}"
        )
        for gb in a.sizes:
            if gb * 2.2 > free:
                print(f"{gb:>5g} skipped: {free:.0f} GB free on the GPU")
                continue
            r = snapshot(gb, a.shm)
            result["snapshot"][str(gb)] = r
            print(
                f"{gb:>5g} {r['raw_pinned_s']:>13.3f} {r['async_blocking_s']:>15.4f} "
                f"{r['async_done_s']:>13.3f} {r['shm_snapshot_s']:>15.3f} "
                f"{r['async_blocking_s'] / r['raw_pinned_s']:>11.3f}",
                flush=True,
            )
        sl = save_load(a.save_gb, root / "save")
        result["save_load"] = sl
        print(f"\n{a.save_gb:g} GB from GPU tensors {'save GB/s':>10} {'load GB/s':>10}")
        for name, r in sl.items():
            print(f"{name:>23} {r['save_gbps']:>10.2f} {r['load_gbps']:>10.2f}", flush=True)
        if not a.skip_multi_gpu:
            result["multi_gpu"] = multi_gpu(root / "multi")
            print(f"\nDDP over NCCL, same-size resume: {result['multi_gpu']}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["seconds"] = round(time.perf_counter() - t_all, 1)
    print(json.dumps(result))
    checks = [result.get("golden", {"ok": True}), result.get("multi_gpu", {"ok": True})]
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
