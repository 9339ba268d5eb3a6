"""Stand-ins for chapter 06's grouping and metadata-lookup tasks, used by the grader while it
grades the connector/layer task (course/tasks.toml `standins`): plain versions written from
the docstrings, so that task's grade does not depend on the other two."""
import time

from global_prefix_cache import grouping, metadata


def group_concurrent_contiguous(src_ids, dst_ids):
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    runs = []
    for s, d in zip(src_ids, dst_ids):
        if runs and s == runs[-1][0][-1] + 1 and d == runs[-1][1][-1] + 1:
            runs[-1][0].append(s)
            runs[-1][1].append(d)
        else:
            runs.append(([s], [d]))
    return [r[0] for r in runs], [r[1] for r in runs]


def query_prefix(self, block_hashes):
    with self._lock:
        hits = []
        for h in block_hashes:
            meta = self._blocks.get(h)
            if meta is None:
                break
            meta.last_access = time.time()
            self._lru[meta.node_id].move_to_end(h)
            hits.append(meta)
        self.stats["queries"] += 1
        self.stats["query_blocks"] += len(block_hashes)
        self.stats["hit_blocks"] += len(hits)
        return hits


def apply(monkeypatch):
    monkeypatch.setattr(grouping, "group_concurrent_contiguous", group_concurrent_contiguous)
    monkeypatch.setattr(metadata.MetadataServer, "query_prefix", query_prefix)
