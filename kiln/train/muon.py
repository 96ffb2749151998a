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
communication, the same work on every rank), or only one of them, its owner, which sends the
result to the others (`owner_compute = True`): the matrices go in buckets of as many as the ranks
holding them, each rank orthogonalizes its own of the bucket, all at once, then each result is
broadcast from its owner. The work is divided by the ranks for one broadcast per matrix, and a
bucket's gathered matrices are held at once.
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
        pending = [
            (param, group, self._momentum_update(param, group))
            for group in self.param_groups
            for param in group["params"]
            if param.grad is not None
        ]
        for bucket in _buckets(pending, by_owner=self.owner_compute):
            for (param, group, _), ortho in zip(bucket, self._orthogonalized(bucket), strict=True):
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

    def _orthogonalized(self, bucket: list[tuple]) -> list[torch.Tensor]:
        """This rank's parts of the orthogonalized updates of `bucket`: matrices held whole, once
        gathered, by the same ranks. With owners, the k-th rank orthogonalizes the k-th matrix,
        all of them at once, and then each is broadcast from its owner; else every rank
        orthogonalizes every matrix."""
        param = bucket[0][0]
        if not isinstance(param, DTensor):
            return [self._newton_schulz(update, group) for _, group, update in bucket]
        mesh, whole_placements = param.device_mesh, _whole_matrices(param)
        shared = [d for d, p in enumerate(whole_placements) if p.is_replicate()]
        mine = [mesh.get_coordinate()[d] for d in shared]
        wholes = [_gathered(p, update, whole_placements) for p, _, update in bucket]
        owners = [
            _owner(mesh, shared, k) if self.owner_compute else None for k in range(len(bucket))
        ]
        results = [
            # Contiguous: receivers read the bytes row-major (a tall matrix comes back from
            # newton_schulz as a transposed view).
            self._newton_schulz(whole, group).contiguous()
            if owner is None or owner == mine
            else torch.empty_like(whole)
            for (_, group, _), whole, owner in zip(bucket, wholes, owners, strict=True)
        ]
        for result, owner in zip(results, owners, strict=True):
            if owner is not None:
                _broadcast(result, mesh, shared, owner=owner, mine=mine)
        return [
            DTensor.from_local(ortho, mesh, whole_placements, shape=p.shape, stride=p.stride())
            .redistribute(placements=p.placements)
            .to_local()
            for (p, _, _), ortho in zip(bucket, results, strict=True)
        ]

    def _newton_schulz(self, update: torch.Tensor, group: dict) -> torch.Tensor:
        return newton_schulz(update, steps=group["ns_steps"], dtype=self.ns_dtype)


def _buckets(pending: list[tuple], *, by_owner: bool) -> list[list[tuple]]:
    """Consecutive matrices that the same ranks hold whole once gathered (one mesh, one way of
    splitting), as many per bucket as those ranks: one matrix for each to orthogonalize."""
    buckets, key = [], None
    for item in pending:
        param = item[0]
        if not isinstance(param, DTensor) or not by_owner:
            buckets.append([item])
            key = None
            continue
        placements = _whole_matrices(param)
        ranks = math.prod(
            param.device_mesh.size(d) for d, p in enumerate(placements) if p.is_replicate()
        )
        item_key = (id(param.device_mesh), tuple(placements))
        if item_key != key or len(buckets[-1]) == ranks:
            buckets.append([])
            key = item_key
        buckets[-1].append(item)
    return buckets


def _gathered(param: DTensor, update: torch.Tensor, placements: list) -> torch.Tensor:
    spread = DTensor.from_local(
        update, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
    )
    return spread.redistribute(placements=placements).to_local()


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


def _broadcast(
    result: torch.Tensor, mesh, shared: list[int], *, owner: list[int], mine: list[int]
) -> None:
    """From the owner to every rank holding the matrix, dim by dim: along the last shared dim
    inside the owner's line, then along each earlier dim from the ranks that have it (after
    the broadcast along dim k, the ranks agreeing with the owner on the dims before k do)."""
    for k in reversed(range(len(shared))):
        if mine[:k] != owner[:k]:
            continue
        group = mesh.get_group(shared[k])
        dist.broadcast(result, src=dist.get_global_rank(group, owner[k]), group=group)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
