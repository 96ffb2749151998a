"""Mixture of Experts: the MoE feed-forward that replaces the dense one in chosen blocks."""

from kiln.model.moe.balancing import AuxLossScale, attach_aux_loss
from kiln.model.moe.bias_update import update_expert_biases
from kiln.model.moe.block import (
    AUX_LOSSES,
    MoEFeedForward,
    take_aux_loss_sums,
)
from kiln.model.moe.dispatch import LocalDispatcher
from kiln.model.moe.experts import GroupedExperts
from kiln.model.moe.router import Router, uncounted

__all__ = [
    "AUX_LOSSES",
    "AuxLossScale",
    "GroupedExperts",
    "LocalDispatcher",
    "MoEFeedForward",
    "Router",
    "attach_aux_loss",
    "take_aux_loss_sums",
    "uncounted",
    "update_expert_biases",
]
