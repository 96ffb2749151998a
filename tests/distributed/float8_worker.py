"""A gang job for FP8 with float8 all-gathers under FSDP on gloo, which has no float8 dtype."""

from tests.distributed.workers import kiln_train

FLOAT8_DTYPES = ("float8_e4m3fn", "float8_e5m2")


def kiln_train_gathering_float8_as_bytes(args: list[str]) -> None:
    """`kiln train ARGS` with FSDP's all-gathers of float8 tensors moving the same bytes as
    uint8 (NCCL takes float8 directly; gloo refuses the dtype). Only the dtype label changes."""
    import torch
    import torch.distributed as dist

    gather = dist.all_gather_single

    def as_bytes(output_tensor, input_tensor, *args, **kwargs):
        if str(input_tensor.dtype).removeprefix("torch.") in FLOAT8_DTYPES:
            output_tensor, input_tensor = (
                output_tensor.view(torch.uint8),
                input_tensor.view(torch.uint8),
            )
        return gather(output_tensor, input_tensor, *args, **kwargs)

    dist.all_gather_single = as_bytes
    try:
        kiln_train(args)
    finally:
        dist.all_gather_single = gather
