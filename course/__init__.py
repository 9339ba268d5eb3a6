"""Course assignments generated from the chapters: build the student edition, grade it, prove it (python -m course)."""
