"""fisherkron's collectives and data-parallel MFF on NCCL: run under torchrun, one process per GPU.

    torchrun --standalone --nproc_per_node=$(nvidia-smi -L | wc -l) scripts/nccl_check.py

``--device cpu`` runs the same checks on gloo with CPU tensors (a check of this script on a
machine without GPUs: ``torchrun --standalone --nproc_per_node=2 scripts/nccl_check.py --device cpu``).

Every rank joins an NCCL group through :class:`fisherkron.hf.distributed.Launch` (the path of
``torchrun ... -m fisherkron compress --device cuda``) and checks, against single-process
results computed on the same rank:

1. the primitives of :mod:`fisherkron.core.distributed` with CPU and CUDA tensors (NCCL takes
   only CUDA tensors: ``_comm_device`` must move CPU ones there and back): ``all_reduce_sum``
   with its failure flag, ``all_reduce_`` on a non-contiguous view, ``broadcast_int``,
   ``broadcast_tensor``, ``broadcast_object``, ``agree`` (no failure, and one rank's failure);
2. one product of ``R(F)`` and of ``R(F)^T`` (Eqs. (12), (23)) of :class:`RearrangedFisher`
   with the group (each rank holds batches ``i % W == rank``) against the product over all ``k``
   gradients without a group, and ``fisher_norm_sq`` against ``GradientStack.fisher_norm_sq``;
3. Algorithm 1 (:func:`fisherkron.mff`, float64, K-FAC-free identity start) with the group against
   the single-process MFF: ``||A (x) B - A0 (x) B0||_F / ||A0 (x) B0||_F``.

A group of one process is the single-process path for :func:`fisherkron.mff` (``resolve_group``
returns ``None``): on a machine with one GPU, step 3 passes the group through to the
data-parallel code with ``resolve_group`` replaced by the identity, so that every collective of
that path still runs on NCCL (the sums are then over one rank; a world of two or more GPUs is
needed to see the batches of one rank meet those of another). Prints one line per check and
exits non-zero if any fails.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import fisherkron as fk
from fisherkron.core import distributed as D
from fisherkron.core import factorization
from fisherkron.core.operators import GradientStack, RearrangedFisher
from fisherkron.experiments.benchmark import kron_rel_error
from fisherkron.hf.distributed import Launch, torchrun_world
from fisherkron.testing import rel_error

#: float64 throughout: sums over ranks differ from one sum only in the order of additions
TOL = 1e-10


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: NCCL, one GPU per process (default); cpu: gloo (checks this script)")
    a = p.parse_args(argv)
    rank, world = torchrun_world()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if a.device == "cuda":
        if torch.cuda.device_count() <= local:
            print(f"nccl_check: LOCAL_RANK {local} but torch sees {torch.cuda.device_count()} CUDA device(s); "
                  f"start one process per GPU, or pass --device cpu", file=sys.stderr)
            return 2
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    launch = Launch(rank, world, str(dev))
    launch.join(timeout=120)
    g = dist.group.WORLD
    backend = "nccl" if dev.type == "cuda" else "gloo"
    results: list[tuple[str, bool, str]] = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        results.append((name, bool(ok), detail))

    check(f"backend is {backend}", dist.get_backend(g) == backend, dist.get_backend(g))
    ranks = range(world)
    # 1. primitives, each with a CPU and a CUDA tensor
    for where in dict.fromkeys((torch.device("cpu"), dev)):
        base = torch.arange(6, dtype=torch.float64, device=where)
        buf = torch.cat([base * (rank + 1), torch.zeros(1, dtype=torch.float64, device=where)])
        out, failures = D.all_reduce_sum(buf, g, failed=rank == 0)
        want = base * sum(r + 1 for r in ranks)
        check(f"all_reduce_sum on {where}", out.device == buf.device and torch.equal(out[:-1], want) and failures == 1,
              f"failures={failures}")
        x = (torch.arange(12, dtype=torch.float32, device=where).view(3, 4) * (rank + 1)).t()  # non-contiguous
        ref = torch.arange(12, dtype=torch.float32, device=where).view(3, 4).t() * sum(r + 1 for r in ranks)
        y = D.all_reduce_(x, g)
        check(f"all_reduce_ (non-contiguous) on {where}", y is x and torch.equal(x, ref))
        t = torch.full((2, 3), float(rank + 7), device=where)
        b = D.broadcast_tensor(t, g)
        check(f"broadcast_tensor on {where}", b.device == t.device and torch.equal(b, torch.full((2, 3), 7.0, device=where))
              and torch.equal(t, torch.full((2, 3), float(rank + 7), device=where)))
    check("broadcast_int", D.broadcast_int(41 + rank, g) == 41)
    check("broadcast_object", D.broadcast_object({"rank": rank, "x": [1.5]}, g) == {"rank": 0, "x": [1.5]})
    try:
        D.agree(g, None, "a step that succeeded everywhere")
        check("agree without a failure", True)
    except Exception as exc:  # noqa: BLE001
        check("agree without a failure", False, repr(exc))
    try:
        D.agree(g, ValueError("planted") if rank == world - 1 else None, "a planted failure")
        check("agree with a failure on the last rank", False, "no exception")
    except Exception as exc:  # noqa: BLE001
        check("agree with a failure on the last rank", "planted" in str(exc), str(exc))

    # 2. products of R(F) and R(F)^T, and ||F||^2, over the ranks' batches
    from fisherkron.experiments.synthetic_gradients import synthetic_gradients
    k, n, m = 7, 96, 40  # odd k: ranks hold different numbers of batches
    G = synthetic_gradients(n, m, k, tokens=16, rho=0.5, seed=0, dtype=torch.float64).G.to(dev)  # (k, n, m)
    mine = G[rank::world]
    single = RearrangedFisher(GradientStack(G, dtype=torch.float64, device=dev))
    if len(mine):
        shared = RearrangedFisher(GradientStack(mine, dtype=torch.float64, device=dev), group=g, k=k)
        # R(F) vec(Z) = vec((1/k) sum_i G_i^T Z G_i): Z (n x n) -> (m x m); R(F)^T: Y (m x m) -> (n x n)
        Z = torch.randn(n, n, dtype=torch.float64, device=dev, generator=torch.Generator(device=dev).manual_seed(1))
        Y = torch.randn(m, m, dtype=torch.float64, device=dev, generator=torch.Generator(device=dev).manual_seed(2))
        e1, e2 = rel_error(shared.apply(Z), single.apply(Z)), rel_error(shared.apply_adjoint(Y), single.apply_adjoint(Y))
        check("R(F) product over the group", e1 <= TOL, f"rel. error {e1:.1e}")
        check("R(F)^T product over the group", e2 <= TOL, f"rel. error {e2:.1e}")
        check("all_reduce bytes counted", shared.comm_bytes == D.product_comm_bytes(m) + D.product_comm_bytes(n),
              f"{shared.comm_bytes} bytes")
        stack = GradientStack(mine, dtype=torch.float64, device=dev)
        nf, nf0 = D.fisher_norm_sq(stack, g, k), single.grads.fisher_norm_sq()
        check("fisher_norm_sq over the group", abs(nf - nf0) <= TOL * nf0, f"{nf:.6g} vs {nf0:.6g}")

    # 3. Algorithm 1 over the group against one process
    ref = fk.mff(G, dtype=torch.float64, tol=1e-12, compute_norm=True, name="single")
    resolve = factorization.resolve_group
    if world == 1:
        factorization.resolve_group = lambda group: None if group is None else g  # see the module docstring
    try:
        got = fk.mff(mine, dtype=torch.float64, tol=1e-12, compute_norm=True, name="nccl", group=g)
    finally:
        factorization.resolve_group = resolve
    err = kron_rel_error(got.A, got.B, ref.A, ref.B)
    check("mff over the group", err <= TOL and got.matvecs == ref.matvecs,
          f"rel. error {err:.1e}, {got.matvecs} vs {ref.matvecs} products, {got.comm_bytes} bytes all-reduced")
    launch.close()
    failed = [r for r in results if not r[1]]
    if rank == 0:
        for name, ok, detail in results:
            print(f"[{backend}_check] {'ok  ' if ok else 'FAIL'} {name}" + (f" ({detail})" if detail else ""), flush=True)
        where = (f"{torch.cuda.get_device_name(dev)}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
                 if dev.type == "cuda" else "CPU, gloo")
        print(f"[{backend}_check] world {world} on {where}, torch {torch.__version__}: "
              f"{len(results) - len(failed)} of {len(results)} checks passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
