"""Chapter 04: speculative decoding — a drafter proposes k tokens, the target verifies them in
one forward pass, and rejection sampling keeps the target's exact output distribution.

    from spec_decode import RejectionSampler, SpecDecodeMetadata, PLACEHOLDER_TOKEN_ID
    from spec_decode.ops import rejection_sample        # backend: reference | torch | triton | cuda

Triton and CUDA modules are imported lazily, so importing this package never imports triton.
"""
from spec_decode.metadata import (SpecDecodeMetadata, calc_spec_decode_metadata,
                                  spec_decode_metadata_from_scheduler_output)
from spec_decode.reference import PLACEHOLDER_TOKEN_ID
from spec_decode.rejection_sampler import RejectionSampler
from spec_decode.sampling import SpecSamplingMetadata, compute_probs

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "RejectionSampler",
    "SpecDecodeMetadata",
    "SpecSamplingMetadata",
    "calc_spec_decode_metadata",
    "compute_probs",
    "spec_decode_metadata_from_scheduler_output",
]
