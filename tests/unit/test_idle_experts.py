"""The idle-expert warning: once per idle stretch, at the step the stretch reaches the patience."""

import torch

from kiln.metrics.idle_experts import IdleExperts


def test_an_idle_stretch_is_named_once_and_again_after_tokens():
    idle = IdleExperts(["layers.1.feed_forward", "layers.2.feed_forward"], patience=2)
    quiet = torch.tensor([[0, 3], [5, 0]])
    assert idle.update(quiet) == []
    named = idle.update(quiet)
    assert [m.split(" has")[0] for m in named] == [
        "expert 0 of layers.1.feed_forward",
        "expert 1 of layers.2.feed_forward",
    ]
    assert idle.update(quiet) == []  # still idle: already said
    assert idle.update(torch.tensor([[1, 3], [5, 0]])) == []  # expert 0 got a token
    assert idle.update(quiet) == []
    assert len(idle.update(quiet)) == 1  # its new stretch reached 2


def test_patience_zero_never_warns():
    idle = IdleExperts(["layers.1.feed_forward"], patience=0)
    assert all(idle.update(torch.tensor([[0, 0]])) == [] for _ in range(5))
