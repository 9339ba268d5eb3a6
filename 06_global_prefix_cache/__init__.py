"""Chapter 06: a global prefix cache across engines, and prefill/decode disaggregation."""
