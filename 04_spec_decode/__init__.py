"""Chapter 04: speculative decoding — a drafter proposes k tokens, the target verifies them in
one forward pass, and rejection sampling keeps the target's exact output distribution.

    from spec_decode import RejectionSampler, SpecDecodeMetadata, PLACEHOLDER_TOKEN_ID
    from spec_decode.ops import rejection_sample        # backend: reference | torch | triton | cuda
    from spec_decode import NgramProposer, DraftModelProposer, LayerSkipDraftModel, EagleProposer
    from spec_decode.scheduler import SpecDecodeScheduler   # chapter 03's Scheduler + drafts in Δ

Triton and CUDA modules are imported lazily, so importing this package never imports triton.
"""
from spec_decode.draft_model import DraftModelProposer, LayerSkipDraftModel
from spec_decode.eagle import EagleConfig, EagleHead, EagleProposer
from spec_decode.metadata import (SpecDecodeMetadata, calc_spec_decode_metadata,
                                  spec_decode_metadata_from_scheduler_output)
from spec_decode.metrics import SpecDecodingStats
from spec_decode.ngram_proposer import NgramProposer
from spec_decode.proposer import DraftRequest, Proposer, check_same_vocabulary, validate_draft_token_ids
from spec_decode.reference import PLACEHOLDER_TOKEN_ID
from spec_decode.rejection_sampler import RejectionSampler
from spec_decode.sampling import SpecSamplingMetadata, compute_probs
from spec_decode.tree import TreeAttentionMetadata, tree_attention_mask, tree_positions, verify_tree_greedy

__all__ = [
    "PLACEHOLDER_TOKEN_ID", "RejectionSampler", "SpecDecodeMetadata", "SpecSamplingMetadata",
    "calc_spec_decode_metadata", "compute_probs", "spec_decode_metadata_from_scheduler_output",
    "DraftRequest", "Proposer", "NgramProposer", "DraftModelProposer", "LayerSkipDraftModel",
    "EagleConfig", "EagleHead", "EagleProposer", "check_same_vocabulary", "validate_draft_token_ids",
    "SpecDecodingStats", "TreeAttentionMetadata", "tree_attention_mask", "tree_positions", "verify_tree_greedy",
]
