"""Per-dataset loss of a mixture, accumulated on the device between two log lines."""

from __future__ import annotations

import torch
import torch.distributed as dist

from kiln.train.loss import count_valid_per_row


class DatasetLosses:
    def __init__(self, names: list[str], device: torch.device):
        self.names = names
        self.loss_sums = torch.zeros(len(names), dtype=torch.float64, device=device)
        self.tokens = torch.zeros(len(names), dtype=torch.float64, device=device)

    def add(
        self, row_losses: torch.Tensor, labels: torch.Tensor, dataset_ids: torch.Tensor
    ) -> None:
        """Add one batch: the token-loss sum of each sequence (zero on pipeline stages without
        the loss) and each sequence's dataset."""
        ids = dataset_ids.to(self.loss_sums.device)
        self.loss_sums.index_add_(0, ids, row_losses.double())
        self.tokens.index_add_(0, ids, count_valid_per_row(labels).double())

    def reduce(
        self, *, data_group: dist.ProcessGroup | None, pipeline_group: dist.ProcessGroup | None
    ) -> dict[str, float]:
        """`loss/<name>`: mean loss per token over all ranks since the last call; then reset.
        Every rank holds the tokens of its data shard; the loss sits on the last pipeline stage."""
        if pipeline_group is not None:
            dist.all_reduce(self.loss_sums, group=pipeline_group)
        if data_group is not None:
            dist.all_reduce(self.loss_sums, group=data_group)
            dist.all_reduce(self.tokens, group=data_group)
        out = {
            f"loss/{name}": (loss / tokens).item()
            for name, loss, tokens in zip(self.names, self.loss_sums, self.tokens, strict=True)
            if tokens > 0
        }
        self.loss_sums.zero_()
        self.tokens.zero_()
        return out
