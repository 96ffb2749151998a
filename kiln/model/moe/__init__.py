"""Mixture of Experts: the MoE feed-forward that replaces the dense one in chosen blocks."""

from kiln.model.moe.balancing import AuxLossScale, attach_aux_loss
from kiln.model.moe.bias_update import update_expert_biases
from kiln.model.moe.block import MoEFeedForward, set_aux_loss_scale
from kiln.model.moe.dispatch import LocalDispatcher
from kiln.model.moe.experts import GroupedExperts
from kiln.model.moe.router import Router

__all__ = [
    "AuxLossScale",
    "GroupedExperts",
    "LocalDispatcher",
    "MoEFeedForward",
    "Router",
    "attach_aux_loss",
    "set_aux_loss_scale",
    "update_expert_biases",
]
