"""Course task tests (hidden from students: the student edition leaves out tests/course/): each
task's edge cases and the checks that grade one task without any other task's code — oracles
from torch itself (SDPA), caches and queues built by hand, rules written out here.
`python -m course tests` gives every test here to the one task whose regions it runs; the rules
they check are stated in the functions' docstrings, and listed (without the code) in each
chapter's ASSIGNMENT.md."""
