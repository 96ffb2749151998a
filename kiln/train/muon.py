"""Muon for weights sharded in any layout: the same update as on one device.

Muon (Jordan et al. 2024) keeps a momentum of each matrix's gradient and moves the matrix along
the momentum's orthogonalization (a few Newton–Schulz iterations, roughly U·Vᵀ of its SVD). The
orthogonalization mixes every entry of the matrix, so orthogonalizing each rank's FSDP or TP
shard on its own would make the update depend on the layout. Here the momentum lives on the local
shards (elementwise, exact), the matrix is gathered whole for the orthogonalization, and each
rank keeps its own part of the result. Stacked expert weights (experts, rows, cols) are
orthogonalized expert by expert; under expert parallel each ep rank gathers and orthogonalizes
only its own experts.

Every rank holding a matrix can orthogonalize it (`owner_compute = False`: no more
communication, the same work on every rank), or only one of them, its owner, chosen round-robin
over the matrices, which sends the result to the others (`owner_compute = True`: the work is
divided by the ranks, one broadcast per matrix is added).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

# Keller Jordan's quintic Newton–Schulz coefficients (those of torch.optim.Muon).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADJUST_LR = ("original", "match_rms_adamw")


def newton_schulz(
    update: torch.Tensor, *, steps: int, dtype: torch.dtype, eps: float = 1e-7
) -> torch.Tensor:
    """The orthogonalization of `update` (rows, cols), or of each matrix of (n, rows, cols), in
    `dtype`, returned in `update`'s dtype."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    # Frobenius norm at most 1 bounds the spectral norm by 1, where the iteration converges.
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    # Fused multiply-adds, as torch.optim.Muon does them: in bf16 each rounding counts.
    fused = torch.addmm if x.ndim == 2 else torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT
        x = fused(x, fused(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.mT if tall else x).to(update.dtype)


def adjusted_lr(lr: float, shape: torch.Size, rule: str) -> float:
    """The learning rate of a (rows, cols) matrix, or of each of a stack of them: 'original'
    scales by sqrt(max(1, rows / cols)) (Jordan), 'match_rms_adamw' by 0.2 · sqrt(max(rows,
    cols)), which gives the update AdamW's RMS so AdamW's lr and weight decay carry over
    (Liu et al. 2025, Moonlight)."""
    rows, cols = shape[-2], shape[-1]
    if rule == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


class Muon(torch.optim.Optimizer):
    """Muon over 2-D weights and stacked 3-D expert weights, plain or DTensor (any placement)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        *,
        lr: float,
        weight_decay: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr: str = "original",
        ns_dtype: torch.dtype = torch.bfloat16,
        owner_compute: bool = True,
    ):
        assert adjust_lr in ADJUST_LR, adjust_lr
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            adjust_lr=adjust_lr,
        )
        super().__init__(params, defaults)
        self.ns_dtype, self.owner_compute = ns_dtype, owner_compute

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "Muon takes no closure"
        index = 0  # the matrix's position over all groups: it picks the owner
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                update = self._momentum_update(param, group)
                ortho = self._orthogonalized(param, update, group["ns_steps"], owner_index=index)
                index += 1
                local = _local(param)
                local.mul_(1 - group["lr"] * group["weight_decay"])
                local.add_(ortho, alpha=-adjusted_lr(group["lr"], param.shape, group["adjust_lr"]))

    def _momentum_update(self, param: torch.Tensor, group: dict) -> torch.Tensor:
        """This rank's part of the momentum's update direction (Nesterov or plain)."""
        grad = _local(param.grad)
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param.grad)
        buffer = _local(state["momentum_buffer"])
        # An average, as torch.optim.Muon keeps it (the orthogonalization does not see scale).
        buffer.lerp_(grad, 1 - group["momentum"])
        if group["nesterov"]:
            return grad.lerp(buffer, group["momentum"])
        return buffer.clone()

    def _orthogonalized(
        self, param: torch.Tensor, update: torch.Tensor, steps: int, *, owner_index: int
    ) -> torch.Tensor:
        """This rank's part of the orthogonalized update: the matrices gathered whole, then
        orthogonalized by every rank holding them or by one owner that sends them on."""
        if not isinstance(param, DTensor):
            return newton_schulz(update, steps=steps, dtype=self.ns_dtype)
        spread = DTensor.from_local(
            update, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
        whole_placements = _whole_matrices(param)
        whole = spread.redistribute(placements=whole_placements).to_local()
        shared_dims = [d for d, p in enumerate(whole_placements) if p.is_replicate()]
        owner = _owner(param.device_mesh, shared_dims, owner_index)
        if not self.owner_compute or owner is None:
            ortho = newton_schulz(whole, steps=steps, dtype=self.ns_dtype)
        else:
            ortho = _computed_by_owner(whole, param.device_mesh, owner, shared_dims, steps, self)
        result = DTensor.from_local(
            ortho, param.device_mesh, whole_placements, shape=param.shape, stride=param.stride()
        )
        return result.redistribute(placements=param.placements).to_local()


def _whole_matrices(param: DTensor) -> list:
    """Placements under which each rank holds whole matrices: a stack of expert matrices stays
    split along the experts (Shard(0), e.g. over ep), every other split is gathered."""
    return [
        p if param.ndim == 3 and type(p) is Shard and p.dim == 0 else Replicate()
        for p in param.placements
    ]


def _owner(mesh, shared_dims: list[int], index: int) -> list[int] | None:
    """The mesh coordinates, along the dims whose ranks hold the same matrices, of the rank
    that orthogonalizes matrix `index`; None when one rank holds them (nothing to share)."""
    sizes = [mesh.size(d) for d in shared_dims]
    if math.prod(sizes) == 1:
        return None
    owner, rest = [], index % math.prod(sizes)
    for size in reversed(sizes):
        owner.append(rest % size)
        rest //= size
    return owner[::-1]


def _computed_by_owner(
    whole: torch.Tensor, mesh, owner: list[int], shared_dims: list[int], steps: int, muon: Muon
) -> torch.Tensor:
    """Orthogonalized on the owner, then broadcast dim by dim: first along the last shared dim
    inside the owner's line, then along each earlier dim from the ranks that have it."""
    coordinate = mesh.get_coordinate()
    mine = [coordinate[d] for d in shared_dims]
    if mine == owner:
        # Contiguous: the receivers read the bytes in row-major order (a tall matrix comes back
        # from newton_schulz as a transposed view).
        result = newton_schulz(whole, steps=steps, dtype=muon.ns_dtype).contiguous()
    else:
        result = torch.empty_like(whole)
    # After the broadcast along shared dim k, the ranks agreeing with the owner on the dims
    # before k hold the result.
    for k in reversed(range(len(shared_dims))):
        if mine[:k] != owner[:k]:
            continue
        group = mesh.get_group(shared_dims[k])
        source = dist.get_global_rank(group, owner[k])
        dist.broadcast(result, src=source, group=group)
    return result


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
