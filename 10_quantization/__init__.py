"""Chapter 10: quantization — integer weights read straight by the matmul, and the checkpoints
that carry them.

    from quantization.reference import QuantScheme, quantize_rtn      # round-to-nearest, the oracle
    from quantization import packing                                   # int4 / int8 in int32 words
"""
