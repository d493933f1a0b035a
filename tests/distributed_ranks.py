"""Run a test function on W gloo processes on this machine, as torchrun would, with time limits.

``run_ranks(path, "fn", world, tmp_path, *args)`` starts ``world`` processes with torchrun's
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); each
joins a gloo process group (``file://`` rendezvous in ``tmp_path``; with ``join=False`` the
function joins itself, as the command line does), calls ``fn(rank, world, *args)`` from the
test file at ``path`` and sends back its return value or its error as one line. The processes
are forked from a forkserver that has imported torch, transformers and fisherkron once, so a
run costs fork time, not import time. A process that does not finish within ``timeout``
seconds is killed and the test fails: nothing hangs.
"""
from __future__ import annotations

import datetime
import importlib.util
import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
import uuid
from pathlib import Path

import torch

PRELOAD = ["torch", "torch.distributed", "fisherkron", "fisherkron.hf", "fisherkron.hf.distributed", "fisherkron.cli",
           "transformers", "tiny_models", "test_calibration"]
#: seconds a collective may wait for the other rank before gloo raises (a hang becomes an error)
COLLECTIVE_TIMEOUT = 20


def _context():
    """The forkserver context, its server started with ``PRELOAD`` imported (``tests/`` on its path)."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    old = os.environ.get("PYTHONPATH")  # the server ignores sys.path (Python 3.11): it finds tiny_models this way
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent)] + ([old] if old else []))
    try:
        forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    return ctx


def _main(path: str, fn: str, rank: int, world: int, rendezvous: str, env: dict, args: tuple, results,
          join: bool) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # W processes on the machine's cores
    spec = importlib.util.spec_from_file_location(f"_ranks_{uuid.uuid4().hex}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if join:
        dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    try:
        value = getattr(module, fn)(rank, world, *args)
        buf = io.BytesIO()  # as bytes: a tensor put on a queue as is goes by shared memory, gone when we exit
        torch.save(value, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        line = (str(exc).strip().splitlines() or [""])[0]
        results.put((rank, False, f"{type(exc).__name__}: {line}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(path, fn: str, world: int, tmp_path, *args, env: dict | None = None, timeout: float = 60.0,
              join: bool = True) -> list:
    """``[(ok, value or error text)]`` per rank of ``fn(rank, world, *args)`` run on ``world`` gloo processes.

    A process that exits without a result (killed, ``os._exit``) counts as failed with its exit code.
    """
    ctx = _context()
    results = ctx.Queue()
    rendezvous = f"file://{tmp_path}/rendezvous-{uuid.uuid4().hex}"
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), **(env or {})}
    procs = [ctx.Process(target=_main, args=(str(path), fn, r, world, rendezvous, env, args, results, join))
             for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world:
            try:
                rank, ok, value = results.get(timeout=0.2)
                got[rank] = (ok, torch.load(io.BytesIO(value), weights_only=False) if ok else value)
                continue
            except queue.Empty:
                pass
            for r, p in enumerate(procs):
                if r not in got and p.exitcode is not None and results.empty():
                    got[r] = (False, f"exited with code {p.exitcode} without a result")
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(got))
                raise AssertionError(f"rank(s) {missing} gave no result within {timeout} s (a hang?); got {got}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(world)]
