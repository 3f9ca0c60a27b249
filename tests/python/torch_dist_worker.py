"""One rank of a torch.distributed job (gloo on 127.0.0.1) for test_py_torch_dist.py.

    python torch_dist_worker.py ROLE RANK WORLD PORT DIR [ROOT ...]

Roles:
  save     FSDP2 (fully_shard) model + AdamW state and a DTensor replicated
           along one mesh dimension, on a CPU device mesh of WORLD ranks:
           dcp.save to each ROOT as step 1; one more training step, then
           dcp.async_save as step 2, the parameters changed right after it
           returned (the checkpoint must hold the values of the snapshot).
           Rank 0 writes the global tensors of both steps to DIR/expected-<step>.pt.
  load     the same model on WORLD ranks (another sharding), dcp.load of
           step 1 and 2 from each ROOT, the global tensors written by rank 0 to
           DIR/loaded-<root index>-<step>.pt.
  kill     saves step 1 to ROOT with dcp.save, then rank 1 kills itself
           (SIGKILL) inside the writer during the save of step 2.
  manager  ckptio.CheckpointManager(ROOT) with no process arguments: its
           ranks and barrier come from torch.distributed; each rank saves
           its own tensor and a shared DTensor, then restores and checks.
"""
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import ckptio
import ckptio.torch


def build(mesh):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 12))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def train_step(model, optim, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 24, generator=g)
    model(x).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()


def state(model, optim, extra, step):
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd, "extra": extra, "step": step, "note": ("dcp", 1.5)}


def full(node):
    """The tree with every DTensor gathered whole (a collective: every rank calls it)."""
    if isinstance(node, DTensor):
        return node.full_tensor()
    if isinstance(node, dict):
        return {k: full(v) for k, v in node.items()}
    if isinstance(node, list):
        return [full(v) for v in node]
    if isinstance(node, tuple):
        return tuple(full(v) for v in node)
    return node.clone() if isinstance(node, torch.Tensor) else node


def extra_tensor(world, fill):
    # (2, world/2) mesh: replicated along the first dimension, sharded by
    # columns along the second; every column chunk is held by 2 ranks.
    mesh2d = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("r", "s"))
    t = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8) * fill
    return distribute_tensor(t, mesh2d, [Replicate(), Shard(1)])


def role_save(rank, world, out, roots):
    mesh = init_device_mesh("cpu", (world,))
    model, optim = build(mesh)
    train_step(model, optim, 1)
    extra = extra_tensor(world, 1.0)
    writers = [ckptio.torch.StorageWriter(root, keep=3) for root in roots]
    sd = state(model, optim, extra, 1)
    for w in writers:
        dcp.save(sd, storage_writer=w, checkpoint_id=1)
    expected = full(sd)
    if rank == 0:
        torch.save(expected, os.path.join(out, "expected-1.pt"))
    train_step(model, optim, 2)
    sd = state(model, optim, extra_tensor(world, 2.0), 2)
    expected = full(sd)
    if rank == 0:
        torch.save(expected, os.path.join(out, "expected-2.pt"))
    for w in writers:
        fut = dcp.async_save(sd, storage_writer=w, checkpoint_id=2)
        with torch.no_grad():  # changed right after the snapshot, put back exactly once the save is done
            kept = [p.to_local().clone() for p in model.parameters()]
            for p in model.parameters():
                p.to_local().add_(100.0)
        fut.result()
        with torch.no_grad():
            for p, k in zip(model.parameters(), kept):
                p.to_local().copy_(k)
    for w in writers:
        w.close()


def role_load(rank, world, out, roots):
    mesh = init_device_mesh("cpu", (world,))
    model, optim = build(mesh)
    train_step(model, optim, 99)  # other values, the same structure (optimizer state exists)
    for i, root in enumerate(roots):
        reader = ckptio.torch.StorageReader(root)
        for step in (1, 2):
            sd = state(model, optim, extra_tensor(world, 0.0), 0)
            dcp.load(sd, storage_reader=reader, checkpoint_id=step)
            set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            msd, osd = get_state_dict(model, optim)
            loaded = full({"model": msd, "optim": osd, "extra": sd["extra"], "step": sd["step"], "note": sd["note"]})
            if rank == 0:
                torch.save(loaded, os.path.join(out, f"loaded-{i}-{step}.pt"))
        reader.close()


class KillingWriter(ckptio.torch.StorageWriter):
    def write_data(self, plan, planner):
        if self._step == 2 and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().write_data(plan, planner)


def role_kill(rank, world, out, roots):
    mesh = init_device_mesh("cpu", (world,))
    model, optim = build(mesh)
    writer = KillingWriter(roots[0])
    dcp.save(state(model, optim, extra_tensor(world, 1.0), 1), storage_writer=writer, checkpoint_id=1)
    if rank == 0:
        torch.save(full(state(model, optim, extra_tensor(world, 1.0), 1)), os.path.join(out, "expected-1.pt"))
    else:
        full(state(model, optim, extra_tensor(world, 1.0), 1))
    train_step(model, optim, 2)
    print("saving step 2", flush=True)
    dcp.save(state(model, optim, extra_tensor(world, 2.0), 2), storage_writer=writer, checkpoint_id=2)
    print("step 2 saved", flush=True)


def role_manager(rank, world, out, roots):
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(40, dtype=torch.float64).reshape(10, 4)
    shared = distribute_tensor(full, mesh, [Shard(0)])
    mgr = ckptio.CheckpointManager(roots[0], keep=2, staging_memory="64MiB")
    assert mgr._process == (rank, world), mgr._process
    # A tree with DTensors: each rank writes its chunk, rank 0 the whole tensors.
    common = torch.full((3,), 7.0)
    mgr.save(5, {"common": common, "shared": shared})
    common.fill_(-1.0)  # after the snapshot
    # A tree of each rank's own tensors: each rank writes its own.
    mine = torch.full((2,), float(rank))
    mgr.save(6, {f"rank{rank}": mine})
    mgr.wait_until_finished()
    target = {"common": torch.zeros(3), "shared": distribute_tensor(torch.zeros(10, 4, dtype=torch.float64), mesh,
                                                                      [Shard(0)])}
    got = mgr.restore(5, target=target)
    assert torch.equal(got["common"], torch.full((3,), 7.0)), got
    assert isinstance(got["shared"], DTensor) and torch.equal(got["shared"].full_tensor(), full)
    local_ptr = target["shared"].to_local().data_ptr()
    assert mgr.restore_into(5, target) == 5
    assert target["shared"].to_local().data_ptr() == local_ptr
    assert torch.equal(target["shared"].full_tensor(), full)
    other = mgr.restore(6)[f"rank{1 - rank}"]  # numpy: the tree stored is rank 0's part alone
    assert torch.equal(torch.as_tensor(other), torch.full((2,), float(1 - rank)))
    mgr.close()
    print(f"rank {rank} ok", flush=True)


def main():
    role, rank, world, port, out, *roots = sys.argv[1:]
    rank, world = int(rank), int(world)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        {"save": role_save, "load": role_load, "kill": role_kill, "manager": role_manager}[role](rank, world, out, roots)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
