"""Gang jobs for FP8 on gloo, which has no float8 dtype: float8 all-gathers (FSDP's of weights,
tensor parallel's of activations) move the same bytes as uint8. NCCL takes float8 directly, and
so do the test suite's shared-memory all-gathers (FSDP's in the gang jobs), which move bytes."""

import contextlib

from tests.distributed.workers import kiln_train

FLOAT8_DTYPES = ("float8_e4m3fn", "float8_e5m2")


def kiln_train_gathering_float8_as_bytes(args: list[str]) -> None:
    """`kiln train ARGS` with every float8 all-gather relabelled as uint8 (only the dtype label
    changes); prints how many of each kind ran."""
    counts = {"fsdp": 0, "tensor parallel": 0}
    try:
        with _fsdp_gathers_as_bytes(counts), _tensor_parallel_gathers_as_bytes(counts):
            kiln_train(args)
    finally:
        print(f"float8 all-gathers: {counts}", flush=True)


@contextlib.contextmanager
def _fsdp_gathers_as_bytes(counts: dict[str, int]):
    """FSDP2 gathers its float8 weight shards with all_gather_single on gloo, or with kiln's
    shared-memory all-gather (the gang jobs' default), which moves bytes of any dtype: counted."""
    import torch
    import torch.distributed as dist

    from tests.support.shared_memory_collectives import SharedMemoryAllGather

    gather, shared_gather = dist.all_gather_single, SharedMemoryAllGather.__call__

    def is_float8(tensor) -> bool:
        return str(tensor.dtype).removeprefix("torch.") in FLOAT8_DTYPES

    def as_bytes(output_tensor, input_tensor, *args, **kwargs):
        if is_float8(input_tensor):
            counts["fsdp"] += 1
            output_tensor, input_tensor = (
                output_tensor.view(torch.uint8),
                input_tensor.view(torch.uint8),
            )
        return gather(output_tensor, input_tensor, *args, **kwargs)

    def counted(self, output_tensor, input_tensor, *args, **kwargs):
        counts["fsdp"] += is_float8(input_tensor)
        return shared_gather(self, output_tensor, input_tensor, *args, **kwargs)

    dist.all_gather_single, SharedMemoryAllGather.__call__ = as_bytes, counted
    try:
        yield
    finally:
        dist.all_gather_single, SharedMemoryAllGather.__call__ = gather, shared_gather


@contextlib.contextmanager
def _tensor_parallel_gathers_as_bytes(counts: dict[str, int]):
    """DTensor gathers a float8 activation through the functional all-gather, which torchao's
    Float8TrainingTensor forwards to its float8 data (torchao.float8.float8_ops)."""
    import torch
    from torchao.float8 import float8_ops

    table = float8_ops.FLOAT8_OPS_TABLE
    ops = (
        torch.ops._c10d_functional.all_gather_into_tensor.default,
        torch.ops.c10d_functional.all_gather_into_tensor.default,
    )
    saved = {op: table[op] for op in ops}

    def relabelled(original):
        def gather(aten_op, args, kwargs=None):
            def as_bytes(data, *rest, **options):
                counts["tensor parallel"] += 1
                return aten_op(data.view(torch.uint8), *rest, **options).view(data.dtype)

            return original(as_bytes, args, kwargs)

        return gather

    table.update({op: relabelled(original) for op, original in saved.items()})
    try:
        yield
    finally:
        table.update(saved)
