"""The model code every chapter builds on that is no chapter's lesson: how a layer picks its
forward per platform, the linear layers and their one seam for a faster matmul, and tensor
parallelism (the rank groups and the layers split over them).

Mirrors vLLM's `vllm/model_executor/` and `vllm/distributed/`:

    custom_op.py        CustomOp: a readable `forward_native` and, optionally, a faster `forward_cpu` /
                        `forward_cuda`, bound once (vLLM: model_executor/custom_op.py)
    linear.py           Linear (+ the linear-method seam: LinearMethodBase, UnquantizedLinearMethod),
                        MergedColumnLinear, QKVLinear, VocabEmbedding
                        (vLLM: layers/linear.py, layers/vocab_parallel_embedding.py)
    parallel_linear.py  ColumnParallelLinear, RowParallelLinear, MergedColumnParallelLinear,
                        QKVParallelLinear, VocabParallelEmbedding, ParallelLMHead: the linears above split
                        over tensor-parallel ranks (vLLM: layers/linear.py, vocab_parallel_embedding.py)
    parallel_state.py   the TP / PP groups and their collectives (vLLM: distributed/parallel_state.py);
                        one rank unless chapter 07's worker sets them up

The Llama decoder built from these is chapter 01's lesson (paged_attention/model/: the small layers,
the attention block and the decoder layer around chapter 01's ops); chapter 04's EAGLE head and
chapter 07's models import it from there. The process handle every chapter's child processes use is
its own package, `processes/`.
"""
