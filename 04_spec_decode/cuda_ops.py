"""The CUDA backend of the rejection sampler (kernels_cuda/rejection_sampler.{cuh,cu}).

Converts ids to int32 and makes every tensor contiguous (the kernel indexes raw storage),
then calls the extension, built on demand on a GPU machine by `kernels_cuda.load`. On CPU
machines the same .cu file (kernel and launcher) runs in the emulator, kernels_cuda/emulator
(tests/04_spec_decode/test_cuda_kernels_emulated.py).
"""
from __future__ import annotations

import torch


def rejection_sample(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, target_argmax,
                     bonus_token_ids, is_greedy, uniform_probs, inv_exponential, max_spec_len) -> torch.Tensor:
    if not bonus_token_ids.is_cuda:
        raise RuntimeError("backend='cuda' needs CUDA tensors on a GPU (use backend='torch' or 'triton' on CPU)")
    import kernels_cuda
    ext = kernels_cuda.load("rejection_sampler")
    i32 = lambda t: None if t is None else t.to(torch.int32).contiguous()       # noqa: E731
    f32 = lambda t: None if t is None else t.float().contiguous()               # noqa: E731
    batch = bonus_token_ids.shape[0]
    out = torch.empty((batch, max_spec_len + 1), dtype=torch.int32, device=bonus_token_ids.device)
    ext.rejection_sample(out, i32(cu_num_draft_tokens), i32(draft_token_ids), f32(draft_probs), f32(target_probs),
                         i32(target_argmax), i32(bonus_token_ids),
                         None if is_greedy is None else is_greedy.to(torch.int8).contiguous(),
                         f32(uniform_probs), f32(inv_exponential), torch.cuda.current_stream().cuda_stream)
    return out
