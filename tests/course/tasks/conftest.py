"""Course task tests (hidden from students): tests that grade one assignment task without
touching any other task's region — oracles from torch itself (SDPA), caches and queues
built by hand, and small stand-ins for the pieces another task implements."""
