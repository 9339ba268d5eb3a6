"""`python -m mini_vllm {generate, chat, bench, demo}` (see cli.py)."""
from mini_vllm.cli import main

if __name__ == "__main__":
    main()
