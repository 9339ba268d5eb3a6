"""Chapter 08: structured output — grammars compiled to token masks.

    from structured_output.regex_dfa import compile_regex         # regex -> byte-level DFA
    from structured_output.json_schema import schema_to_regex     # JSON Schema -> regex
    from structured_output.token_index import TokenIndex          # DFA state -> allowed tokens (bitmask)
    from structured_output.grammar import parse_grammar           # EBNF (GBNF notation) -> rules
    from structured_output.pda import ...                         # the pushdown automaton over bytes
    from structured_output import ops                             # the bitmask applied to logits: reference | torch | triton | cpu
    from structured_output.backend import FromScratchBackend      # all of it behind the engine's seam

The engine reaches this chapter by name (mini_vllm/structured_output_backend.py: BACKENDS); nothing
here is imported until a request asks for structured output. Modules import torch and triton only
where they need them.
"""
