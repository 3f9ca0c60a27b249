"""ckptio for PyTorch trainers.

``ckptio.CheckpointManager`` takes torch state directly (no import of this
module needed): ``save(step, {"model": model.state_dict(), "optim":
optimizer.state_dict(), "epoch": 3})`` copies CPU tensors straight from
their memory into staging (GPU tensors through pinned memory of its own),
``restore()`` gives torch tensors back where torch tensors were saved,
``restore(step, target=state)`` tensors of the target's dtypes and devices,
and ``restore_into(step, state)`` reads straight into the target's tensors.
DTensors (FSDP2's ``fully_shard``) are saved as each rank's chunk. With a
default torch.distributed process group, the manager's ranks and barrier
come from it.

With ``CheckpointManager(root, snapshot="background")`` a save costs the
trainer almost nothing: save() returns before the copy into staging, and
``wait_before_step(manager, optimizer)`` makes the optimizer step (the first
thing that changes the parameters and the optimizer state) wait for it, so
the copy overlaps the forward and backward passes:

    manager = ckptio.CheckpointManager(root, snapshot="background")
    ckptio.torch.wait_before_step(manager, optimizer)
    for step in range(steps):
        loss = model(batch).sum(); loss.backward()
        optimizer.step(); optimizer.zero_grad()
        if step % 100 == 0:
            manager.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict()})

A tensor changed in place during its copy anyway fails that save, naming it.

This module adds the torch.distributed.checkpoint (DCP) storage backend:

    import torch.distributed.checkpoint as dcp
    import ckptio.torch

    writer = ckptio.torch.StorageWriter("gs://bucket/run7", keep=3)
    dcp.save(state_dict, storage_writer=writer, checkpoint_id=step)
    future = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=step)
    dcp.load(state_dict, storage_reader=ckptio.torch.StorageReader("gs://bucket/run7"))
"""
from ._manager import CheckpointManager
from ._torch import wait_before_step
from ._torch_dcp import StorageReader, StorageWriter, decode_value, encode_value

__all__ = ["CheckpointManager", "StorageReader", "StorageWriter", "decode_value", "encode_value", "wait_before_step"]
