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

This module adds the torch.distributed.checkpoint (DCP) storage backend:

    import torch.distributed.checkpoint as dcp
    import ckptio.torch

    writer = ckptio.torch.StorageWriter("gs://bucket/run7", keep=3)
    dcp.save(state_dict, storage_writer=writer, checkpoint_id=step)
    future = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=step)
    dcp.load(state_dict, storage_reader=ckptio.torch.StorageReader("gs://bucket/run7"))
"""
from ._manager import CheckpointManager
from ._torch_dcp import StorageReader, StorageWriter, decode_value, encode_value

__all__ = ["CheckpointManager", "StorageReader", "StorageWriter", "decode_value", "encode_value"]
