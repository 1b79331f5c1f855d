"""The toy training run on torch.distributed (gloo on CPU): DDP or FSDP2, for the golden tests.

Options beyond toy_train's: ``--mode ddp|fsdp``; ``--signal-rank R|all`` (which ranks signal
themselves after step K); ``--fail-save-at K --fail-rank R`` (rank R's save at step K hits EIO);
``--width W`` (the hidden layer's width: a bigger model for byte counts); ``--io-log FILE``
(each rank writes to ``FILE.<rank>`` the bytes its read syscalls returned while ``Run()`` opened
and resumed, from the kernel's ``/proc/self/io`` ``rchar``, and the seconds it took, as JSON);
``--dump-after-load FILE`` (rank 0 writes the full model, optimizer and EMA tensors right after
the resume to a safetensors file, then exits); ``--grow-at K`` (DDP: a ``before_step``
callback widens the hidden layer from 32 to 64 when step K starts; the loop uses
``run.model`` and ``run.optimizer``, which the change replaces); ``--accumulate K`` (DDP: each
batch in K micro-batches, the first K-1 under ``no_sync()``); ``--bf16`` (the forward under
``torch.autocast(..., dtype=torch.bfloat16)``); ``--device cuda`` (one GPU per rank, NCCL; DDP).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import unbroken
from unbroken.store import _fsops

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.scripts._oracle import Oracle  # noqa: E402


class Noisy(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x @ torch.randn(8, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def get_sample(self, i: int, generator: torch.Generator):
        return self.x[i] + 0.1 * torch.randn(8, generator=generator), self.y[i]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--mode", choices=["ddp", "fsdp"], default="ddp")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--n", type=int, default=72)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--signal-at", type=int, default=None)
    p.add_argument("--signal", default="KILL")
    p.add_argument("--signal-rank", default="all")
    p.add_argument(
        "--signal-attempt", type=int, default=None, help="signal only in this UNBROKEN_ATTEMPT"
    )
    p.add_argument("--snapshot-every", type=int, default=None)
    p.add_argument("--fail-save-at", type=int, default=None)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--dump-after-load", default=None)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--io-log", default=None)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--grow-at", type=int, default=None)
    p.add_argument("--time-limit", type=float, default=None, help="seconds (time_margin 0)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step, rank 1 x2")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: one GPU per rank, NCCL (DDP)")
    a = p.parse_args()

    rank, world = unbroken.init_distributed("nccl" if a.device == "cuda" else "gloo")
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if a.device == "cuda" else "cpu")
    unbroken.seed_everything(0)

    def build(stage: dict) -> torch.nn.Module:
        w = stage["width"]
        return torch.nn.Sequential(
            torch.nn.Linear(8, w),
            torch.nn.ReLU(),
            torch.nn.Dropout(a.dropout),
            torch.nn.Linear(w, 3),
        )

    def widen(ctx) -> unbroken.train.Change | None:
        if ctx.step != a.grow_at:
            return None
        torch.manual_seed(ctx.step)  # the new layers' initial weights: the same on every rank
        return unbroken.train.Change(model=build({"width": 64}), stage={"width": 64})

    model = build({"width": a.width}).to(device)
    if a.mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        net = model
    else:
        net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    ema = unbroken.EMA(model, decay=0.9)
    loader = unbroken.MapLoader(Noisy(a.n), batch_size=a.batch_size, seed=7)
    read_before, t0 = _rchar(), time.perf_counter()
    run = unbroken.Run(
        a.run_dir,
        model=net,
        optimizer=opt,
        ema=ema,
        loader=loader,
        save_every=a.save_every,
        max_steps=a.steps,
        progress=False,
        async_save=a.async_save,
        time_limit=a.time_limit,
        time_margin=0.0,
        **({"snapshot_every": a.snapshot_every} if a.snapshot_every is not None else {}),
        **(
            {"before_step": widen, "model_factory": build, "stage": {"width": 32}}
            if a.grow_at is not None
            else {}
        ),
    )
    if a.io_log:
        with open(f"{a.io_log}.{rank}", "w") as f:
            json.dump({"read": _rchar() - read_before, "seconds": time.perf_counter() - t0}, f)
    if a.dump_after_load:
        from safetensors.torch import save_file

        tensors = {f"model/{k}": full(v) for k, v in model.state_dict().items()}
        for i, (name, p_) in enumerate(model.named_parameters()):
            for key, v in opt.state[p_].items():
                tensors[f"optimizer/state/{name}/{key}"] = full(v)
            del i
        tensors |= {f"ema/shadow/{k}": full(v) for k, v in ema.shadow.items()}
        if rank == 0:
            save_file({k: v.contiguous() for k, v in tensors.items()}, a.dump_after_load)
        run.close()
        return
    oracle = Oracle(a.run_dir, run.counters.step, write=rank == 0, full=full)
    me = a.signal_rank == "all" or int(a.signal_rank) == rank
    if a.signal_attempt is not None:
        me = me and os.environ.get("UNBROKEN_ATTEMPT") == str(a.signal_attempt)
    for x, y in run.loop(loader):
        x, y = x.to(device), y.to(device)
        k = a.accumulate
        loss = torch.zeros((), device=device)
        for i, (xs, ys) in enumerate(zip(x.chunk(k), y.chunk(k), strict=True)):
            last = i == k - 1
            sync = contextlib.nullcontext() if last else run.model.no_sync()
            with sync:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.bf16):
                    part = F.mse_loss(run.model(xs).float(), ys.expand(-1, 3)) / k
                part.backward()
            loss = part.detach() if i == 0 else loss + part.detach()  # the batch's mean
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        ema.update()
        if a.fail_save_at is not None and run.counters.step + 1 == a.fail_save_at:
            if rank == a.fail_rank:
                _fsops.set_hook(_eio_on_write)
        if a.step_sleep:
            time.sleep(a.step_sleep * (2 if rank == 1 else 1))  # rank 1 is the slow one
        oracle.step(run.counters.step + 1, loss)  # before run.step(), which may stop here
        run.step(loss=loss, samples=list(loader.last_indices))
        if a.signal_at is not None and run.counters.step == a.signal_at and me:
            os.kill(os.getpid(), getattr(signal, "SIG" + a.signal))
    oracle.finish(model=getattr(run.model, "module", run.model), optimizer=run.optimizer, ema=ema)
    dist.barrier()
    # No destroy_process_group() or os._exit() here: unbroken's exit (unbroken._dist.clean_exit)
    # keeps gloo's teardown from aborting a finished rank, FSDP2's DTensors and mesh included.


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _eio_on_write(event: str, path: str) -> None:
    if event == "write":
        raise OSError(errno.EIO, os.strerror(errno.EIO), path)


if __name__ == "__main__":
    main()
