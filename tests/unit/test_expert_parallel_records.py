"""The expert-parallel figures of a step: counted per exchange, shown on the console line."""

import torch

from kiln.metrics.logger import MetricsLogger
from kiln.parallel.all_to_all_stats import AllToAllStats


def test_only_rows_that_leave_or_reach_the_rank_count():
    stats = AllToAllStats(torch.device("cpu"))
    # Rank 1 of 3 keeps its 7 rows for its own experts.
    stats.count_tokens(sent=[5, 7, 0], received=[2, 7, 4], rank=1)
    stats.count_bytes(sent=[5, 7, 0], received=[2, 7, 4], rank=1, row_bytes=512)
    assert (stats.sent_tokens, stats.received_tokens) == (5, 6)
    assert (stats.sent_bytes, stats.received_bytes) == (5 * 512, 6 * 512)
    with stats.timed():
        pass
    assert stats.seconds() >= 0
    stats.reset()
    assert stats.sent_tokens == stats.sent_bytes == 0 and stats.seconds() == 0


def test_the_console_line_shows_the_all_to_all_share_and_mtp_losses(tmp_path):
    logger = MetricsLogger(tmp_path, max_steps=10, start_step=0, jsonl=False)
    record = {
        "step": 3,
        "loss": 2.0,
        "loss_avg": 2.1,
        "grad_norm": 0.5,
        "lr": 1e-3,
        "tokens_per_sec": 1000.0,
        "ep/all_to_all_share": [0.081, 0.124],
        "ep/sent_tokens": [270, 1288],
    }
    assert logger.format_line(record).endswith("all-to-all 12% of step, 1,288 tokens out")
    # DeepSeek-V3's multi-token prediction loss follows the loss, which does not include it.
    line = logger.format_line(record | {"mtp_loss_1": 2.53125})
    assert "| loss 2.0000 (mean 2.1000) | mtp_loss_1 2.5312 | grad_norm" in line
