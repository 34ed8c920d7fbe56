"""Run by torchrun in tests/distributed/test_collectives.py: every collective of raccl on
remote_accel tensors against gloo's on the same CPU tensors, in one job. Prints one
line per check ("ok NAME" or "MISMATCH NAME ..."), then "done"."""

import os

import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))
dist.init_process_group(timeout=__import__("datetime").timedelta(seconds=int(os.environ.get("RACCL_TEST_TIMEOUT", "120"))))
dev = torch.device("remote_accel", torch.accelerator.current_device_index())
gloo = dist.new_group(backend="gloo")
checks = 0


def report(name: str, remote, local, exact: bool) -> None:
    global checks
    remote = [t.cpu() for t in remote]
    same = all(torch.equal(r, l) if exact else torch.allclose(r, l, rtol=1e-5, atol=1e-5) for r, l in zip(remote, local))
    checks += 1
    print(f"{'ok' if same else 'MISMATCH'} {name}" + ("" if same else f" remote={remote} local={local}"), flush=True)


def data(n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(1, 7, (n,), generator=g).to(dtype)


# sizes: a tree (small) and a ring (above TREE_MAX_BYTES) for the reductions
for n in (7, 100_003):
    for dtype, ops in ((torch.float32, ("SUM", "PRODUCT", "MIN", "MAX")), (torch.int64, ("SUM", "MIN", "MAX", "BAND",
                                                                                       "BOR", "BXOR"))):
        for op in ops:
            x = data(n, dtype)
            if op == "PRODUCT":
                x = x.sign() * (1 + x.abs() * 1e-3)  # no overflow over ranks
            r, l = x.to(dev), x.clone()
            dist.all_reduce(r, op=getattr(dist.ReduceOp, op))
            dist.all_reduce(l, op=getattr(dist.ReduceOp, op), group=gloo)
            # fixed reduction orders: integers and two ranks' floats are exact
            report(f"all_reduce {op} {dtype} {n}", [r], [l], exact=dtype != torch.float32 or world == 2)
    x = data(n, torch.float32)
    r, l = x.to(dev), x.clone()
    dist.all_reduce(r, op=dist.ReduceOp.AVG)
    dist.all_reduce(l, group=gloo)  # gloo has no AVG
    report(f"all_reduce AVG {n}", [r], [l / world], exact=False)
    for root in range(world):
        x = data(n, torch.float32, salt=root)
        r, l = x.to(dev), x.clone()
        dist.broadcast(r, src=root)
        dist.broadcast(l, src=root, group=gloo)
        report(f"broadcast root {root} {n}", [r], [l], exact=True)
        r, l = x.to(dev), x.clone()
        dist.reduce(r, dst=root)
        dist.reduce(l, dst=dist.get_global_rank(gloo, root), group=gloo)
        if rank == root:
            report(f"reduce root {root} {n}", [r], [l], exact=world == 2)
        else:
            report(f"reduce root {root} {n} leaves the input", [r], [x], exact=True)

for n in (5, 70_001):
    x = data(n, torch.float32)
    outs_r = [torch.empty(n, device=dev) for _ in range(world)]
    outs_l = [torch.empty(n) for _ in range(world)]
    dist.all_gather(outs_r, x.to(dev))
    dist.all_gather(outs_l, x, group=gloo)
    report(f"all_gather {n}", outs_r, outs_l, exact=True)
    whole_r, whole_l = torch.empty(world * n, device=dev), torch.empty(world * n)
    dist.all_gather_into_tensor(whole_r, x.to(dev))
    dist.all_gather_into_tensor(whole_l, x, group=gloo)
    report(f"all_gather_into_tensor {n}", [whole_r], [whole_l], exact=True)
    big = data(world * n, torch.float32, salt=3)
    out_r, out_l = torch.empty(n, device=dev), torch.empty(n)
    dist.reduce_scatter_tensor(out_r, big.to(dev))
    dist.reduce_scatter_tensor(out_l, big, group=gloo)
    report(f"reduce_scatter_tensor {n}", [out_r], [out_l], exact=world == 2)
    parts = list(big.chunk(world))
    out_r, out_l = torch.empty(n, device=dev), torch.empty(n)
    dist.reduce_scatter(out_r, [p.to(dev) for p in parts])
    dist.reduce_scatter(out_l, parts, group=gloo)
    report(f"reduce_scatter {n}", [out_r], [out_l], exact=world == 2)

# all_to_all: equal parts, then parts of other sizes on every rank
x = data(world * 6, torch.float32).view(world * 3, 2)
out_r, out_l = torch.empty_like(x, device=dev), torch.empty_like(x)
dist.all_to_all_single(out_r, x.to(dev))
dist.all_to_all_single(out_l, x, group=gloo)
report("all_to_all_single equal", [out_r], [out_l], exact=True)
send = [rank + d + 1 for d in range(world)]  # rows rank sends to d
recv = [s + rank + 1 for s in range(world)]  # rows s sends here
x = data(sum(send) * 3, torch.float32, salt=5).view(sum(send), 3)
out_r, out_l = torch.empty(sum(recv), 3, device=dev), torch.empty(sum(recv), 3)
dist.all_to_all_single(out_r, x.to(dev), recv, send)
dist.all_to_all_single(out_l, x, recv, send, group=gloo)
report("all_to_all_single uneven", [out_r], [out_l], exact=True)
ins = [data(4, torch.float32, salt=10 + d) for d in range(world)]
outs_r, outs_l = [torch.empty(4, device=dev) for _ in range(world)], [torch.empty(4) for _ in range(world)]
dist.all_to_all(outs_r, [t.to(dev) for t in ins])
dist.all_to_all(outs_l, ins, group=gloo)
report("all_to_all", outs_r, outs_l, exact=True)

# gather and scatter, to and from the last rank
root = world - 1
x = data(9, torch.float32, salt=7)
gathered_r = [torch.empty(9, device=dev) for _ in range(world)] if rank == root else None
gathered_l = [torch.empty(9) for _ in range(world)] if rank == root else None
dist.gather(x.to(dev), gathered_r, dst=root)
dist.gather(x, gathered_l, dst=root, group=gloo)
if rank == root:
    report("gather", gathered_r, gathered_l, exact=True)
parts = [data(6, torch.float32, salt=20 + i) for i in range(world)] if rank == root else None
out_r, out_l = torch.empty(6, device=dev), torch.empty(6)
dist.scatter(out_r, [p.to(dev) for p in parts] if parts else None, src=root)
dist.scatter(out_l, parts, src=root, group=gloo)
report("scatter", [out_r], [out_l], exact=True)

# the coalesced forms, as FSDP and DDP's fast paths issue them
xs = [data(n, torch.float32, salt=30 + n) for n in (3, 11, 40_000)]
rs, ls = [x.to(dev) for x in xs], [x.clone() for x in xs]
with dist._coalescing_manager(async_ops=True) as cm:
    for t in rs:
        dist.all_reduce(t)
cm.wait()
for t in ls:
    dist.all_reduce(t, group=gloo)
report("all_reduce coalesced", rs, ls, exact=world == 2)

# point to point: a ring of send/recv, then a batch where each rank lists its receive first
x = data(8, torch.float32, salt=40)
after, before = (rank + 1) % world, (rank - 1) % world
got_r, got_l = torch.empty(8, device=dev), torch.empty(8)
if rank % 2 == 0:
    dist.send(x.to(dev), after)
    dist.recv(got_r, before)
else:
    dist.recv(got_r, before)
    dist.send(x.to(dev), after)
dist.all_gather_object(expected := [None] * world, x)
report("send/recv", [got_r], [expected[before]], exact=True)
got_r = torch.empty(8, device=dev)
ops = [dist.P2POp(dist.irecv, got_r, before), dist.P2POp(dist.isend, x.to(dev), after)]
for work in dist.batch_isend_irecv(ops):
    work.wait()
report("batch_isend_irecv", [got_r], [expected[before]], exact=True)

# a barrier waits for every rank; objects travel over gloo
dist.barrier()
objects = [None] * world
dist.all_gather_object(objects, {"rank": rank})
assert objects == [{"rank": r} for r in range(world)], objects
print(f"done {checks} checks", flush=True)
dist.destroy_process_group()
