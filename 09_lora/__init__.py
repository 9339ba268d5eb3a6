"""Chapter 09: multi-LoRA serving — many adapters of one base model in one batch.

    from lora.peft_checkpoint import load_peft_adapter      # a PEFT adapter directory -> per-layer A, B
    from lora.adapter_manager import LoRAAdapterManager     # max_loras device slots + a host LRU
    from lora.layers import apply_lora                      # wrap a model's linear layers (their linear method)
    from lora import ops                                    # shrink / expand: reference | torch | triton | cpu

The pieces run on a model built by chapter 07's loader: `apply_lora(model, manager)` wraps its
target layers, and a per-step token -> slot mapping says which adapter each token uses.
"""
