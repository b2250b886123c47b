"""Helpers shared by test modules (imported as ``from helpers import ...``; pytest puts tests/ on sys.path)."""

import torch

from specresearch.drafts.feature import FeatureHead, FeatureHeadConfig


def feature_head(model, layers=(1, -1), seed=1, scale=0.05, head_tokens=None) -> FeatureHead:
    """A feature head on the transformers ``model``, moved away from its identity-like initialisation by
    seeded noise of std ``scale``: a draft that differs from the target. ``head_tokens``: a trained
    vocabulary-subset head over the first ``head_tokens`` ids."""
    ids = None if head_tokens is None else torch.arange(head_tokens)
    head = FeatureHead(model, FeatureHeadConfig("t", feature_layers=layers, head_tokens=head_tokens,
                                                train_head=head_tokens is not None), head_token_ids=ids, seed=seed)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for p in head.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn_like(p))
    return head
