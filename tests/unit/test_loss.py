import torch
import torch.nn.functional as F

from kiln.tokens import IGNORE_INDEX
from kiln.train.loss import count_valid, token_loss_sum


def test_sum_over_valid_tokens_with_z_loss():
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    labels[0, :3] = IGNORE_INDEX
    valid = labels != IGNORE_INDEX
    expected_ce = sum(
        F.cross_entropy(logits[i, j], labels[i, j]) for i, j in valid.nonzero().tolist()
    )
    expected_z = sum(torch.logsumexp(logits[i, j], -1) ** 2 for i, j in valid.nonzero().tolist())
    assert count_valid(labels) == 7
    assert torch.allclose(token_loss_sum(logits, labels), expected_ce)
    assert torch.allclose(
        token_loss_sum(logits, labels, z_loss_weight=1e-2), expected_ce + 1e-2 * expected_z
    )
