"""Chapter 09: multi-LoRA serving — many adapters of one base model in one batch.

The engine reaches this chapter by name through chapter 07's seams (nothing here is imported until
an engine is started with enable_lora=True).
"""
