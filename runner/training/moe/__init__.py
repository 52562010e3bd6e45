"""The runner's mixture-of-experts layer: routers (routers.py), the sparse block (layer.py) and its
installation into transformers' OLMoE (olmoe.py)."""

from runner.training.moe.layer import GroupedExperts, MoELayer
from runner.training.moe.routers import Router, RouterOutput, SoftmaxTopKRouter

__all__ = ["GroupedExperts", "MoELayer", "Router", "RouterOutput", "SoftmaxTopKRouter"]
