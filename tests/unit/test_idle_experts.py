"""The idle-expert warning: once per idle stretch that reaches the patience, said when the
warnings are read (at a logged step)."""

import torch

from kiln.metrics.idle_experts import IdleExperts


def test_an_idle_stretch_is_named_once_and_again_after_tokens():
    idle = IdleExperts(["layers.1.feed_forward", "layers.2.feed_forward"], patience=2)

    def step(loads) -> list[str]:
        idle.update(torch.tensor(loads))
        return idle.messages()

    quiet = [[0, 3], [5, 0]]
    assert step(quiet) == []
    named = step(quiet)
    assert [m.split(" has")[0] for m in named] == [
        "expert 0 of layers.1.feed_forward",
        "expert 1 of layers.2.feed_forward",
    ]
    assert step(quiet) == []  # still idle: already said
    assert step([[1, 3], [5, 0]]) == []  # expert 0 got a token
    assert step(quiet) == []
    assert len(step(quiet)) == 1  # its new stretch reached 2


def test_stretches_between_two_reads_are_named_at_the_read():
    """Logged every few steps: the stretches that reached the patience in between are named
    once, at the next read, even if the expert got tokens again before it."""
    idle = IdleExperts(["layers.1.feed_forward"], patience=2)
    for loads in ([0, 3], [0, 3], [4, 3], [1, 0], [1, 0], [1, 0]):
        idle.update(torch.tensor([loads]))
    assert [m.split(" has")[0] for m in idle.messages()] == [
        "expert 0 of layers.1.feed_forward",
        "expert 1 of layers.1.feed_forward",
    ]
    assert idle.messages() == []


def test_patience_zero_never_warns():
    idle = IdleExperts(["layers.1.feed_forward"], patience=0)
    for _ in range(5):
        idle.update(torch.tensor([[0, 0]]))
    assert idle.messages() == []
