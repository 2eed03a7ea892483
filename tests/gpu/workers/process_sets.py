"""Collectives on CUDA tensors in process sets, interleaved with the global set.

Usage: process_sets.py --expect nccl|host   (2 or more ranks)

Static sets: the even ranks, the odd ranks, and every rank as a set of its own (another
communicator over the same ranks as the global set). Each rank runs allreduce, grouped
allreduce, allgather (ragged), broadcast, alltoall, reducescatter and barrier in each set it
belongs to, alternating with global ops, then ops of two sets in flight at once.
"""

import os

import torch

import spark_hvd.torch as hvd
from _data import dn, ints, put, reference
from _gpu import C, main


def sets_for(size):
    return {"evens": list(range(0, size, 2)), "odds": list(range(1, size, 2)),
            "all": list(range(size))}


def in_set(device, rank, ps, label, rnd):
    members = ps.ranks
    n, me = len(members), members.index(rank)
    tag = f"{label}.{rnd}"
    xs = {r: ints(f"{tag}.ar", r, (11,), -8, 9, torch.float32) for r in members}
    got = hvd.allreduce(put(xs[rank], device), op=hvd.Sum, name=f"{tag}.ar", process_set=ps)
    C.same(got, reference([xs[r] for r in members], "Sum"),
           f"set {label} {members}: allreduce Sum (round {rnd})", device=device)
    grouped = [{r: ints(f"{tag}.g{i}", r, (3 + i,), -8, 9, torch.bfloat16) for r in members}
               for i in range(3)]
    got = hvd.grouped_allreduce([put(g[rank], device) for g in grouped], op=hvd.Sum,
                                name=f"{tag}.gar", process_set=ps)
    for i, g in enumerate(grouped):
        C.same(got[i], reference([g[r] for r in members], "Sum"),
               f"set {label}: grouped_allreduce tensor {i} (round {rnd})", device=device)
    rows = {r: ints(f"{tag}.ag", r, (members.index(r) + 1, 2), 0, 50, torch.int64)
            for r in members}
    got = hvd.allgather(put(rows[rank], device), name=f"{tag}.ag", process_set=ps)
    C.same(got, torch.cat([rows[r] for r in members]),
           f"set {label}: allgather ragged (round {rnd})", device=device)
    root = members[-1]
    x = ints(f"{tag}.bc", rank, (7,), 0, 50, torch.float16)
    want = ints(f"{tag}.bc", root, (7,), 0, 50, torch.float16)
    got = hvd.broadcast(put(x, device), root_rank=root, name=f"{tag}.bc", process_set=ps)
    C.same(got, want, f"set {label}: broadcast from global rank {root} (round {rnd})",
           device=device)
    # alltoall: 1 + j rows to the set's j-th member; row = (sender, receiver index).
    def sent(src, dst_index):
        return torch.tensor([[src, dst_index]] * (1 + dst_index), dtype=torch.int32)
    mine = torch.cat([sent(rank, j) for j in range(n)])
    out, received = hvd.alltoall(put(mine, device), splits=[1 + j for j in range(n)],
                                 name=f"{tag}.a2a", process_set=ps)
    C.same(out, torch.cat([sent(src, me) for src in members]),
           f"set {label}: alltoall with splits (round {rnd})", device=device)
    C.check(torch.as_tensor(received).cpu().tolist() == [1 + me] * n,
            f"set {label}: alltoall received_splits", f"got {received}")
    rs = {r: ints(f"{tag}.rs", r, (2 * n, 3), -8, 9, torch.float32) for r in members}
    got = hvd.reducescatter(put(rs[rank], device), op=hvd.Sum, name=f"{tag}.rs",
                            process_set=ps)
    C.same(got, reference([rs[r] for r in members], "Sum")[2 * me:2 * me + 2],
           f"set {label}: reducescatter Sum (round {rnd})", device=device)
    hvd.barrier(process_set=ps)
    C.ok(f"set {label}: barrier (round {rnd})")


def in_global(device, rank, size, rnd):
    for dtype in (torch.float32, torch.int32):
        tag = f"global.{rnd}.{dn(dtype)}"
        xs = [ints(tag, r, (13,), -8, 9, dtype) for r in range(size)]
        got = hvd.allreduce(put(xs[rank], device), op=hvd.Sum, name=tag)
        C.same(got, reference(xs, "Sum"), f"global allreduce {dn(dtype)} between set ops "
               f"(round {rnd})", device=device)


def body(args, device):
    rank, size = hvd.rank(), hvd.size()
    if size < 2:
        C.fail("process sets", "needs 2 or more ranks")
    sets = dict(zip(sets_for(size), STATIC))
    for label, ps in sets.items():
        C.check(ps.ranks == sets_for(size)[label] and ps.process_set_id not in (None, 0),
                f"set {label} registered as {ps.ranks} (id {ps.process_set_id})",
                f"ranks {ps.ranks}, id {ps.process_set_id}")
    for rnd in range(2):
        for label, ps in sets.items():
            if rank in ps.ranks:
                in_set(device, rank, ps, label, rnd)
            in_global(device, rank, size, f"{rnd}.{label}")
    # A set's op and a global op in flight at once, then the "all" set and the global set.
    mine = next(ps for label, ps in sets.items() if label != "all" and rank in ps.ranks)
    everyone = sets["all"]
    xs = [ints("flight", r, (1000,), -8, 9, torch.float32) for r in range(size)]
    h_set = hvd.allreduce_async(put(xs[rank], device), op=hvd.Sum, name="flight.set",
                                process_set=mine)
    h_all = hvd.allreduce_async(put(xs[rank], device), op=hvd.Sum, name="flight.all",
                                process_set=everyone)
    h_glob = hvd.allreduce_async(put(xs[rank], device), op=hvd.Sum, name="flight.global")
    C.same(hvd.synchronize(h_glob), reference(xs, "Sum"), "in flight together: global",
           device=device)
    C.same(hvd.synchronize(h_all), reference(xs, "Sum"), "in flight together: set 'all'",
           device=device)
    C.same(hvd.synchronize(h_set), reference([xs[r] for r in mine.ranks], "Sum"),
           f"in flight together: set {mine.ranks}", device=device)


def static_sets():
    """The sets handed to hvd.init (static sets are known before init: the size comes from
    the launcher's environment)."""
    size = os.environ.get("SPARK_HVD_SIZE")
    if not size:
        C.fail("process sets", "SPARK_HVD_SIZE is not set: run this under the launcher")
    return [hvd.ProcessSet(ranks) for ranks in sets_for(int(size)).values()]


if __name__ == "__main__":
    STATIC = static_sets()
    body.init_kwargs = {"process_sets": STATIC}
    main(body)
